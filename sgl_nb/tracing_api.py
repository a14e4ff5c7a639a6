"""`sgl.enable_tracing(...)` / `sgl.disable_tracing()`: every program on a Runtime becomes
OpenTelemetry spans (one per program, Node and Instruction), written to an OTLP/JSON file,
sent over OTLP/HTTP, or handed to any SpanExporter."""

from __future__ import annotations

import os

from opentelemetry.sdk.trace.export import SpanExporter

from sgl_nb.backends.backend import is_backend
from sgl_nb.runtime.events import CacheNodeAdded
from sgl_nb.tracing import session
from sgl_nb.tracing.cache_tree import snapshot_events


def enable_tracing(file: str | os.PathLike | None = None, endpoint: str | None = None,
                   exporter: SpanExporter | None = None, service_name: str = "sgl-nb",
                   resource_attributes: dict | None = None, level: str = "node",
                   runtime=None) -> None:
    """Trace the programs of `runtime` (default: the default backend).

    file: append OTLP/JSON, one export per line (replay it with sgl_nb.tracing.load).
    endpoint: an OTLP/HTTP traces URL, e.g. http://127.0.0.1:6006/v1/traces (Phoenix).
    exporter: any OpenTelemetry SpanExporter (several destinations may be given at once).
    service_name, resource_attributes: the resource of our own TracerProvider; if you set
    an SDK TracerProvider yourself, that one is used (with its resource) instead.
    level: "node" (default) or "token" (also one span event per generated token)."""
    rt = runtime if runtime is not None else _default_runtime()
    if not is_backend(rt):
        raise TypeError(f"enable_tracing(runtime=...) needs an sgl.Runtime or "
                        f"sgl.RuntimeEndpoint, got {type(rt).__name__}")
    session.enable(rt.events, file=file, endpoint=endpoint, exporter=exporter,
                   service_name=service_name, resource_attributes=resource_attributes,
                   level=level, model=rt.model_name, seed=_tree_so_far(rt))


def disable_tracing() -> None:
    """Stop tracing; close the spans still open and export everything recorded."""
    session.disable()


def _tree_so_far(rt) -> list:
    """The radix tree as tracing starts, for a replay to start from (nothing for an empty
    tree: a trace of a fresh runtime holds only its own events)."""
    tree = snapshot_events(rt.cache)
    return tree if any(isinstance(e, CacheNodeAdded) for e in tree) else []


def _default_runtime():
    from sgl_nb.language.function import get_default_backend

    return get_default_backend()  # the Runtime programs run on (created on first use)
