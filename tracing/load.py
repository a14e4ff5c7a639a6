"""Replay: a trace file back into the Events that made it, and into a Timeline."""

from __future__ import annotations

import json
import math
import os

from sgl_nb.runtime.events import Event
from sgl_nb.tracing import codec
from sgl_nb.tracing.otlp_json import MALFORMED, SpanRecord, TraceFormatError, read_spans
from sgl_nb.tracing.timeline import Timeline

__all__ = ["TraceFormatError", "load", "load_events", "span_events"]


def load(path: str | os.PathLike) -> Timeline:
    """The Timeline of an exported OTLP/JSON trace file (programs, Nodes, Instructions,
    tokens and cache changes), its events ordered by their recorded seq. TraceFormatError,
    naming the file and what is wrong, for anything that is not such a trace."""
    events = load_events(path)
    try:
        return Timeline(events)
    except MALFORMED as e:
        raise TraceFormatError(f"{path}: its events cannot be replayed ({type(e).__name__}: "
                               f"{e})") from None


def load_events(path: str | os.PathLike) -> list[Event]:
    spans = [s for s in read_spans(path) if s.scope == codec.SCOPE_NAME]
    if not spans:
        raise TraceFormatError(f"{path}: no sgl-nb spans (scope {codec.SCOPE_NAME!r}) in "
                               "this file; was it written by sgl.enable_tracing(file=...)?")
    for s in spans:
        _check_format(path, s)
    events = []
    for s in spans:
        try:
            events.extend(span_events(s))
        except MALFORMED as e:
            raise TraceFormatError(f"{path}: span {s.name!r} ({s.span_id}) is malformed "
                                   f"({type(e).__name__}: {e})") from None
    try:
        events.sort(key=lambda e: e.seq)
    except TypeError:
        raise TraceFormatError(f"{path}: a span's {codec.SEQ} is not a number") from None
    return events


def _check_format(path, s: SpanRecord) -> None:
    version = s.scope_attributes.get(codec.FORMAT_KEY)
    if version == codec.FORMAT_VERSION:
        return
    written = f"format {version}" if version is not None else "an earlier, unversioned format"
    raise TraceFormatError(f"{path}: this trace was written in {written}; this sgl-nb "
                           f"replays trace format {codec.FORMAT_VERSION} only. Record it "
                           "again with this version.")


def span_events(s: SpanRecord) -> list[Event]:
    """The Events one span stands for: its opening and closing events, what it recorded
    as span events, and (at the default level) its tokens."""
    a = s.attributes
    kind = a.get(codec.SPAN_TYPE)
    ids = (a.get(codec.PROGRAM), a.get(codec.NODE), a.get(codec.REQUEST))
    out: list[Event] = []
    if kind == "event":
        out.append(codec.event_from(a[codec.EVENT_KIND], ids, codec.from_attrs(a, codec.DATA),
                                    s.start, a[codec.SEQ]))
    elif kind in _OPEN_CLOSE:
        open_kind, close_kind, start_data, end_data = _OPEN_CLOSE[kind](a)
        open_ids = ids
        if kind == "program":  # a branch's program_started names its parent's Fork node
            ids, open_ids = (ids[0], None, None), (ids[0], a.get("sgl.program.fork_node"), None)
        if codec.SEQ in a:
            out.append(codec.event_from(open_kind, open_ids, start_data, s.start,
                                        a[codec.SEQ]))
        if codec.END_SEQ in a:
            out.append(codec.event_from(close_kind, ids, end_data, s.end, a[codec.END_SEQ]))
    for name, ts, ea in s.events:
        if codec.SEQ in ea and codec.is_event_name(name):
            eids = (ea.get(codec.PROGRAM), ea.get(codec.NODE), ea.get(codec.REQUEST))
            out.append(codec.event_from(name, eids, codec.from_attrs(ea, codec.DATA), ts,
                                        ea[codec.SEQ]))
    if "sgl.tokens.seq" in a:
        out.extend(_tokens(a, ids, s.start))
    return out


def _program(a: dict):
    start = codec.from_attrs(a, "sgl.program.", skip=("id", "error", "implicit",
                                                                "fork_node", "status",
                                                                "error_line"))
    end = {"error": a.get("sgl.program.error"), "status": a.get("sgl.program.status"),
           "line": a.get("sgl.program.error_line")}
    return "program_started", "program_finished", start, end


def _node(a: dict):
    start = codec.from_attrs(a, "sgl.node.", skip=("id",))
    return "node_started", "node_finished", start, codec.from_attrs(a, "sgl.node.finished.")


def _instruction(a: dict):
    finished = codec.from_attrs(a, "sgl.instruction.")
    start = {k: finished[k] for k in ("kind", "index") if k in finished}
    return "instruction_started", "instruction_finished", start, finished


_OPEN_CLOSE = {"program": _program, "node": _node, "instruction": _instruction}


def _tokens(a: dict, ids: tuple, start: int) -> list[Event]:
    program, node, _ = ids
    cols = [a.get(f"sgl.tokens.{k}") or [] for k in ("id", "text", "logprob", "forced",
                                                       "seq", "ts")]
    extra = a.get("sgl.tokens.extra") or ["{}"] * len(cols[0])
    drafted = a.get("sgl.tokens.drafted") or [False] * len(cols[0])
    out = []
    for tok, text, logprob, forced, seq, dt, more, draft in zip(*cols, extra, drafted):
        data = {"token": None if tok < 0 else tok, "text": text,
                "logprob": None if math.isnan(logprob) else logprob, "forced": forced,
                "drafted": draft, **json.loads(more)}
        out.append(codec.event_from("token", (program, node, None), data, start + dt, seq))
    return out
