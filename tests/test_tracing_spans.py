"""Span mapping of events the small programs of test_tracing.py do not produce on their
own: preemption, resumption and retraction, errors, tracing switched on mid-program.
The events are published on a real EventBus exactly as the runtime contract describes."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from sgl_nb.runtime.events import (
    CacheEvict,
    EventBus,
    InstructionFinished,
    InstructionStarted,
    NodeFinished,
    NodeKind,
    NodeStarted,
    Op,
    Preempted,
    ProgramFinished,
    ProgramStarted,
    Resumed,
    Retracted,
    Status,
)
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


def _decode_program(bus: EventBus, usage: dict, error: str | None = None) -> None:
    status = Status.DONE if error is None else Status.ERROR
    bus.emit(ProgramStarted, program=1, function="f")
    bus.emit(NodeStarted, program=1, node=2, node_kind=NodeKind.GEN, name="g", line=9)
    bus.emit(InstructionStarted, program=1, node=2, request=3, op=Op.DECODE)
    bus.emit(Preempted, program=1, node=2, request=3, reason="priority", priority="batch")
    bus.emit(Resumed, program=1, node=2, request=3, reason="scheduler")
    bus.emit(Retracted, program=1, node=2, request=3, reason="memory")
    bus.emit(CacheEvict, tokens=12)
    bus.emit(InstructionFinished, program=1, node=2, request=3, op=Op.DECODE,
             usage={"preempted": 2, **usage}, status=status, error=error)
    bus.emit(NodeFinished, program=1, node=2, status=status)
    bus.emit(ProgramFinished, program=1, error=error)


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
        _decode_program(bus, {}, error="ValueError('x')")

    spans = {s.name: s for s in _traced(run)}
    assert spans["Decode"].status.status_code == StatusCode.ERROR
    assert spans["Gen g"].status.status_code == StatusCode.ERROR
    assert spans["program f"].status.status_code == StatusCode.ERROR
    assert spans["program f"].attributes["sgl.program.error"] == "ValueError('x')"


def test_tracing_switched_on_mid_program_still_builds_a_tree():
    def run(bus):  # program_started came before tracing was on
        bus.emit(NodeStarted, program=5, node=6, node_kind=NodeKind.TEXT, line=1)
        bus.emit(NodeFinished, program=5, node=6)

    spans = {s.name: s for s in _traced(run)}
    prog, text = spans["program 5"], spans["Text"]
    assert text.parent.span_id == prog.context.span_id
    assert prog.attributes["sgl.program.implicit"] is True
    # ... and a replay invents no program_started / program_finished for it.
    (req,) = [encode([prog, text])]
    kinds = sorted(type(e).__name__ for s in decode(req) for e in span_events(s))
    assert kinds == ["NodeFinished", "NodeStarted"]
