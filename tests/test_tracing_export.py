"""Exporters: the OTLP/JSON lines format, a failing destination (one warning, the program
unaffected), the user's own TracerProvider, and bad arguments."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import textwrap

import pytest
from support import env_with_tests
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.runtime.events import (
    EventBus,
    InstructionFinished,
    InstructionStarted,
    NodeFinished,
    NodeKind,
    NodeStarted,
    Op,
    ProgramFinished,
    ProgramStarted,
    Status,
    Token,
)
from sgl_nb.tracing import session


def hand_program(bus: EventBus) -> None:
    """One small program's events, as the runtime publishes them."""
    bus.emit(ProgramStarted, program=1, function="f", priority="normal")
    bus.emit(NodeStarted, program=1, node=7, node_kind=NodeKind.GEN, name="x", line=3,
             file="f.py")
    bus.emit(InstructionStarted, program=1, node=7, request=9, op=Op.DECODE)
    bus.emit(Token, program=1, node=7, request=9, token=5, text="hi", logprob=-0.25)
    bus.emit(InstructionFinished, program=1, node=7, request=9, op=Op.DECODE,
             usage={"input_tokens": 4, "output_tokens": 1})
    bus.emit(NodeFinished, program=1, node=7, status=Status.DONE)
    bus.emit(ProgramFinished, program=1)


def test_otlp_json_lines_use_hex_ids_and_integer_enums(tmp_path):
    path = tmp_path / "t.jsonl"
    bus = EventBus()
    session.enable(bus, file=path, service_name="svc", resource_attributes={"team": "a"})
    hand_program(bus)
    session.disable()
    lines = path.read_text().splitlines()
    assert lines
    spans = {}
    for line in lines:  # one line per export batch; a slow machine may export in several
        (rs,) = json.loads(line)["resourceSpans"]
        res = {kv["key"]: kv["value"] for kv in rs["resource"]["attributes"]}
        assert res["service.name"] == {"stringValue": "svc"}
        assert res["team"] == {"stringValue": "a"}
        (ss,) = rs["scopeSpans"]
        assert ss["scope"]["name"] == "sgl_nb.tracing"
        spans.update({s["name"]: s for s in ss["spans"]})
    assert set(spans) == {"program f", "Gen x", "Decode"}
    for s in spans.values():
        assert len(s["traceId"]) == 32 and len(s["spanId"]) == 16
        int(s["traceId"], 16), int(s["spanId"], 16)  # hex, not base64
        assert s["kind"] == 1  # SPAN_KIND_INTERNAL, as an integer
        assert s["startTimeUnixNano"].isdigit()
    assert spans["Gen x"]["parentSpanId"] == spans["program f"]["spanId"]
    assert spans["Decode"]["parentSpanId"] == spans["Gen x"]["spanId"]
    attrs = {kv["key"]: kv["value"] for kv in spans["Gen x"]["attributes"]}
    assert attrs["code.lineno"] == {"intValue": "3"}
    assert attrs["sgl.tokens.logprob"] == {"arrayValue": {"values": [{"doubleValue": -0.25}]}}


def test_user_tracer_provider_is_used():
    """A TracerProvider set by the user gets our spans, with the user's resource."""
    code = textwrap.dedent("""
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter)
        from sgl_nb.runtime.events import EventBus
        from sgl_nb.tracing import session
        import test_tracing_export as t

        mem = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": "mine"}))
        provider.add_span_processor(SimpleSpanProcessor(mem))
        trace.set_tracer_provider(provider)
        bus = EventBus()
        session.enable(bus)  # no destination of ours: the user's processors are enough
        t.hand_program(bus)
        session.disable()
        spans = mem.get_finished_spans()
        print(sorted(s.name for s in spans), spans[0].resource.attributes["service.name"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env_with_tests(), timeout=WAIT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['Decode', 'Gen x', 'program f'] mine"


def test_bad_arguments_are_named():
    bus = EventBus()
    with pytest.raises(ValueError, match="endpoint= must be an http"):
        session.enable(bus, endpoint="localhost:4318")
    with pytest.raises(ValueError, match="level must be 'node' or 'token'"):
        session.enable(bus, file="x.jsonl", level="tokens")
    with pytest.raises(TypeError, match="exporter= must be an OpenTelemetry SpanExporter"):
        session.enable(bus, exporter=object())
    with pytest.raises(ValueError, match="needs file=, endpoint= or exporter="):
        session.enable(bus)
    assert session.current() is None and not bus.active


# ---- failing destinations ------------------------------------------------------------------


@sgl.function
def _short(s, q):
    s += "Q: " + q + "\nA:"
    s += sgl.gen("a", max_tokens=4, ignore_eos=True)


def _run_twice_flushing() -> list[str]:
    """Two programs, each followed by a flush: two export attempts at least."""
    out = []
    for q in ("Is the sky blue?", "Is grass green?"):
        out.append(_short.run(q=q)["a"])
        session.current().flush()
    return out


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.slow
def test_unwritable_file_warns_once_and_the_program_runs(default_backend, tmp_path, caplog):
    expected = [_short.run(q=q)["a"] for q in ("Is the sky blue?", "Is grass green?")]
    bad = tmp_path / "a-directory"
    bad.mkdir()  # root may write anywhere: a directory is what cannot be opened as a file
    caplog.set_level(logging.WARNING)
    sgl.enable_tracing(file=bad, runtime=default_backend)
    try:
        got = _run_twice_flushing()
        guard = session.current().guards[0]
    finally:
        sgl.disable_tracing()
    assert got == expected
    (w,) = _warnings(caplog)
    assert w.name == "sgl_nb.tracing" and str(bad) in w.getMessage()
    assert "IsADirectoryError" in w.getMessage() and guard.failures >= 2


@pytest.mark.slow
def test_receiver_down_warns_once_and_the_program_runs(default_backend, caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    expected = [_short.run(q=q)["a"] for q in ("Is the sky blue?", "Is grass green?")]
    caplog.set_level(logging.WARNING)
    sgl.enable_tracing(endpoint=endpoint, runtime=default_backend)
    try:
        got = _run_twice_flushing()
        guard = session.current().guards[0]
    finally:
        sgl.disable_tracing()
    assert got == expected
    (w,) = _warnings(caplog)  # the OTLP exporter's own retry messages are not repeated
    assert w.name == "sgl_nb.tracing" and endpoint in w.getMessage()
    assert guard.failures >= 2
