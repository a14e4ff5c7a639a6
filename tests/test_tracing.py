"""Spans from real programs (gen, select, fork/join, regex) checked with an in-memory
exporter, and the round trip through an OTLP/JSON file back to a Timeline."""

from __future__ import annotations

import json
import math
import random
import re
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.runtime.compiler.lowering import lower
from sgl_nb.runtime.events import CACHE_EVENTS
from sgl_nb.tracing import TraceFormatError, load, load_events, traceparent_for
from sgl_nb.tracing.codec import event_data
from sgl_nb.tracing.otlp_json import read_spans
from sgl_nb.tracing.timeline import Timeline

YEAR = r"(19|20)[0-9]{2}"


@sgl.function
def qa(s, q):
    s += "Q: " + q + "\nA:"
    s += sgl.gen("a", max_tokens=6, ignore_eos=True)
    s += " Is that right?"
    s += sgl.select("v", choices=[" yes", " no"])


@sgl.function
def forked(s):
    s += "Name two colors."
    forks = s.fork(2)
    forks += lambda i: f" Color {i + 1}:"
    forks += sgl.gen("c", max_tokens=3, ignore_eos=True)
    forks.join()
    s += " Done."


@sgl.function
def year(s):
    s += "The year the first person walked on the moon: "
    s += sgl.gen("y", regex=YEAR, max_tokens=8)


def _drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get())
    return out


@pytest.fixture(scope="module")
def traced(default_backend, tmp_path_factory):
    """One traced run of the three programs, to an in-memory exporter and a file, with the
    live events alongside."""
    rt = default_backend
    rt.flush_cache()  # an empty tree: the trace holds the live events alone, no snapshot
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    mem = InMemorySpanExporter()
    q = rt.events.subscribe()
    sgl.enable_tracing(file=path, exporter=mem, runtime=rt)
    try:
        states = [qa.run(q="What is the capital of France?"), forked.run(), year.run()]
    finally:
        sgl.disable_tracing()
        rt.events.unsubscribe(q)
    for st in states:
        assert st.error() is None, st.error()
    spans = mem.get_finished_spans()
    return SimpleNamespace(rt=rt, states=states, spans=spans, events=_drain(q), path=path)


def _of(spans, kind: str) -> list:
    return [s for s in spans if s.attributes.get("sgl.span") == kind]


def _by(spans, kind: str, key: str) -> dict:
    return {s.attributes[key]: s for s in _of(spans, kind)}


def _ran(states) -> list:
    """Every Node the programs ran (fork branches' included; not Init and Return, the
    programs' own)."""
    seen = {}
    for st in states:
        for n in st.nodes:
            if n.kind not in ("Init", "Return"):
                seen[n.id] = n
    return list(seen.values())


@pytest.mark.slow
def test_one_span_per_program_node_and_instruction(traced):
    nodes = _ran(traced.states)
    node_spans = _by(traced.spans, "node", "sgl.node.id")
    assert sorted(node_spans) == sorted(n.id for n in nodes)
    started = [e for e in traced.events if e.kind == "instruction_started"]
    assert len(_of(traced.spans, "instruction")) == len(started)
    programs = {e.program for e in traced.events if e.kind == "program_started"}
    assert set(_by(traced.spans, "program", "sgl.program.id")) == programs
    assert len(programs) == 3 + 2  # three programs and two fork branches
    ins_by_node: dict = {}
    for s in _of(traced.spans, "instruction"):
        ins_by_node.setdefault(s.attributes.get("sgl.node.id"), []).append(s)
    # Init and Return are the programs' own: under each top-level program's span.
    own = ins_by_node.pop(None)
    program_spans = _by(traced.spans, "program", "sgl.program.id")
    for st in traced.states:
        names = [s.name for s in own if s.attributes["sgl.program.id"] == st.id]
        assert names == ["Init", "Return"]
        assert all(s.parent.span_id == program_spans[st.id].context.span_id for s in own
                   if s.attributes["sgl.program.id"] == st.id)
    for n in nodes:
        got = sorted(ins_by_node.get(n.id, []), key=lambda s: s.attributes["sgl.seq"])
        ran = [e.op for e in started if e.node == n.id]
        assert [s.name for s in got] == ran and ran, n.label()
        assert set(ran) == {i.kind for i in lower(n)}  # a Select scores each choice apart
        for s in got:  # an instruction under its node
            assert s.parent.span_id == node_spans[n.id].context.span_id


@pytest.mark.slow
def test_parents_nodes_under_programs_branches_under_the_fork(traced):
    programs = _by(traced.spans, "program", "sgl.program.id")
    nodes = _by(traced.spans, "node", "sgl.node.id")
    for n in _ran(traced.states):
        span = nodes[n.id]
        assert span.parent.span_id == programs[n.program].context.span_id
        assert span.attributes["code.lineno"] == n.line
        assert span.attributes["code.filepath"] == __file__
    top = {st.id for st in traced.states}
    for pid, span in programs.items():
        if pid in top:
            assert span.parent is None
            continue
        fork = next(n for n in traced.states[1].nodes if n.kind == "Fork")
        assert span.parent.span_id == nodes[fork.id].context.span_id
        assert span.context.trace_id == nodes[fork.id].context.trace_id


@pytest.mark.slow
def test_join_links_to_each_branch_last_span(traced):
    st = traced.states[1]
    nodes = _by(traced.spans, "node", "sgl.node.id")
    join = next(n for n in st.nodes if n.kind == "Join")
    branch_ids = [p.attributes["sgl.program.id"] for p in _of(traced.spans, "program")
                  if p.attributes["sgl.program.id"] not in {s.id for s in traced.states}]
    last = []
    for pid in branch_ids:
        mine = [s for s in _of(traced.spans, "node") if s.attributes["sgl.program.id"] == pid]
        last.append(max(mine, key=lambda s: s.attributes["sgl.seq"]).context.span_id)
    links = [lk.context.span_id for lk in nodes[join.id].links]
    assert sorted(links) == sorted(last) and len(links) == 2


@pytest.mark.slow
def test_genai_attributes_on_gen_and_select(traced):
    model = traced.rt.model_path.name
    st = traced.states[0]
    nodes = _by(traced.spans, "node", "sgl.node.id")
    gen = nodes[next(n.id for n in st.nodes if n.kind == "Gen")]
    sel = nodes[next(n.id for n in st.nodes if n.kind == "Select")]
    for span in (gen, sel):
        a = span.attributes
        assert a["gen_ai.operation.name"] == "text_completion"
        assert a["gen_ai.request.model"] == model
        assert a["gen_ai.usage.input_tokens"] > 0
        assert a["gen_ai.usage.cache_read.input_tokens"] >= 0
        assert a["openinference.span.kind"] == "LLM"
    assert gen.attributes["gen_ai.usage.output_tokens"] == 6
    assert list(gen.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert gen.attributes["sgl.output"] == st["a"]
    # The select's prompt shares the gen's prefix: the radix cache served part of it.
    assert sel.attributes["gen_ai.usage.cache_read.input_tokens"] > 0
    decode = next(s for s in _of(traced.spans, "instruction") if s.name == "Decode"
                  and s.attributes["sgl.node.id"] == gen.attributes["sgl.node.id"])
    a = decode.attributes
    assert a["sgl.instruction.kind"] == "Decode" and a["sgl.instruction.batch_size"] >= 1
    assert a["sgl.instruction.new_tokens"] > 0 and a["sgl.instruction.output_tokens"] == 6
    assert a["sgl.instruction.cached_tokens"] >= 0 and a["sgl.instruction.preempted"] == 0
    assert {e.name for e in decode.events} >= {"cache_hit", "cache_insert"}


@pytest.mark.slow
def test_regex_gen_span_carries_its_output(traced):
    st = traced.states[2]
    assert re.fullmatch(YEAR, st["y"])
    gen = next(s for s in _of(traced.spans, "node") if s.name == "Gen y")
    assert gen.attributes["sgl.output"] == gen.attributes["output.value"] == st["y"]
    # The tokens as sampled: the stop token (end of turn) that closed the regex, if any,
    # is among them; the node's text is the match only.
    assert "".join(gen.attributes["sgl.tokens.text"]).startswith(st["y"])


@pytest.mark.slow
def test_span_times_are_the_event_times(traced):
    """Start and end come from the events (one clock offset), not from export time."""
    ts = {e.seq: e.ts for e in traced.events}
    offsets = set()
    for s in traced.spans:
        offsets.add(s.start_time - ts[s.attributes["sgl.seq"]])
        if "sgl.end_seq" in s.attributes:
            offsets.add(s.end_time - ts[s.attributes["sgl.end_seq"]])
    assert len(offsets) == 1


# ---- the round trip ----------------------------------------------------------------------


def _plain(v):
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return v


@pytest.mark.slow
def test_file_round_trip_same_spans_same_order(traced):
    def key(s):
        return s.attributes["sgl.seq"]

    mem = sorted(traced.spans, key=key)
    got = sorted(read_spans(traced.path), key=key)
    assert [s.name for s in got] == [s.name for s in mem]
    for m, f in zip(mem, got):
        assert f.span_id == f"{m.context.span_id:016x}" and len(f.span_id) == 16
        assert f.trace_id == f"{m.context.trace_id:032x}"
        assert f.parent_span_id == (f"{m.parent.span_id:016x}" if m.parent else None)
        assert (f.start, f.end) == (m.start_time, m.end_time)
        assert {k: _plain(v) for k, v in f.attributes.items()} == \
            {k: _plain(v) for k, v in m.attributes.items()}
        assert [(n, t) for n, t, _ in f.events] == [(e.name, e.timestamp) for e in m.events]
        assert [s for _, s, _ in f.links] == [f"{lk.context.span_id:016x}" for lk in m.links]


def _norm(data: dict) -> dict:
    return {k: _plain(v) for k, v in data.items() if v is not None and v != [] and v != ()}


@pytest.mark.slow
def test_load_rebuilds_the_live_timeline(traced):
    live = Timeline(traced.events)
    replay = load(traced.path)
    assert [(e.seq, e.kind, e.program, e.node) for e in replay.events] == \
        [(e.seq, e.kind, e.program, e.node) for e in live.events]
    for a, b in zip(live.events, replay.events):
        assert _norm(event_data(b)) == _norm(event_data(a)), a.kind
    assert live.programs.keys() == replay.programs.keys()
    for pid, p in live.programs.items():
        r = replay.programs[pid]
        assert (r.function, r.parent, r.status, r.nodes, r.children) == \
            (p.function, p.parent, p.status, p.nodes, p.children)
        assert replay.program_text(pid) == live.program_text(pid)
    for nid, n in live.nodes.items():
        r = replay.nodes[nid]
        assert (r.kind, r.name, r.line, r.status, r.preds, r.text, r.value, r.stack) == \
            (n.kind, n.name, n.line, n.status, n.preds, n.text, n.value, n.stack)
        assert [(t.token, t.text, t.seq) for t in r.tokens] == \
            [(t.token, t.text, t.seq) for t in n.tokens]
        assert [(i.kind, i.status, _norm(i.attrs)) for i in r.instructions] == \
            [(i.kind, i.status, _norm(i.attrs)) for i in n.instructions]
    assert replay.cache == live.cache
    assert replay.node_steps() == live.node_steps()
    assert replay.instruction_steps() == live.instruction_steps()
    gen = next(n for n in replay.nodes.values() if n.name == "a")
    assert "".join(t.text for t in gen.tokens) == traced.states[0]["a"]


def _one_span_per_line(line: str) -> list[str]:
    out = []
    for rs in json.loads(line)["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                one = {**rs, "scopeSpans": [{**ss, "spans": [span]}]}
                out.append(json.dumps({"resourceSpans": [one]}) + "\n")
    return out


@pytest.mark.slow
def test_load_orders_by_recorded_seq_not_line_order(traced, tmp_path):
    # The exporter writes one line per batch, and a fast run fits in one batch: one span a
    # line gives the shuffle something to reorder whatever the batching was.
    lines = [_one_span_per_line(line) for line in traced.path.read_text().splitlines()]
    lines = [one for group in lines for one in group]
    assert len(lines) > 1
    random.Random(0).shuffle(lines)
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(lines))
    assert [(e.seq, e.kind) for e in load_events(shuffled)] == \
        [(e.seq, e.kind) for e in load_events(traced.path)]


# ---- levels and live span ids ------------------------------------------------------------


@pytest.mark.slow
def test_token_level_adds_one_span_event_per_token(default_backend, tmp_path):
    mem, path = InMemorySpanExporter(), tmp_path / "tokens.jsonl"
    sgl.enable_tracing(file=path, exporter=mem, level="token", runtime=default_backend)
    try:
        st = qa.run(q="Two plus two?")
    finally:
        sgl.disable_tracing()
    decode = next(s for s in mem.get_finished_spans() if s.name == "Decode")
    tokens = [e for e in decode.events if e.name == "token"]
    assert len(tokens) == 6
    assert "".join(e.attributes["sgl.data.text"] for e in tokens) == st["a"]
    gen = next(n for n in load(path).nodes.values() if n.name == "a")  # replays the same
    assert [t.seq for t in gen.tokens] == [e.attributes["sgl.seq"] for e in tokens]


@pytest.mark.slow
def test_traceparent_of_a_live_node(default_backend):
    mem = InMemorySpanExporter()
    sgl.enable_tracing(exporter=mem, runtime=default_backend)
    try:
        st = qa.run(q="Is water wet?", step=True)
        st.debug.breakpoint(name="a")
        st.debug.continue_()
        assert st.debug.wait_until_held(timeout=WAIT)
        gen = st.debug.current
        st.debug.step_instruction()  # into the Gen: its span is open now
        assert st.debug.wait_until_held(timeout=WAIT)
        tp = traceparent_for(gen.id)
        st.debug.continue_()
        assert st["v"]
    finally:
        sgl.disable_tracing()
    span = _by(mem.get_finished_spans(), "node", "sgl.node.id")[gen.id]
    c = span.context
    assert tp == f"00-{c.trace_id:032x}-{c.span_id:016x}-01"
    assert traceparent_for(gen.id) is None  # tracing is off


# ---- bad trace files -----------------------------------------------------------------------


def _line(scope_attrs: list, scope: str = "sgl_nb.tracing") -> str:
    span = {"traceId": "0" * 31 + "1", "spanId": "0" * 15 + "1", "name": "program f",
            "kind": 1, "startTimeUnixNano": "1", "endTimeUnixNano": "2", "attributes": [
                {"key": "sgl.span", "value": {"stringValue": "program"}},
                {"key": "sgl.seq", "value": {"intValue": "1"}}]}
    return json.dumps({"resourceSpans": [{"resource": {}, "scopeSpans": [
        {"scope": {"name": scope, "attributes": scope_attrs}, "spans": [span]}]}]}) + "\n"


def test_an_earlier_format_is_a_clear_error(tmp_path):
    old = tmp_path / "old.jsonl"
    old.write_text(_line([]))
    with pytest.raises(TraceFormatError, match="earlier, unversioned format"):
        load(old)
    v0 = tmp_path / "v0.jsonl"
    v0.write_text(_line([{"key": "sgl.trace.format", "value": {"intValue": "0"}}]))
    with pytest.raises(TraceFormatError, match="written in format 0; .* replays trace format 1"):
        load(v0)


def test_not_an_sgl_trace_is_a_clear_error(tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text(_line([], scope="someone.else"))
    with pytest.raises(TraceFormatError, match="no sgl-nb spans"):
        load(other)
    junk = tmp_path / "junk.jsonl"
    junk.write_text(_line([]) + "not json\n")
    with pytest.raises(ValueError, match=r"junk.jsonl:2: not an OTLP/JSON line"):
        load(junk)


@sgl.function
def few_shot(s, question):
    s += "Question: Is a whale a mammal?\nAnswer: yes\n\nQuestion: " + question + "\nAnswer:"
    s += sgl.select("answer", [" yes", " no"])


@pytest.mark.slow
def test_events_of_no_program_are_kept_for_replay(default_backend, tmp_path):
    """A bare rt.generate is a request of no program: its cache events become spans of
    their own, and the replayed cache totals match the live ones."""
    path = tmp_path / "batch.jsonl"
    q = default_backend.events.subscribe()
    sgl.enable_tracing(file=path, runtime=default_backend)
    try:
        states = few_shot.run_batch([{"question": "Is ice cold?"}, {"question": "Is fire wet?"}])
        default_backend.generate("A request of no program, long enough to be cached.",
                                 max_tokens=2)
    finally:
        sgl.disable_tracing()
        default_backend.events.unsubscribe(q)
    assert all(st.error() is None for st in states)
    live = Timeline(e for e in _drain(q) if e.program is not None or isinstance(e, CACHE_EVENTS))
    replay = load(path)
    assert replay.cache == live.cache and live.cache["prompt_tokens"] > 0
    assert [e.seq for e in replay.cache_events] == [e.seq for e in live.cache_events]
    loose = [s for s in read_spans(path) if s.attributes.get("sgl.span") == "event"]
    assert loose and all(s.parent_span_id is None for s in loose)


@pytest.mark.slow
def test_a_cancelled_program_is_traced_and_replayed_as_cancelled(default_backend, tmp_path):
    @sgl.function
    def tale(s):
        s += "A long tale:" + sgl.gen("t", max_tokens=2000, ignore_eos=True)
        s += " The end." + sgl.gen("moral", max_tokens=8)

    mem, path = InMemorySpanExporter(), tmp_path / "cancelled.jsonl"
    sgl.enable_tracing(file=path, exporter=mem, runtime=default_backend)
    try:
        st = tale.run(stream=True)
        next(st.text_iter("t"))
        st.cancel()
        st.wait(WAIT)
    finally:
        sgl.disable_tracing()
    spans = mem.get_finished_spans()
    program = next(s for s in _of(spans, "program") if s.attributes["sgl.program.id"] == st.id)
    assert program.attributes["sgl.program.status"] == "cancelled"
    assert program.status.status_code.name != "ERROR"  # asked for, not a fault
    nodes = {s.attributes["sgl.node.id"]: s for s in _of(spans, "node")}
    statuses = [nodes[n.id].attributes["sgl.node.finished.status"]
                for n in st.nodes if n.kind not in ("Init", "Return")]
    # The text ran; the Gen was cut short; the Text and Gen queued after it never ran.
    assert statuses == ["done", "cancelled", "cancelled", "cancelled"]
    decode = next(s for s in spans if s.name == "Decode")
    assert decode.attributes["sgl.instruction.finish_reason"] == "abort"
    tl = load(path)  # the replay shows the same
    assert tl.programs[st.id].status == "cancelled"
    assert [tl.nodes[n.id].status for n in st.nodes if n.kind not in ("Init", "Return")] == statuses
