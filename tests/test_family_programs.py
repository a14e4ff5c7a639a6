"""One sgl_nb program (gen, select among 3, fork into 2 branches with a gen each, join, a
regex gen) on every native family's tiny random-weight checkpoint, each piece checked
against transformers on the same checkpoint: the gens against `generate` (the regex gen with
the regex's allowed tokens as `prefix_allowed_tokens_fn`), the select against the mean
log-probability of each choice's tokens from transformers' forward, and the run's Nodes and
events."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import hf_greedy
from support.tiny_checkpoint import FAMILIES, load_reference, tiny_checkpoint, tiny_config
from test_families import LOGPROB_TOL, TIE, assert_greedy_agrees

import sgl_nb as sgl

INTRO = "The weather report for today:"
SKY = " Overall the sky is"
CHOICES = [" clear", " cloudy", " full of rain"]
NOTES = ". Two notes follow."
TEMPERATURE = " The temperature in degrees is"
DEGREES = r"[0-9]{1,3}"
MAX_DIGITS = 3  # the regex's; each digit is a token of its own in this tokenizer
NEW = 6


def note(i: int) -> str:
    return f" Note {i + 1}:"


@sgl.function
def weather(s):
    s += INTRO
    s += sgl.gen("opening", max_tokens=NEW, ignore_eos=True)
    s += SKY
    s += sgl.select("sky", CHOICES)  # default method: token_length_normalized
    s += NOTES
    forks = s.fork(2)
    forks += lambda i: note(i)
    forks += sgl.gen("note", max_tokens=NEW, ignore_eos=True)
    forks.join()
    s += TEMPERATURE
    s += sgl.gen("degrees", regex=DEGREES, max_tokens=NEW)


@pytest.mark.parametrize("family", FAMILIES)
def test_program_on_family_matches_transformers(family, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    folder = tiny_checkpoint(tiny_config(family), tmp_path / family)
    hf = load_reference(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))  # transformers' own, not the engine's
    eos = GenerationConfig.from_pretrained(str(folder)).eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    rt = sgl.Runtime(str(folder), dtype="float32", kv_pool_tokens=2048)
    try:
        assert rt.engine.model.path == "native"
        events = rt.events.subscribe()
        st = weather.run(backend=rt)
        assert st.error() is None, st.error()
        rt.events.unsubscribe(events)
        seen = [events.get() for _ in range(events.qsize())]
    finally:
        rt.shutdown()

    # The text is what the program says, so each piece's prompt below is the engine's.
    opening, sky, notes, degrees = st["opening"], st["sky"], st["note"], st["degrees"]
    before_sky = INTRO + opening + SKY
    before_fork = before_sky + sky + NOTES
    assert st.text() == before_fork + TEMPERATURE + degrees
    assert len(notes) == 2

    check_gen(st, "opening", None, hf, tok, INTRO)
    for i in range(2):
        check_gen(st, "note", i, hf, tok, before_fork + note(i))
    check_select(st, hf, tok, before_sky)
    check_regex_gen(st, hf, tok, before_fork + TEMPERATURE, eos)
    check_trace(st, seen)


def gen_ids(st, var: str, branch: int | None) -> tuple[list[int], int]:
    """The token ids a gen took (from its recorded TokenChoices) and its prompt's length."""
    last = st.token_info(var, -1, branch)
    ids = [st.token_info(var, i, branch).token for i in range(last.index + 1)]
    return ids, last.prompt_tokens


def check_gen(st, var: str, branch: int | None, hf, tok, prompt_text: str) -> None:
    prompt = tok.encode(prompt_text)
    ours, prompt_len = gen_ids(st, var, branch)
    assert prompt_len == len(prompt), (var, branch, prompt_len, len(prompt))
    assert len(ours) == NEW
    assert_greedy_agrees(hf, prompt, ours, NEW)  # the near-tie rule of test_families
    want = hf_greedy(hf, prompt, NEW)
    if ours == want:
        text = st[var] if branch is None else st[var][branch]
        assert text == tok.decode(want), (var, branch, text, tok.decode(want))


def check_select(st, hf, tok, prompt_text: str) -> None:
    """token_length_normalized: the mean log-probability of the choice's tokens after the
    prompt, from transformers' forward; a pick within TIE of the best is a near-tie."""
    prompt = tok.encode(prompt_text)
    scores = []
    for choice in CHOICES:
        ids = prompt + tok.encode(choice)
        # The choice tokenized alone equals its tokens in the whole text: one reading.
        assert tok.encode(prompt_text + choice) == ids, choice
        with torch.inference_mode():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
        picked = [lp[p - 1, ids[p]].item() for p in range(len(prompt), len(ids))]
        scores.append(sum(picked) / len(picked))
    best = max(range(len(CHOICES)), key=lambda i: scores[i])
    chosen = CHOICES.index(st["sky"])
    assert chosen == best or scores[best] - scores[chosen] < TIE, (st["sky"], scores)
    ours = st.get_meta_info("sky")["normalized_prompt_logprobs"]
    for got, want in zip(ours, scores, strict=True):
        assert abs(got - want) < LOGPROB_TOL, (ours, scores)


def digit_tokens(tok) -> list[int]:
    names = tok.convert_ids_to_tokens(list(range(len(tok))))
    return [i for i, name in enumerate(names) if re.fullmatch(r"[0-9]+", name)]


def check_regex_gen(st, hf, tok, prompt_text: str, eos: list[int]) -> None:
    """The text matches the regex, and its tokens are transformers' greedy over the tokens the
    regex allows at each step (xgrammar's mask is exact per token): a digit while fewer than
    MAX_DIGITS, EOS once there is one."""
    from transformers import GenerationConfig

    text = st["degrees"]
    assert re.fullmatch(DEGREES, text), text
    digits = digit_tokens(tok)
    assert all(len(tok.convert_ids_to_tokens(i)) == 1 for i in digits)
    prompt = tok.encode(prompt_text)

    def allowed(_batch: int, ids: torch.Tensor) -> list[int]:
        n = len(ids) - len(prompt)
        return (digits if n < MAX_DIGITS else []) + (eos if n > 0 else [])

    ours, prompt_len = gen_ids(st, "degrees", None)
    assert prompt_len == len(prompt)
    config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[0], do_sample=False,
                              max_new_tokens=NEW)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), generation_config=config,
                          prefix_allowed_tokens_fn=allowed)
    want = out[0, len(prompt):].tolist()
    if ours == want:
        assert text == tok.decode([t for t in want if t not in eos])
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, want)) if a != b), None)
    assert i is not None, f"same start, other length: ours {ours}, transformers {want}"
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + want[:i]])).logits[0, -1]
    keep = allowed(0, torch.tensor(prompt + want[:i]))
    top = logits[keep].topk(min(2, len(keep)))
    gap = (top.values[0] - top.values[-1]).item()
    top_ids = [keep[j] for j in top.indices.tolist()]
    assert len(keep) > 1 and gap < TIE and ours[i] in top_ids, (
        f"regex token {i}: ours {ours}, transformers {want} (allowed top-2 gap {gap:.2e})")


def check_trace(st, seen) -> None:
    """Every Node ran to done; the Gen, Select, Fork and Join kinds are there, in the
    state's Nodes (fork branches spliced in) and in the events of the program and its two
    branches, and the program finished with no error."""
    kinds = [n.kind for n in st.nodes]
    assert all(n.status == "done" for n in st.nodes), [(n.kind, n.status) for n in st.nodes]
    assert kinds.count("Gen") == 4 and {"Select", "Fork", "Join"} <= set(kinds), kinds
    programs = {st.id} | {e.program for e in seen if e.kind == "program_started"
                          and e.parent == st.id}
    assert len(programs) == 3, programs  # the program and its two branches
    ours = [e for e in seen if e.program in programs]
    # Init and Return are the program's span (program_started / _finished), not Node events.
    started = [e.node_kind for e in ours if e.kind == "node_started"]
    assert sorted(started) == sorted(k for k in kinds if k not in ("Init", "Return")), started
    ended = [e.status for e in ours if e.kind == "node_finished"]
    assert ended == ["done"] * len(started), ended
    finished = [e for e in seen if e.kind == "program_finished" and e.program == st.id]
    assert len(finished) == 1 and finished[0].status == "done", finished
    assert finished[0].error is None
