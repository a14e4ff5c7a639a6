"""sgl_nb.tracing: runtime Events as OpenTelemetry spans, exported to a file or a receiver,
and replayed from a trace file into a Timeline.

`load(path)` and the Timeline need no OpenTelemetry SDK at import; the span side loads on
first use."""

from __future__ import annotations

from sgl_nb.tracing.load import TraceFormatError, load, load_events
from sgl_nb.tracing.timeline import InstructionView, NodeView, ProgramView, Timeline, TokenView

__all__ = ["InstructionView", "NodeView", "ProgramView", "Timeline", "TokenView",
           "TraceFormatError", "load", "load_events", "traceparent_for"]


def traceparent_for(node_id: int) -> str | None:
    """The W3C traceparent of Node `node_id`'s live span, or None when tracing is off."""
    from sgl_nb.tracing.session import traceparent_for as tp

    return tp(node_id)
