"""Jump-forward decoding on the real model and real xgrammar: text a grammar forces is
computed in one extend step, and the output is the one token-by-token decoding gives
(the oracle: the same program with jump_forward=False)."""

from __future__ import annotations

import functools
import json
from collections import defaultdict

import pytest
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb import Runtime
from sgl_nb.runtime.engine_config import EngineConfig
from sgl_nb.runtime.events import Token
from sgl_nb.runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "role": {"enum": ["admin", "user", "guest"]},
    "address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string"}}, "required": ["city", "zip"]}},
    "required": ["name", "age", "role", "address"]}
MOVIE = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"},
    "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action"]},
               "maxItems": 3},
    "rating": {"type": "number"}}, "required": ["title", "year", "genres", "rating"]}
ORDER = {"type": "object", "properties": {
    "order": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "customer": {"type": "object", "properties": {
            "first_name": {"type": "string"}, "vip": {"type": "boolean"}},
            "required": ["first_name", "vip"]}},
        "required": ["id", "status", "customer"]},
    "paid": {"type": "boolean"}}, "required": ["order", "paid"]}
DESSERT = {"type": "object", "properties": {"dish": {"enum": ["crème brûlée", "café", "thé"]},
                                             "sweet": {"type": "boolean"}},
           "required": ["dish", "sweet"]}


@sgl.function
def person_json(s):
    s += "Describe a person as JSON.\n" + sgl.gen("json", json_schema=PERSON, max_tokens=80)


@sgl.function
def movie_json(s):
    s += "Describe a movie as JSON.\n" + sgl.gen("json", json_schema=MOVIE, max_tokens=60)


@sgl.function
def order_json(s):
    s += "An order record in JSON:\n" + sgl.gen("json", json_schema=ORDER, max_tokens=80)


@sgl.function
def chat_json(s):
    s += sgl.user("Give me a person record as JSON.")
    s += sgl.assistant(sgl.gen("json", json_schema=json.dumps(PERSON), max_tokens=80))


@sgl.function
def literal_runs(s):
    s += "Capitals.\n" + sgl.gen("facts", max_tokens=40, regex=(
        r"The capital of France is (Paris|Lyon)\. The capital of Spain is "
        r"(Madrid|Seville)\. The capital of Italy is (Rome|Milan)\."))


@sgl.function
def dates_and_phones(s):
    s += "Alice was born on 3 May 1990; call her on 555 123 4567.\nBorn: "
    s += sgl.gen("born", regex=r"\d{4}-\d{2}-\d{2}", max_tokens=12)
    s += "\nPhone: " + sgl.gen("phone", regex=r"\(\d{3}\) \d{3}-\d{4}", max_tokens=16)


@sgl.function
def typed_values(s):
    s += "Bob is 42, 1.81 m tall, and he is not a pilot.\nAge: " + sgl.gen_int("age", max_tokens=4)
    s += "\nHeight: " + sgl.gen("height", dtype=float, max_tokens=8)
    s += "\nPilot: " + sgl.gen("pilot", dtype=bool, max_tokens=4)
    s += "\nName: " + sgl.gen_string("name", max_tokens=8)


@sgl.function
def choices(s):
    s += "Pick a role and a colour.\nRole: "
    s += sgl.gen("role", regex=r"(administrator|admin|author|auditor)", max_tokens=8)
    s += "\nColour: " + sgl.gen("colour", choices=["red", "green", "blue"])
    s += "\nAs JSON: " + sgl.gen("json", json_schema={
        "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                         "shade": {"enum": ["light", "dark"]}},
        "required": ["colour", "shade"]}, max_tokens=30)


@sgl.function
def sampled_json(s):
    s += "Describe a person as JSON.\n"
    s += sgl.gen("json", json_schema=PERSON, max_tokens=80, temperature=0.8, seed=7)


@sgl.function
def unicode_enum(s):
    s += "A French dessert order as JSON: " + sgl.gen("json", json_schema=DESSERT,
                                                      max_tokens=30)


@sgl.function
def stop_inside_forced_text(s):
    s += "Describe a person as JSON.\n"
    s += sgl.gen("json", json_schema=PERSON, max_tokens=80, stop='"role"')


@sgl.function
def special_token_text(s):
    s += "Write the end marker as text: "
    s += sgl.gen("marker", regex=r"<\|im_end\|> (done|over)", max_tokens=16)


@sgl.function
def forked_json(s):
    s += "Two records as JSON.\n"
    forks = s.fork(2)
    forks += lambda i: f"Record {i + 1}: "
    forks += sgl.gen("json", json_schema=ORDER, max_tokens=60)
    forks.join()


PROGRAMS = [person_json, movie_json, order_json, chat_json, literal_runs, dates_and_phones,
            typed_values, choices, sampled_json, unicode_enum, stop_inside_forced_text,
            special_token_text, forked_json]


def _run_recorded(rt, run) -> tuple[object, dict, list]:
    """Run `run()`; its result, the engine metrics it added, and the token ids of each
    request it made (sorted: the order requests finish in may differ)."""
    q = rt.events.subscribe()
    before = rt.metrics()
    try:
        result = run()
    finally:
        rt.events.unsubscribe(q)
    after = rt.metrics()
    delta = {k: after[k] - before[k] for k in ("forced_tokens", "jump_forward_tokens",
                                               "jump_forward_steps_saved", "generated_tokens")}
    delta["steps"] = sum(after["steps"].values()) - sum(before["steps"].values())
    tokens = defaultdict(list)
    forced = 0
    while not q.empty():
        e = q.get()
        if e.kind == "token":
            tokens[e.request].append(e.token)
            forced += e.forced
    delta["forced_events"] = forced
    return result, delta, sorted(tokens.values())


def _state_view(st) -> tuple:
    assert st.error() is None, st.error()
    return st.text(), {k: st[k] for k in ("json", "facts", "born", "phone", "age", "height",
                                          "pilot", "name", "role", "colour", "marker") if k in st}


def test_same_output_as_token_by_token_over_thirteen_programs(default_backend):
    rt = default_backend
    totals = {"off": defaultdict(int), "on": defaultdict(int)}
    for prog in PROGRAMS:
        off, m_off, t_off = _run_recorded(rt, functools.partial(prog.run, jump_forward=False))
        on, m_on, t_on = _run_recorded(rt, prog.run)
        assert _state_view(on) == _state_view(off), prog.func.__name__
        assert t_on == t_off, prog.func.__name__
        assert m_off["jump_forward_tokens"] == 0
        assert m_on["forced_events"] == m_on["forced_tokens"] >= m_on["jump_forward_tokens"]
        for k in m_on:
            totals["off"][k] += m_off[k]
            totals["on"][k] += m_on[k]
        print(f"{prog.func.__name__:<24} steps {m_off['steps']:>3} -> {m_on['steps']:>3}, "
              f"jumped {m_on['jump_forward_tokens']} tokens")
    on, off = totals["on"], totals["off"]
    print(f"all: steps {off['steps']} -> {on['steps']}, tokens {on['generated_tokens']}, "
          f"jumped {on['jump_forward_tokens']}, decode steps saved "
          f"{on['jump_forward_steps_saved']}")
    assert on["generated_tokens"] == off["generated_tokens"]
    assert on["jump_forward_tokens"] > on["generated_tokens"] // 4
    assert on["steps"] < off["steps"] * 3 // 4


def test_programs_side_by_side_same_outputs(default_backend):
    """Four programs at once jump at different steps: the decodes beside a jump wait
    that step, and every output is still the token-by-token one."""
    progs = [person_json, literal_runs, typed_values, order_json]

    def batch(**opts):
        return [f.result() for f in [p.run_async(**opts) for p in progs]]

    off, _, t_off = _run_recorded(default_backend, lambda: batch(jump_forward=False))
    on, m_on, t_on = _run_recorded(default_backend, batch)
    assert [_state_view(s) for s in on] == [_state_view(s) for s in off]
    assert t_on == t_off and m_on["jump_forward_tokens"] > 0


def test_a_jump_and_a_score_in_one_step(default_backend):
    """A select's Score request submitted at each token of a JSON gen joins the next extend
    step beside the gen's jump: the rows of both are read from the one forward pass."""
    rt, engine = default_backend, default_backend.engine
    prompt = "Describe a person as JSON (beside scores).\n"
    expected = rt.submit(prompt, max_tokens=80, json_schema=PERSON, jump_forward=False)
    expected = expected.result()
    ids = rt.tokenizer.encode("The capital of France is Paris, and of Spain Madrid.")
    alone = engine.submit(engine.make_score_request(ids, 2)).result().input_logprobs
    gen, scores = [], []

    def on_event(e) -> None:  # on the engine thread: submitting does not block
        if gen and e.kind == "token" and e.request == gen[0].req.rid and len(scores) < 12:
            scores.append(engine.submit(engine.make_score_request(ids, 2)))

    sub = rt.events.subscribe(on_event)
    try:
        before = rt.metrics()["jump_forward_tokens"]
        gen.append(rt.submit(prompt, max_tokens=80, json_schema=PERSON))
        out = gen[0].result()
    finally:
        rt.events.unsubscribe(sub)
    assert out.token_ids == expected.token_ids
    assert rt.metrics()["jump_forward_tokens"] > before and len(scores) == 12
    for h in scores:
        assert h.result().input_logprobs == pytest.approx(alone, abs=1e-4)


def test_forced_tokens_marked_in_events_and_metrics(default_backend):
    rt = default_backend
    q = rt.events.subscribe()
    try:
        out = rt.submit("Describe a person as JSON.\n", max_tokens=80,
                        json_schema=PERSON).result()
    finally:
        rt.events.unsubscribe(q)
    events = _drain_tokens(q)
    assert [e.token for e in events] == out.token_ids
    forced_text = "".join(e.text for e in events if e.forced)
    # The keys and the punctuation around them are the grammar's: forced.
    for key in ("name", "age", "role", "address", "city", "zip"):
        assert key in forced_text
    # A jump's tokens come in one step: several token events share a step number.
    steps = [e.step for e in events if e.forced]
    assert len(set(steps)) < len(steps)
    assert json.loads(out.text)["role"] in ("admin", "user", "guest")


def _drain_tokens(q) -> list[Token]:
    out = []
    while not q.empty():
        e = q.get()
        if isinstance(e, Token):
            out.append(e)
    return out


def test_streaming_never_half_a_character_nor_a_stop_piece(default_backend):
    rt = default_backend
    for params in ({"json_schema": DESSERT, "max_tokens": 30},
                   {"json_schema": PERSON, "max_tokens": 80, "stop": '"role"'},
                   {"json_schema": PERSON, "max_tokens": 80, "stop": "ddress"}):
        expected = rt.submit("Describe it as JSON.\n", jump_forward=False, **params).result()
        handle = rt.submit("Describe it as JSON.\n", stream=True, **params)
        chunks = list(handle.chunks())
        out = handle.result()
        assert out.token_ids == expected.token_ids and out.text == expected.text
        # A streamed piece of a stop string would be text past out.text's end.
        assert "".join(chunks) == out.text
        assert not any("\ufffd" in c for c in chunks)


def test_forced_tokens_become_part_of_the_cached_path(default_backend):
    rt = default_backend
    prompt = "An order record in JSON (cached path):\n"
    out = rt.submit(prompt, max_tokens=80, json_schema=ORDER).result()
    ids = rt.tokenizer.encode(prompt) + out.token_ids
    # Everything but the last token (never computed) is in the radix tree, forced tokens
    # included, so the same request again finds its whole prompt cached.
    assert rt.engine.cache.cached_len(ids[:-1]) == len(ids) - 1
    again = rt.submit(prompt, max_tokens=80, json_schema=ORDER).result()
    assert again.token_ids == out.token_ids


def test_settings_checked():
    with pytest.raises(ValueError, match="jump_forward"):
        EngineConfig(jump_forward="no")
    with pytest.raises(ValueError, match="jump_forward"):
        SamplingParams(jump_forward=1)
    with pytest.raises(TypeError):
        sgl.gen("x", jump_forward=False, bogus=1)
    assert sgl.gen("x", jump_forward=False).params == {"jump_forward": False}


def test_chunks_retraction_and_the_engine_setting(model_path, default_backend):
    """An engine with jump-forward off, a 4-token prefill budget (a jump is computed in
    chunks) and a KV pool far too small (requests are retracted and re-admitted): requests
    that turn it on get the outputs of token-by-token decoding, and so do the plain
    requests beside them."""
    rt = default_backend
    prompts = [f"Record {i} as JSON:\n" for i in range(8)]
    plain = [f"List ten facts about the number {i}." for i in range(2)]

    def submit_all(engine, **jf):
        hs = [engine.submit(p, max_tokens=60, json_schema=ORDER, **jf) for p in prompts]
        hs += [engine.submit(p, max_tokens=60, ignore_eos=True, **jf) for p in plain]
        return [h.result(timeout=WAIT) for h in hs]

    expected = submit_all(rt, jump_forward=False)
    need = sum(len(rt.tokenizer.encode(p)) + 60 for p in prompts + plain)
    with Runtime(model_path, kv_pool_tokens=need // 6, max_prefill_tokens=4,
                 jump_forward=False, time_slice=4) as small:
        q = small.events.subscribe()
        outs = submit_all(small, jump_forward=True)
        small.events.unsubscribe(q)
        events = [q.get() for _ in range(q.qsize())]
        jumped = small.metrics()["jump_forward_tokens"]
        off = small.submit(prompts[0], max_tokens=60, json_schema=ORDER).result()
        m = small.metrics()
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert off.token_ids == expected[0].token_ids
    assert jumped > 0 and m["jump_forward_tokens"] == jumped  # off unless a request asks
    json_rids = {o.meta["id"] for o in outs[:len(prompts)]}
    assert any(e.kind == "retracted" and e.request in json_rids for e in events)
    per_step = defaultdict(int)
    for e in events:
        if e.kind == "token" and e.forced:
            per_step[e.request, e.step] += 1
    assert max(per_step.values()) <= 4  # a jump longer than the budget went in chunks
    assert m["running"] == m["waiting"] == m["suspended"] == m["prefilling"] == 0


def test_runtime_generate_takes_jump_forward(default_backend):
    rt = default_backend
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}

    def saved_by(**kw) -> tuple[str, int]:
        before = rt.metrics()["jump_forward_steps_saved"]
        out = rt.generate("A person as JSON: ", max_tokens=40, json_schema=schema, **kw)
        return out.text, rt.metrics()["jump_forward_steps_saved"] - before

    on, saved_on = saved_by()
    off, saved_off = saved_by(jump_forward=False)
    assert on == off and saved_on > 0 and saved_off == 0
