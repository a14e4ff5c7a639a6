"""Events <-> span attributes: what a span must carry so that a replay can rebuild the
Events that made it. An event's fields become a dict (`event_data`) and come back
(`event_from`) here only; one flat attribute per field: `<prefix><name>`."""

from __future__ import annotations

import json
from dataclasses import fields
from enum import Enum

from sgl_nb.runtime.events import (
    EVENT_TYPES,
    Event,
    EventKind,
    Hold,
    InstructionFinished,
    NodeKind,
    Op,
    Status,
)

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
_BASE = ("program", "node", "request", "ts", "seq")  # what every Event has
_KINDS = frozenset(k.value for k in EventKind)


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


# ---- events <-> their fields in a trace ------------------------------------------------

# An event's fields under other names in a trace: the Node's and the Instruction's kind.
_WIRE_NAME = {"node_kind": "kind", "op": "kind"}
_ENUMS = {"status": Status, "node_kind": NodeKind, "op": Op, "at": Hold}
_TUPLES = ("preds", "stack", "stack_args", "children", "key", "tree_nodes")
_ENUM_TUPLES = {"ops": Op}
_OWN = {cls: tuple(f.name for f in fields(cls) if f.name not in _BASE)
        for cls in EVENT_TYPES.values()}


def event_name(e: Event) -> str:
    return e.kind.value


def is_event_name(name: str) -> bool:
    return name in _KINDS


def event_data(e: Event) -> dict:
    """An event's own fields (its ids and times apart) by their names in a trace, kinds and
    statuses by their names. A finished Instruction's usage figures are fields of their
    own, and its status is said only when it failed."""
    if isinstance(e, InstructionFinished):
        out = {"kind": e.op.value, "index": e.index, **e.usage}
        if e.error is not None:
            out.update(status=e.status.value, error=e.error)
        return out
    out = {}
    for name in _OWN[type(e)]:
        v = getattr(e, name)
        if name in _ENUM_TUPLES:
            v = [x.value for x in v]
        out[_WIRE_NAME.get(name, name)] = v.value if isinstance(v, Enum) else v
    return out


def event_from(name: str, ids: tuple, data: dict, ts: int, seq: int) -> Event:
    """The Event a trace recorded as `name` with these fields (event_data's form): fields
    this version does not know are left out, those the trace lacks take their defaults.
    ValueError or TypeError for a value of the wrong kind."""
    cls = EVENT_TYPES[EventKind(name)]
    program, node, request = ids
    data = dict(data)
    own = {}
    if cls is InstructionFinished:
        own["status"] = data.pop("status", Status.DONE)
        own["error"] = data.pop("error", None)
    wire = {_WIRE_NAME.get(k, k): k for k in _OWN[cls]}
    for k in list(data):
        if k in wire:
            own[wire[k]] = data.pop(k)
    if cls is InstructionFinished:
        own["usage"] = data
    return cls(program=program, node=node, request=request, ts=ts, seq=seq,
               **{k: _field(k, v) for k, v in own.items() if v is not None})


def _field(name: str, v):
    if name in _ENUMS:
        return _ENUMS[name](v)
    if name in _TUPLES:
        return tuple(v)
    if name in _ENUM_TUPLES:
        return tuple(_ENUM_TUPLES[name](x) for x in (json.loads(v) if isinstance(v, str) else v))
    if name == "top" and isinstance(v, str):  # a span event holds it as JSON text
        return json.loads(v)
    return v
