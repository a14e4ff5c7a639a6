"""What a replay shows, as plain JSON: the Timeline of a trace file (programs, Nodes, their
Instructions and tokens, the cache figures, the stops) and the terminal debugger's rows.
tests/test_trace_compat.py compares it with what the version that wrote the trace showed."""

from __future__ import annotations

import json
import math
from enum import Enum

from sgl_nb.tracing import Timeline
from sgl_nb.tui.replay import ReplaySession


def plain(v):
    """JSON-able: enums by their value, tuples as lists, NaN as a string."""
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items() if x is not None}
    if isinstance(v, list | tuple):
        return [plain(x) for x in v]
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return v


def summary(tl: Timeline, name: str = "trace") -> dict:
    return plain({
        "programs": {pid: _program(tl, p) for pid, p in tl.programs.items()},
        "nodes": {nid: _node(n) for nid, n in tl.nodes.items()},
        "cache": tl.cache,
        "node_steps": tl.node_steps(),
        "instruction_steps": tl.instruction_steps(),
        "forks": tl.fork_children(),
        "rows": [_row(r) for r in ReplaySession(tl, name).rows()],
    })


def _program(tl: Timeline, p) -> dict:
    return {"function": p.function, "parent": p.parent, "priority": p.priority,
            "status": p.status, "error": p.error, "nodes": p.nodes, "children": p.children,
            "model": p.model, "call": p.call, "text": tl.program_text(p.id)}


def _node(n) -> dict:
    return {"kind": n.kind, "name": n.name, "label": n.label, "line": n.line,
            "status": n.status, "preds": n.preds, "text": n.text, "value": n.value,
            "stack": n.stack, "params": n.params, "error": n.error,
            "tokens": [[t.token, t.text, t.logprob, t.forced, t.seq, t.top, t.allowed]
                       for t in n.tokens],
            "instructions": [_instruction(i) for i in n.instructions]}


def _instruction(i) -> dict:
    return {"kind": i.kind, "index": i.index, "request": i.request, "status": i.status,
            "attrs": i.attrs, "marks": [m.kind for m in i.marks]}


def _row(r) -> list:
    return [r.number, r.kind, r.name, r.label, r.line, r.status, r.depth, r.branch,
            r.instructions, r.tokens, r.error]


def dumps(s: dict) -> str:
    return json.dumps(s, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
