"""Span mapping of events the small programs of test_tracing.py do not produce on their
own: preemption, resumption and retraction, errors, tracing switched on mid-program.
The events are published on a real EventBus exactly as the runtime contract describes."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from sgl_nb.runtime.events import EventBus
from sgl_nb.tracing import session
from sgl_nb.tracing.load import span_events
from sgl_nb.tracing.otlp_json import decode, encode


def _traced(emit) -> list:
    bus, mem = EventBus(), InMemorySpanExporter()
    session.enable(bus, exporter=mem, model="m")
    emit(bus)
    session.disable()
    assert not bus.active  # unsubscribed
    return list(mem.get_finished_spans())


def _decode_program(bus: EventBus, finish: dict) -> None:
    bus.emit("program_started", program=1, data={"function": "f"})
    bus.emit("node_started", program=1, node=2, data={"kind": "Gen", "name": "g", "line": 9})
    bus.emit("instruction_started", program=1, node=2, request=3,
             data={"kind": "Decode", "index": 0})
    bus.emit("preempted", program=1, node=2, request=3,
             data={"reason": "priority", "priority": "batch"})
    bus.emit("resumed", program=1, node=2, request=3, data={"reason": "scheduler"})
    bus.emit("retracted", program=1, node=2, request=3, data={"reason": "memory"})
    bus.emit("cache_evict", data={"tokens": 12})
    bus.emit("instruction_finished", program=1, node=2, request=3,
             data={"kind": "Decode", "index": 0, "preempted": 2, **finish})
    bus.emit("node_finished", program=1, node=2, data={"status": finish.get("status", "done")})
    bus.emit("program_finished", program=1, data={"error": finish.get("error")})


def test_preemption_resumption_retraction_are_span_events():
    spans = {s.name: s for s in _traced(lambda b: _decode_program(b, {"output_tokens": 4}))}
    decode_span = spans["Decode"]
    assert [e.name for e in decode_span.events] == ["preempted", "resumed", "retracted"]
    assert decode_span.events[0].attributes["sgl.data.reason"] == "priority"
    assert decode_span.attributes["sgl.instruction.preempted"] == 2
    # An eviction belongs to no program: a span of its own, outside the program's trace.
    evict = spans["cache_evict"]
    assert evict.parent is None and evict.attributes["sgl.data.tokens"] == 12
    assert spans["Gen g"].attributes["gen_ai.usage.output_tokens"] == 4
    assert spans["Gen g"].attributes["gen_ai.request.model"] == "m"


def test_errors_set_the_status():
    def run(bus):
        _decode_program(bus, {"status": "error", "error": "ValueError('x')"})

    spans = {s.name: s for s in _traced(run)}
    assert spans["Decode"].status.status_code == StatusCode.ERROR
    assert spans["Gen g"].status.status_code == StatusCode.ERROR
    assert spans["program f"].status.status_code == StatusCode.ERROR
    assert spans["program f"].attributes["sgl.program.error"] == "ValueError('x')"


def test_tracing_switched_on_mid_program_still_builds_a_tree():
    def run(bus):  # program_started came before tracing was on
        bus.emit("node_started", program=5, node=6, data={"kind": "Text", "line": 1})
        bus.emit("node_finished", program=5, node=6, data={"status": "done"})

    spans = {s.name: s for s in _traced(run)}
    prog, text = spans["program 5"], spans["Text"]
    assert text.parent.span_id == prog.context.span_id
    assert prog.attributes["sgl.program.implicit"] is True
    # ... and a replay invents no program_started / program_finished for it.
    (req,) = [encode([prog, text])]
    kinds = sorted(e.kind for s in decode(req) for e in span_events(s))
    assert kinds == ["node_finished", "node_started"]
