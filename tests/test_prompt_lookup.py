"""Prompt lookup (n-gram speculation): drafts from the request's own prompt and output,
checked in one extend step. The oracle is the same request with prompt_lookup=False:
greedy and seeded outputs are the same token for token; under sampling each pick is the
rejection rule of a one-token draft, checked here by its frequencies."""

from __future__ import annotations

import functools
import json
import math
import random
from collections import Counter, defaultdict

import pytest
import torch
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb import Runtime
from sgl_nb.runtime.engine_config import EngineConfig
from sgl_nb.runtime.events import EventBus, Token
from sgl_nb.runtime.prompt_lookup import (
    FIRST_BACKOFF,
    FIRST_DRAFT,
    MAX_BACKOFF,
    MAX_DRAFT,
    MAX_NGRAM,
    MIN_NGRAM,
    NgramIndex,
    PromptLookup,
    StepCosts,
)
from sgl_nb.runtime.request import Request
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.runtime.token_picker import PickRows, TokenPicker
from sgl_nb.tracing import load

slow = pytest.mark.slow

INVOICE = ("Invoice 4471 from Northwind Traders, dated 12 March 2024. Bill to: Contoso Ltd, "
           "221B Baker Street, London NW1 6XE. Items: 3 x steel brackets at 4.50 GBP, 10 x "
           "hex bolts M8 at 0.35 GBP, 1 x drill press model DP-300 at 289.00 GBP. Payment "
           "due within 30 days by bank transfer to account 12-34-56 78901234.")
CODE = ("def total(items):\n    result = 0\n    for item in items:\n        result += "
        "item.price * item.count\n    return result\n")
NOTE_SCHEMA = {"type": "object", "properties": {
    "seller": {"type": "string", "maxLength": 40}, "note": {"type": "string", "maxLength": 300}},
    "required": ["seller", "note"]}


@sgl.function
def repeat_text(s):
    s += sgl.user("Repeat this text exactly, word for word:\n\n" + INVOICE)
    s += sgl.assistant(sgl.gen("copy", max_tokens=80))


@sgl.function
def edit_code(s):
    s += sgl.user("Rename the function `total` to `order_total`. Reply with the whole code "
                  "only.\n\n" + CODE)
    s += sgl.assistant(sgl.gen("code", max_tokens=60))


@sgl.function
def extract_by_regex(s):
    s += "Document: " + INVOICE + "\nThe seller and the buyer, as written in the document: "
    s += sgl.gen("parties", regex=r"[A-Za-z ,.]{5,60}", max_tokens=20)


@sgl.function
def extract_json(s):
    s += sgl.user("Copy this text into the field note of a JSON object:\n\n" + INVOICE)
    s += sgl.assistant(sgl.gen("json", json_schema=NOTE_SCHEMA, max_tokens=80))


@sgl.function
def penalized_copy(s):
    s += sgl.user("Repeat this text exactly, word for word:\n\n" + INVOICE)
    s += sgl.assistant(sgl.gen("copy", max_tokens=50, frequency_penalty=0.3))


@sgl.function
def sampled_copy(s):
    s += sgl.user("Repeat this text exactly, word for word:\n\n" + INVOICE)
    s += sgl.assistant(sgl.gen("copy", max_tokens=50, temperature=0.7, seed=11))


@sgl.function
def stop_inside_a_copy(s):
    s += sgl.user("Repeat this text exactly, word for word:\n\n" + INVOICE)
    s += sgl.assistant(sgl.gen("copy", max_tokens=80, stop="Baker"))


@sgl.function
def forked_copies(s):
    s += "Text: " + CODE
    forks = s.fork(2)
    forks += lambda i: f"\nThe same text again, copy {i + 1}:\n"
    forks += sgl.gen("again", max_tokens=40)
    forks.join()


PROGRAMS = [repeat_text, edit_code, extract_by_regex, extract_json, penalized_copy,
            sampled_copy, stop_inside_a_copy, forked_copies]
COUNTS = ("generated_tokens", "forced_tokens", "prompt_lookup_drafted",
          "prompt_lookup_accepted", "prompt_lookup_steps_saved", "jump_forward_tokens")


# ---- the index and the policy (no model) ------------------------------------------------

def _draft_by_search(seq: list[int], k: int) -> list[int]:
    """What NgramIndex.draft must give, by searching the whole sequence."""
    end = len(seq)
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if end <= n:
            continue
        tail = seq[end - n :]
        starts = [i for i in range(end - n) if seq[i : i + n] == tail]
        if starts:
            at = starts[-1] + n
            out = []
            while len(out) < k:
                src = at + len(out)
                out.append(seq[src] if src < end else out[src - end])
            return out
    return []


def test_ngram_index_agrees_with_a_search_of_the_whole_sequence():
    rng = random.Random(3)
    for alphabet in (2, 4, 9):
        seq = [rng.randrange(alphabet) for _ in range(300)]
        index = NgramIndex()
        index.extend(seq[:5])
        for end in range(5, len(seq) + 1):
            assert index.draft(6) == _draft_by_search(seq[:end], 6), (alphabet, end)
            if end < len(seq):
                index.extend(seq[end : end + 1])
    drafts = NgramIndex()
    drafts.extend([7, 8, 9, 1, 2, 7, 8])
    assert drafts.draft(4) == [9, 1, 2, 7]  # the 2-gram (7, 8) was followed by 9
    drafts.extend([5, 6, 5, 6])
    assert drafts.draft(5) == [5, 6, 5, 6, 5]  # a repeating phrase: its next repetitions
    drafts.extend([3])
    assert drafts.draft(5) == []  # (6, 3) never occurred before


def test_backoff_after_a_miss_and_reset_after_a_hit():
    lookup = PromptLookup()
    prompt, out = [1, 2, 3, 4, 1, 2], [3]  # ends "2 3": drafts "4 1 2 ..."
    assert lookup.propose(9, prompt, out, 10)[:3] == [4, 1, 2]
    assert lookup.drafting(9)
    lookup.checked(9, 0, len(out))  # the model took none: wait FIRST_BACKOFF tokens
    assert not lookup.drafting(9)
    for _ in range(FIRST_BACKOFF):
        assert lookup.propose(9, prompt, out, 10) == []
        out.append(5)
    out += [2, 3]
    assert lookup.propose(9, prompt, out, 10)
    lookup.checked(9, 0, len(out))  # a second miss: twice as long
    waited = 0
    while not lookup.propose(9, prompt, out + [2, 3], 10):
        out.append(6)
        waited += 1
    assert waited == 2 * FIRST_BACKOFF - 2  # the two tokens appended count too
    lookup.checked(9, 3, len(out))  # a hit: drafting goes on at once
    assert lookup.propose(9, prompt, out + [2, 3], 10)
    lookup.forget(9)
    assert not lookup.drafting(9)


def test_step_costs_learn_what_a_row_adds():
    costs = StepCosts()
    assert costs.ratio(10) == pytest.approx(3.0)  # fp32's measured cost until timed
    costs.add_verify(0.05, 11)  # no decode timed yet: nothing to measure a row against
    assert costs.row is None
    for _ in range(50):
        costs.add_decode(0.010)
        costs.add_verify(0.010 + 10 * 0.003, 11)
    assert costs.row_cost == pytest.approx(0.3)
    assert costs.ratio(4) == pytest.approx(2.2)


def test_drafts_grow_while_all_are_taken_and_shrink_while_none_are():
    lookup = PromptLookup()
    prompt, out = list(range(1, 40)) * 2, [1, 2, 3]  # a draft of any length is found
    lengths = []
    for taken in ("all", "all", "all", "one", "none", "none", "none", "none", "none"):
        drafts = lookup.propose(5, prompt, out, 64)
        lengths.append(len(drafts))
        lookup.checked(5, {"all": len(drafts), "one": 1, "none": 0}[taken], len(out))
        out = [*out, *[0] * 2 * MAX_BACKOFF, 1, 2, 3]  # past any backoff, the same tail
    assert lengths == [FIRST_DRAFT, 2 * FIRST_DRAFT, MAX_DRAFT, MAX_DRAFT, MAX_DRAFT,
                       MAX_DRAFT // 2, MAX_DRAFT // 4, MAX_DRAFT // 8, MAX_DRAFT // 16]
    assert len(lookup.propose(5, prompt, out, 64)) == 1  # never below one
    assert len(lookup.propose(9, prompt, out, 3)) == 3  # nor above the tokens left


def test_the_pick_of_a_drafted_row_is_the_rejection_rule():
    """The real picker and sampler on fixed logits, draft d at p(d) = 0.3: over 6000
    seeds, d is taken about 0.3 of the time (binomial, within 4.5 sigma), a rejection's
    token follows p renormalized without d, and after d the next row's token follows that
    row's p (chi-square against the 1e-4 critical value). A picker that took every draft,
    or that drew a rejection again from p, fails."""
    p1 = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])  # draft token 0
    p2 = torch.tensor([0.1, 0.2, 0.4, 0.3, 0.0])  # after it; draft token 3
    rows = torch.stack([p1.log(), p2.log()])
    bus = EventBus()
    settings = EngineConfig(token_alternatives=0, jump_forward=False, prompt_lookup=False)
    picker = TokenPicker(None, settings, bus, lambda r: r.draft_ids.clear())
    n, first, second_after_accept = 6000, Counter(), Counter()
    for seed in range(n):
        req = Request([9, 9], SamplingParams(temperature=1.0, seed=seed), max_new_tokens=8)
        req.draft_ids = [0, 3]
        taken = []
        for pick in picker.pick(PickRows(torch.empty(0, 5), [], [(req, rows.clone())])):
            req.output_ids.append(pick.sampled.token)
            taken.append(pick.sampled.token)
        first[taken[0]] += 1
        if taken[0] == 0:
            assert len(taken) == 2
            second_after_accept[taken[1]] += 1
        else:
            assert len(taken) == 1  # the row after a rejection belongs to a dropped draft
    accepted = first[0]
    sigma = math.sqrt(n * 0.3 * 0.7)
    assert abs(accepted - n * 0.3) < 4.5 * sigma, accepted
    rejected = n - accepted
    residual = {t: float(p1[t]) / 0.7 for t in range(1, 5)}
    assert _chi2(first - Counter({0: accepted}), residual, rejected) < 21.11  # 3 d.o.f.
    after = {t: float(p2[t]) for t in range(4)}
    assert _chi2(second_after_accept, after, accepted) < 21.11


def _chi2(counts: Counter, probs: dict, total: int) -> float:
    assert set(counts) <= set(probs), counts
    return sum((counts[t] - total * q) ** 2 / (total * q) for t, q in probs.items())


def test_settings_checked():
    with pytest.raises(ValueError, match="prompt_lookup"):
        EngineConfig(prompt_lookup="yes")
    with pytest.raises(ValueError, match="prompt_lookup"):
        SamplingParams(prompt_lookup=1)
    assert sgl.gen("x", prompt_lookup=False).params == {"prompt_lookup": False}
    with pytest.raises(TypeError):
        sgl.gen("x", prompt_lookup=False, prompt_lookup_tokens=3)


# ---- on the real model --------------------------------------------------------------------

def _run_recorded(rt, run) -> tuple[object, dict, dict]:
    """Run `run()`; its result, the metrics it added, and its token events by request."""
    q = rt.events.subscribe()
    before = rt.metrics()
    try:
        result = run()
    finally:
        rt.events.unsubscribe(q)
    after = rt.metrics()
    delta = {k: after[k] - before[k] for k in COUNTS}
    delta["steps"] = sum(after["steps"].values()) - sum(before["steps"].values())
    tokens = defaultdict(list)
    while not q.empty():
        e = q.get()
        if isinstance(e, Token):
            tokens[e.request].append(e)
    return result, delta, tokens


def _ids(tokens: dict) -> list[list[int]]:
    return sorted([e.token for e in evs] for evs in tokens.values())


def _view(st) -> tuple:
    assert st.error() is None, st.error()
    return st.text(), {k: st[k] for k in ("copy", "code", "parties", "json") if k in st}


@slow
def test_greedy_copy_is_the_same_and_drafts_are_taken(default_backend):
    rt = default_backend
    prompt = rt.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat this text exactly, word for word:\n\n" + INVOICE}],
        tokenize=False, add_generation_prompt=True)
    off, m_off, _ = _run_recorded(rt, lambda: rt.generate(prompt, max_tokens=100,
                                                          prompt_lookup=False))
    on, m_on, events = _run_recorded(rt, lambda: rt.generate(prompt, max_tokens=100,
                                                             prompt_lookup=True))
    assert on.token_ids == off.token_ids and on.text == off.text
    assert m_off["prompt_lookup_drafted"] == 0
    (evs,) = events.values()
    drafted = [e for e in evs if e.drafted]
    assert len(drafted) == m_on["prompt_lookup_accepted"] > len(on.token_ids) // 2
    assert m_on["prompt_lookup_drafted"] >= m_on["prompt_lookup_accepted"]
    assert not any(e.forced for e in drafted)
    # Accepted drafts come several to a step: fewer steps than tokens.
    assert m_on["steps"] < m_off["steps"] // 2
    assert m_on["prompt_lookup_steps_saved"] == m_off["steps"] - m_on["steps"]
    steps = Counter(e.step for e in evs)
    assert max(steps.values()) > 2
    print(f"copy: {len(on.token_ids)} tokens, steps {m_off['steps']} -> {m_on['steps']}, "
          f"drafted {m_on['prompt_lookup_drafted']}, accepted {m_on['prompt_lookup_accepted']}")


@slow
@pytest.mark.parametrize("mode", [{"quantization": "int4"}, {"dtype": "bfloat16"}])
def test_16_bit_and_int4_give_the_same_output_with_it(model_path, mode):
    """Where the extend path and the decode step round apart (16-bit activations, int4
    weights), the drafts are checked decode-shaped (scheduled_batch._drafts_as_decodes):
    the fused decode step gives each drafted row the bits a lone decode would, so the
    output is the same token for token. (Checked by the torch extend, near-ties resolved
    apart and the int4 copy changed.)"""
    messages = [[{"role": "user", "content": "Repeat this text exactly, word for word:\n\n"
                  + INVOICE}],
                [{"role": "user", "content": "Rename the function `total` to `order_total`. "
                  "Reply with the whole code only.\n\n" + CODE}]]
    with Runtime(model_path, **mode) as rt:
        assert rt.engine.scheduler.drafts_as_decodes
        prompts = [rt.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                   for m in messages]
        off = [rt.generate(p, max_tokens=100, prompt_lookup=False) for p in prompts]
        on, m_on, _ = _run_recorded(rt, lambda: [rt.generate(p, max_tokens=100, prompt_lookup=True)
                                                 for p in prompts])
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert m_on["prompt_lookup_accepted"] > sum(len(o.token_ids) for o in on) // 3


@slow
def test_same_output_as_without_it_over_eight_programs(default_backend):
    """Chat copies, a code edit, a regex extraction (drafts cut to what the grammar
    accepts), JSON extraction (jump-forward's drafts and ours in one request), a frequency
    penalty (applied row by row), a seeded sample, a stop string inside a copied run, and
    fork branches."""
    rt = default_backend
    totals = defaultdict(int)
    for prog in PROGRAMS:
        off, m_off, t_off = _run_recorded(rt, functools.partial(prog.run, prompt_lookup=False))
        on, m_on, t_on = _run_recorded(rt, functools.partial(prog.run, prompt_lookup=True))
        name = prog.func.__name__
        assert _view(on) == _view(off), name
        assert _ids(t_on) == _ids(t_off), name
        assert m_off["prompt_lookup_drafted"] == 0, name
        drafted = sum(e.drafted for evs in t_on.values() for e in evs)
        assert drafted == m_on["prompt_lookup_accepted"], name
        for k, v in m_on.items():
            totals[k] += v
        print(f"{name:<20} steps {m_off['steps']:>3} -> {m_on['steps']:>3}, drafted "
              f"{m_on['prompt_lookup_drafted']}, accepted {m_on['prompt_lookup_accepted']}")
        if prog is not extract_by_regex:  # the model writes its own sentence there
            assert m_on["prompt_lookup_accepted"] > 0, name
        if prog is extract_json:  # the grammar's keys jumped, the copied values drafted
            assert m_on["jump_forward_tokens"] > 0
    assert totals["prompt_lookup_accepted"] > totals["generated_tokens"] // 3


@slow
def test_a_grammar_only_gets_drafts_it_accepts(default_backend):
    """Drafts are cut to the prefix the grammar accepts, and checking them leaves the
    matcher as it was. On a copy of a text full of digits under a regex that rules them
    out, the output is the one without drafts."""
    rt = default_backend
    grammar = rt.engine.grammars().matcher(r"[A-Za-z ,.:]{1,120}", None)
    ids = rt.tokenizer.encode(" from Northwind Traders, dated 12 March", add_special_tokens=False)
    cut = grammar.allowed_prefix(ids)
    assert 0 < len(cut) < len(ids)
    assert rt.tokenizer.decode(cut) == " from Northwind Traders, dated "  # digits apart
    assert grammar.allowed_prefix(ids) == cut  # the matcher did not move
    for t in cut:
        grammar.accept(t)
    assert grammar.allowed_prefix(ids[len(cut):]) == []

    prompt = "Text: " + INVOICE + "\nThe same text without digits: Invoice"
    kw = {"max_tokens": 40, "regex": r"[A-Za-z ,.:]{1,120}"}
    off = rt.generate(prompt, prompt_lookup=False, **kw)
    on, m, _ = _run_recorded(rt, lambda: rt.generate(prompt, prompt_lookup=True, **kw))
    assert on.token_ids == off.token_ids
    assert not any(c.isdigit() for c in on.text)
    assert m["prompt_lookup_accepted"] > 0


@slow
def test_token_alternatives_of_drafted_rows(default_backend):
    """A drafted token has its row's alternatives, as a decoded one does."""
    rt = default_backend
    prompt = "Text: " + CODE + "\nThe same text again:\n"
    off = rt.generate(prompt, max_tokens=40, prompt_lookup=False)
    on, m, events = _run_recorded(rt, lambda: rt.generate(prompt, max_tokens=40,
                                                          prompt_lookup=True))
    assert on.token_ids == off.token_ids and m["prompt_lookup_accepted"] > 0
    (evs,) = events.values()
    assert len(on.tokens) == len(off.tokens) == len(evs)
    for a, b, e in zip(on.tokens, off.tokens, evs):
        assert a.token == b.token and a.top[0].token == b.top[0].token
        assert a.logprob == pytest.approx(b.logprob, abs=2e-3)
        assert [t[0] for t in e.top] == [x.token for x in a.top]


@slow
def test_stepping_shows_an_accepted_run_as_one_instruction(default_backend):
    """Each step_instruction is one engine step of the Gen: a decode's one token, or a
    verify step's accepted drafts and the model's own pick after them."""
    st = repeat_text.run(step=True, prompt_lookup=True)
    assert st.debug.wait_until_held(timeout=WAIT)
    while st.debug.current.kind != "Gen":
        st.debug.step()
        assert st.debug.wait_until_held(timeout=WAIT)
    q = default_backend.events.subscribe()
    per_step = []
    try:
        for _ in range(12):
            st.debug.step_instruction()
            assert st.debug.wait_until_held(timeout=WAIT)
            got = [e for e in _drain(q) if isinstance(e, Token)]
            per_step.append(got)
            if st.debug.current.kind != "Gen":
                break
    finally:
        default_backend.events.unsubscribe(q)
    runs = [got for got in per_step if len(got) > 1]
    assert runs, [len(g) for g in per_step]
    for got in runs:  # one engine step each: drafts taken, then the model's own pick
        assert len({e.step for e in got}) == 1
        assert all(e.drafted for e in got[:-1])
    st.debug.continue_()
    plain = repeat_text.run(prompt_lookup=False)
    assert st["copy"] == plain["copy"]


def _drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get())
    return out


@slow
@pytest.mark.parametrize("level", ["node", "token"])
def test_traces_keep_drafted_tokens(default_backend, tmp_path, level):
    path = tmp_path / f"{level}.jsonl"
    sgl.enable_tracing(file=path, level=level, runtime=default_backend)
    try:
        st = edit_code.run(prompt_lookup=True)
    finally:
        sgl.disable_tracing()
    assert st.error() is None
    node = next(n for n in load(path).nodes.values() if n.name == "code")
    flags = [t.drafted for t in node.tokens]
    assert any(flags) and not all(flags)
    assert "".join(t.text for t in node.tokens).startswith(st["code"])


@slow
def test_rerun_without_it_gives_the_same_value(default_backend):
    st = repeat_text.run(prompt_lookup=True)
    again = st.rerun(at="copy", prompt_lookup=False)
    assert again.error() is None and again["copy"] == st["copy"]


@slow
def test_chunks_retraction_and_the_engine_setting(model_path, default_backend):
    """An engine with prompt lookup off, a 4-token prefill budget (a long draft is
    checked in chunks) and a KV pool far too small (requests are retracted and
    re-admitted): requests that turn it on get the outputs without it, and so do the plain
    requests beside them."""
    rt = default_backend
    prompts = [f"Text {i}: {CODE}\nThe same text again:\n" for i in range(4)]
    plain = [f"List ten facts about the number {i}." for i in range(2)]

    def submit_all(engine, **pl):
        hs = [engine.submit(p, max_tokens=50, **pl) for p in prompts]
        hs += [engine.submit(p, max_tokens=50, ignore_eos=True) for p in plain]
        return [h.result(timeout=WAIT) for h in hs]

    expected = submit_all(rt, prompt_lookup=False)
    need = sum(len(rt.tokenizer.encode(p)) + 50 for p in prompts + plain)
    # A fifth of what all need: one code request (91 slots) still fits alone, any two
    # running together outgrow the pool.
    with Runtime(model_path, kv_pool_tokens=need // 5, max_prefill_tokens=4,
                 prompt_lookup=False, time_slice=4, max_running=2) as small:
        q = small.events.subscribe()
        outs = submit_all(small, prompt_lookup=True)
        small.events.unsubscribe(q)
        events = _drain(q)
        accepted = small.metrics()["prompt_lookup_accepted"]
        off = small.submit(prompts[0], max_tokens=50).result(timeout=WAIT)
        m = small.metrics()
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert off.token_ids == expected[0].token_ids
    assert accepted > 0 and m["prompt_lookup_accepted"] == accepted  # off unless asked
    assert any(e.kind == "retracted" for e in events)
    per_step = Counter((e.request, e.step) for e in events if isinstance(e, Token) and e.drafted)
    assert max(per_step.values()) <= 4  # a draft longer than the budget went in chunks
    assert m["running"] == m["waiting"] == m["suspended"] == m["prefilling"] == 0
    json.dumps(m)  # the metrics stay plain values
