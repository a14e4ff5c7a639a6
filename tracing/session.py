"""Turning tracing on and off for one event bus: the tracer provider (the user's, if they
set an SDK one, else our own), the span processors, and the SpanRecorder subscribed to
the bus."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from sgl_nb.runtime.events import Event
from sgl_nb.tracing import codec
from sgl_nb.tracing.exporters import GuardedExporter, JsonFileExporter, otlp_http_exporter
from sgl_nb.tracing.spans import SpanRecorder

# Tracing is lossless: the processor's queue is sized so a long run never overflows it
# before the export thread catches up (the SDK default, 2048, drops spans).
MAX_QUEUE = 1 << 20


@dataclass
class TracingSession:
    bus: object
    recorder: SpanRecorder
    provider: TracerProvider
    own_provider: bool
    processors: list[BatchSpanProcessor] = field(default_factory=list)
    guards: list[GuardedExporter] = field(default_factory=list)

    def flush(self, timeout_millis: int = 30000) -> bool:
        return all(p.force_flush(timeout_millis) for p in self.processors)


_session: TracingSession | None = None
_lock = threading.Lock()


def enable(bus, *, file: str | os.PathLike | None = None, endpoint: str | None = None,
           exporter: SpanExporter | None = None, service_name: str = "sgl-nb",
           resource_attributes: dict | None = None, level: str = "node",
           model: str | None = None, seed: Sequence[Event] = ()) -> TracingSession:
    """Trace every program on `bus` (a runtime's EventBus) from now on. Replaces the
    tracing that was on, if any. `seed`: events recorded first, for what exists before
    tracing starts (the radix tree so far, as its snapshot), so a replay starts from it."""
    if level not in ("node", "token"):
        raise ValueError(f"tracing level must be 'node' or 'token', got {level!r}")
    exporters = _exporters(file, endpoint, exporter)
    current = trace.get_tracer_provider()
    own = not isinstance(current, TracerProvider)
    if own and not exporters:
        raise ValueError("enable_tracing needs file=, endpoint= or exporter= (or a "
                         "TracerProvider of the OpenTelemetry SDK set by you beforehand)")
    if own:
        attrs = {"service.name": service_name, **(resource_attributes or {})}
        provider = TracerProvider(resource=Resource.create(attrs))
    else:
        provider = current  # the user's: their resource and processors see our spans too
    tracer = provider.get_tracer(codec.SCOPE_NAME, "0.1.0",
                                 attributes={codec.FORMAT_KEY: codec.FORMAT_VERSION})
    session = TracingSession(bus, SpanRecorder(tracer, level, model), provider, own)
    for exp in exporters:
        guard = GuardedExporter(exp)
        proc = BatchSpanProcessor(guard, max_queue_size=MAX_QUEUE, schedule_delay_millis=500,
                                  max_export_batch_size=2048)
        provider.add_span_processor(proc)
        session.processors.append(proc)
        session.guards.append(guard)
    global _session
    with _lock:
        old, _session = _session, session
    if old is not None:
        _close(old)
    for i, e in enumerate(seed):  # before every published event, in their own order
        session.recorder(replace(e, seq=i - len(seed)))
    bus.subscribe(session.recorder)
    return session


def _exporters(file, endpoint, exporter) -> list[SpanExporter]:
    out: list[SpanExporter] = []
    if file is not None:
        if not isinstance(file, str | os.PathLike) or not os.fspath(file):
            raise ValueError(f"file= must be a path, got {file!r}")
        out.append(JsonFileExporter(file))
    if endpoint is not None:
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint= must be an http(s) URL such as "
                             f"http://127.0.0.1:6006/v1/traces, got {endpoint!r}")
        out.append(otlp_http_exporter(endpoint))
    if exporter is not None:
        if not isinstance(exporter, SpanExporter):
            raise TypeError(f"exporter= must be an OpenTelemetry SpanExporter, "
                            f"got {type(exporter).__name__}")
        out.append(exporter)
    return out


def disable() -> None:
    """Stop tracing: close the spans still open and export everything recorded."""
    global _session
    with _lock:
        session, _session = _session, None
    if session is not None:
        _close(session)


def _close(session: TracingSession) -> None:
    session.bus.unsubscribe(session.recorder)
    session.recorder.close()
    for guard in session.guards:
        if guard.warned:  # a dead destination: do not wait on its retries at shutdown
            guard.shutdown()
    for proc in session.processors:
        proc.shutdown()
    if session.own_provider:
        session.provider.shutdown()


def current() -> TracingSession | None:
    return _session


def traceparent_for(node_id: int) -> str | None:
    """The W3C traceparent of the live span of Node `node_id`, or None (tracing off, or
    no such span open): a remote backend sends it with the Node's HTTP request."""
    session = _session
    return session.recorder.traceparent(node_id) if session is not None else None
