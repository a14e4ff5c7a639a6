"""RuntimeEndpoint against a real server: our own `sgl-nb serve` (started here on the
session's engine), through both APIs: api="openai" (what vLLM serves) and api="sglang"
(SGLang's native /generate). The same programs give the same results as in-kernel.
The program checks are shared with tests/test_remote_vllm.py."""

from __future__ import annotations

import json
import re
import time

import pytest
from support.interrupts import interrupt_main_inside
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.backends.remote.handle import RemoteHandle
from sgl_nb.server.serve import start_in_thread

pytestmark = pytest.mark.slow


# ---- programs and the checks shared with the vLLM tests ---------------------------------

@sgl.function
def plain(s, topic):
    s += f"Here is a short fact about {topic}:"
    s += sgl.gen("fact", max_tokens=16)


@sgl.function
def chat(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=16))


@sgl.function
def few_shot(s, question):
    s += "Question: Is a whale a mammal?\nAnswer: yes\n\nQuestion: Can penguins fly?\n"
    s += f"Answer: no\n\nQuestion: {question}\nAnswer:"
    s += sgl.select("answer", [" yes", " no"])


@sgl.function
def forked(s):
    s += "List two colors.\n"
    forks = s.fork(2)
    forks += lambda i: f"Color {i + 1}:"
    forks += sgl.gen("color", max_tokens=6, stop="\n")
    forks.join()
    s += "Done."


@sgl.function
def structured(s):
    s += "The year the first moon landing happened: "
    s += sgl.gen("year", regex=r"19[0-9]{2}", max_tokens=8)
    s += "\nA person as JSON: "
    s += sgl.gen("person", max_tokens=48, json_schema={
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "maximum": 120}},
        "required": ["name", "age"]})


@sgl.function
def stopped(s):
    s += "Count: 1, 2, 3,"
    s += sgl.gen("next", max_tokens=16, stop=",")


def check_greedy_gen_equals_local(ep, local) -> None:
    for prog, kw in ((plain, {"topic": "the moon"}), (chat, {"question": "Capital of Peru?"}),
                     (stopped, {})):
        want = prog.run(backend=local, **kw)
        got = prog.run(backend=ep, **kw)
        assert got.error() is None, got.error()
        assert got.text() == want.text()
        assert got.messages() == want.messages()


def check_select_picks_the_same(ep, local) -> None:
    for q in ("Is the sun hot?", "Do fish live in water?", "Is ice hot?"):
        want, got = few_shot.run(backend=local, question=q), few_shot.run(backend=ep, question=q)
        assert got.error() is None, got.error()
        assert got["answer"] == want["answer"]
        a = got.get_meta_info("answer")["normalized_prompt_logprobs"]
        b = want.get_meta_info("answer")["normalized_prompt_logprobs"]
        assert a == pytest.approx(b, abs=2e-3)  # same normalisation, fp32 on both sides


def check_fork_join(ep, local) -> None:
    want, got = forked.run(backend=local), forked.run(backend=ep)
    assert got.error() is None, got.error()
    assert got["color"] == want["color"] and len(got["color"]) == 2
    assert got.text() == want.text()


def check_regex_and_json(ep) -> None:
    st = structured.run(backend=ep)
    assert st.error() is None, st.error()
    assert re.fullmatch(r"19[0-9]{2}", st["year"])
    person = json.loads(st["person"])
    assert isinstance(person["name"], str) and isinstance(person["age"], int)


def check_streaming(ep) -> None:
    st = plain.run(backend=ep, topic="rivers", stream=True)
    pieces = list(st.text_iter("fact"))
    assert len(pieces) > 1 and "".join(pieces) == st["fact"]


# ---- against `sgl-nb serve` --------------------------------------------------------------

@pytest.fixture(scope="module")
def server(runtime):
    srv = start_in_thread(runtime)
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module", params=["openai", "sglang"])
def ep(request, server):
    return sgl.RuntimeEndpoint(server.url, api=request.param)


def test_greedy_gen_equals_local(ep, runtime):
    check_greedy_gen_equals_local(ep, runtime)


def test_select_picks_the_same(ep, runtime):
    check_select_picks_the_same(ep, runtime)


def test_fork_join(ep, runtime):
    check_fork_join(ep, runtime)


def test_regex_and_json(ep):
    check_regex_and_json(ep)


def test_streaming(ep):
    check_streaming(ep)


def test_tokenizer_comes_from_the_server_reported_folder(ep, runtime):
    assert ep.tokenizer.name_or_path == str(runtime.model_path)
    assert ep.chat_roles == runtime.chat_roles


def test_events_report_each_request(ep):
    q = ep.events.subscribe()
    try:
        st = few_shot.run(backend=ep, question="Is snow white?")
        st2 = plain.run(backend=ep, topic="tea", stream=True)
        assert st.error() is None and st2.error() is None and st2.text()
    finally:
        ep.events.unsubscribe(q)
    events = []
    while not q.empty():
        events.append(q.get())
    # The program's own Extends come through the same bus, without a request id.
    started = {e.request: e for e in events if e.kind == "instruction_started" and e.request}
    finished = {e.request: e for e in events if e.kind == "instruction_finished" and e.request}
    assert started.keys() == finished.keys() and len(started) == 2
    score = next(e for e in finished.values() if e.op == "Score")
    decode = next(e for e in finished.values() if e.op == "Decode")
    assert score.program == st.id and decode.program == st2.id
    assert score.node == next(n.id for n in st.nodes if n.kind == "Select")
    assert score.usage["input_tokens"] > 0 and decode.usage["output_tokens"] == 16
    assert decode.usage["finish_reason"] == "length" and decode.usage["server"] == ep.base_url
    tokens = [e for e in events if e.kind == "token" and e.request == decode.request]
    assert "".join(e.text for e in tokens) == st2["fact"]


@sgl.function
def two_gens(s):
    s += "Once upon a time"
    s += sgl.gen("a", max_tokens=6, ignore_eos=True)
    s += " Then"
    s += sgl.gen("b", max_tokens=4, ignore_eos=True)


def test_node_stepping_works_remotely(ep, runtime):
    assert ep.instruction_stepping is False  # the views say tokens step on the server
    st = two_gens.run(backend=ep, step=True, passes=())
    assert st.debug.wait_until_held(timeout=WAIT) and st.debug.current.kind == "Text"
    st.debug.step()
    assert st.debug.wait_until_held(timeout=WAIT)
    gen = st.debug.current
    assert gen.kind == "Gen" and "a" not in st.snapshot().vars  # held before the request is sent
    st.debug.step_instruction()  # remotely a whole Node: the server owns the tokens
    assert st.debug.wait_until_held(timeout=WAIT)
    assert gen.status == "done" and st.debug.current.text == " Then"
    other = two_gens.run(backend=ep)  # another program runs while this one is held
    assert other.error() is None and "b" not in st.snapshot().vars
    st.debug.continue_()
    assert st["b"] and st.error() is None
    assert st.text() == other.text() == two_gens.run(backend=runtime).text()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="api must be one of"):
        sgl.RuntimeEndpoint("http://127.0.0.1:1", api="tgi")
    with pytest.raises(ValueError, match="base_url"):
        sgl.RuntimeEndpoint("localhost:8000")


def test_remote_calls_are_spans_with_genai_attributes(ep):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    sgl.enable_tracing(runtime=ep, exporter=spans)
    try:
        st = few_shot.run(backend=ep, question="Is rain wet?")
        st2 = plain.run(backend=ep, topic="ink")
        assert st.error() is None and st2.error() is None
    finally:
        sgl.disable_tracing()
    attrs = [dict(s.attributes) for s in spans.get_finished_spans()]
    chat = [a for a in attrs if a.get("gen_ai.usage.output_tokens") == 16]
    assert chat and chat[0]["gen_ai.usage.input_tokens"] > 0
    assert chat[0]["gen_ai.response.finish_reasons"] == ("length",)
    assert any(a.get("gen_ai.usage.input_tokens", 0) > 0 and "gen_ai.operation.name" in a
               and a.get("gen_ai.usage.output_tokens") == 0 for a in attrs)  # the select


# ---- cancelling a remote request, and the base URL's forms ----------------------------

def _engine_idle_after_abort(rt, before: int, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m = rt.metrics()
        if m["aborted"] > before and m["running"] == m["waiting"] == m["prefilling"] == 0:
            return
        assert time.monotonic() < deadline, f"the server's engine did not abort: {m}"
        time.sleep(0.02)


LONG = {"max_tokens": 4000, "ignore_eos": True}  # minutes on a CPU unless aborted


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_cancel_a_long_remote_gen_mid_stream(server, runtime, api):
    ep = sgl.RuntimeEndpoint(server.url, api=api)
    before = runtime.metrics()["aborted"]
    h = ep.submit("Once upon a time", stream=True, **LONG)
    chunks = h.chunks()
    pieces = [next(chunks) for _ in range(3)]
    assert h.cancel() and not h.cancel()  # once
    out = h.result(timeout=WAIT)
    assert out.meta["finish_reason"] == "abort"
    assert out.text.startswith("".join(pieces)) and len(out.text) < 4000
    assert "".join(pieces + list(chunks)) == out.text  # the rest of what had arrived
    _engine_idle_after_abort(runtime, before)
    assert ep.generate("Hi", max_tokens=2).text == runtime.generate("Hi", max_tokens=2).text


def test_cancel_a_program_on_an_endpoint(server, runtime):
    @sgl.function
    def tale(s):
        s += "A long tale:" + sgl.gen("t", **LONG)
        s += " The end." + sgl.gen("moral", max_tokens=8)

    ep = sgl.RuntimeEndpoint(server.url)
    before = runtime.metrics()["aborted"]
    state = tale.run(stream=True, backend=ep)
    next(state.text_iter("t"))
    assert state.cancel()
    state.wait(timeout=WAIT)
    assert isinstance(state.error(), sgl.ProgramCancelled) and state["t"]
    assert [n.status for n in state.nodes if n.kind == "Gen"] == ["cancelled", "cancelled"]
    _engine_idle_after_abort(runtime, before)


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_cancel_a_long_remote_gen_waiting_for_its_answer(server, runtime, api):
    ep = sgl.RuntimeEndpoint(server.url, api=api)
    before = runtime.metrics()["aborted"]
    h = ep.submit("Once upon a time", **LONG)
    deadline = time.monotonic() + WAIT
    while runtime.metrics()["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    h.cancel()
    out = h.result(timeout=WAIT)
    assert out.meta["finish_reason"] == "abort" and out.text == ""  # nothing had arrived
    _engine_idle_after_abort(runtime, before)


def test_leaving_chunks_early_cancels(server, runtime):
    ep = sgl.RuntimeEndpoint(server.url)
    before = runtime.metrics()["aborted"]
    h = ep.submit("Once upon a time", stream=True, **LONG)
    for i, _ in enumerate(h.chunks()):
        if i == 2:
            break
    assert h.result(timeout=WAIT).meta["finish_reason"] == "abort"
    _engine_idle_after_abort(runtime, before)


def test_an_interrupt_while_waiting_cancels_the_remote_request(server, runtime, python_sigint):
    """A real SIGINT to the main thread, as Ctrl-C or a Jupyter interrupt delivers it."""
    ep = sgl.RuntimeEndpoint(server.url)
    before = runtime.metrics()["aborted"]
    h = ep.submit("Once upon a time", **LONG)
    # Once the server's engine runs it and this thread waits for its answer.
    off = interrupt_main_inside(RemoteHandle.result, lambda: runtime.metrics()["running"])
    try:
        with pytest.raises(KeyboardInterrupt):
            h.result(timeout=WAIT)
    finally:
        off.set()
    assert h.result(timeout=WAIT).meta["finish_reason"] == "abort"
    _engine_idle_after_abort(runtime, before)


def test_cancel_before_the_request_is_sent(server, runtime):
    ep = sgl.RuntimeEndpoint(server.url, model=runtime.model_path.name)
    h = ep.submit("Once upon a time", stream=True, **LONG)
    h.cancel()
    assert h.result(timeout=WAIT).meta["finish_reason"] == "abort"
    deadline = time.monotonic() + WAIT  # if it reached the server, the server aborted it
    while runtime.metrics()["running"] or runtime.metrics()["waiting"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_base_url_with_or_without_v1(server, runtime, suffix, api):
    ep = sgl.RuntimeEndpoint(server.url + suffix, api=api)
    assert ep.base_url == server.url
    assert ep.generate("Hi", max_tokens=3).text == runtime.generate("Hi", max_tokens=3).text


def test_api_speculative_execution_saves_requests(server, runtime):
    """SGLang's test_gen_character_spec, on a server: with num_api_spec_tokens the first
    gen's answer serves the gens after it, so fewer requests and prompt tokens are sent."""
    def character(s):
        s += "Construct a character within the following format:\n"
        s += "Name: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n"
        s += "\nPlease generate new Name, Birthday and Job.\n"
        s += ("Name:" + sgl.gen("name", stop="\n") + "\nBirthday:"
              + sgl.gen("birthday", stop="\n"))
        s += "\nJob:" + sgl.gen("job", stop="\n") + "\n"

    spec = sgl.function(num_api_spec_tokens=256)(character)
    plain_fn = sgl.function(character)
    ep = sgl.RuntimeEndpoint(server.url)
    usage = ep.token_usage

    def requests_of(fn) -> tuple[int, int, object]:
        q = ep.events.subscribe()
        usage.reset()
        try:
            st = fn.run(backend=ep, max_new_tokens=64)
            assert st.error() is None, st.error()
        finally:
            ep.events.unsubscribe(q)
        sent = 0
        while not q.empty():
            e = q.get()
            sent += e.kind == "instruction_started" and e.request is not None
        return sent, usage.prompt_tokens, st

    sent_spec, prompt_spec, st = requests_of(spec)
    sent_plain, prompt_plain, _ = requests_of(plain_fn)
    assert sent_plain == 3 and sent_spec < sent_plain, (sent_spec, sent_plain)
    assert prompt_spec < prompt_plain
    assert all(st[k] is not None for k in ("name", "birthday", "job"))
    assert "\n" not in st["name"] and st.text().startswith("Construct a character")
