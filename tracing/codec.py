"""Event fields <-> span attributes: what a span must carry so that a replay can rebuild
the Events that made it. One flat key per field: `<prefix><name>`."""

from __future__ import annotations

import json

# The trace format this version writes and reads (an instrumentation-scope attribute).
FORMAT_VERSION = 1
FORMAT_KEY = "sgl.trace.format"
SCOPE_NAME = "sgl_nb.tracing"

# Span attributes every sgl-nb span carries, for replay.
SPAN_TYPE = "sgl.span"  # program | node | instruction | event
SEQ = "sgl.seq"  # seq of the event that opened the span
END_SEQ = "sgl.end_seq"  # seq of the event that closed it
PROGRAM = "sgl.program.id"
NODE = "sgl.node.id"
REQUEST = "sgl.request.id"
EVENT_KIND = "sgl.event"  # on a standalone event span: the event's kind
DATA = "sgl.data."  # prefix of an event's data fields on span events

_PRIMITIVES = (bool, int, float, str)


def attr_value(v):
    """An OTel attribute value for `v`, or None when it has none (None, empty list).
    Lists of one primitive type stay lists; anything else becomes JSON text."""
    if v is None or isinstance(v, _PRIMITIVES):
        return v
    if isinstance(v, list | tuple):
        if not v:
            return None
        kinds = {type(x) for x in v}
        if len(kinds) == 1 and kinds.pop() in _PRIMITIVES:
            return list(v)
    return json.dumps(v, default=str)


def to_attrs(data: dict, prefix: str) -> dict:
    out = {}
    for k, v in data.items():
        a = attr_value(v)
        if a is not None:
            out[prefix + k] = a
    return out


def from_attrs(attrs: dict, prefix: str, skip: tuple[str, ...] = ()) -> dict:
    """The fields to_attrs wrote under `prefix` (not those of a longer, dotted prefix)."""
    n = len(prefix)
    return {k[n:]: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.items()
            if k.startswith(prefix) and "." not in k[n:] and k[n:] not in skip}


def id_attrs(program: int | None, node: int | None, request: int | None) -> dict:
    out = {}
    if program is not None:
        out[PROGRAM] = program
    if node is not None:
        out[NODE] = node
    if request is not None:
        out[REQUEST] = request
    return out
