"""A run as plain data: its program, each Node with what it produced, its tokens and its
figures, and its fork branches as programs of their own. Built from a live ProgramState's
snapshot (`record_of_state`) or from a trace (`record_of_timeline`), so re-running
(sgl_nb/language/rerun.py) and comparing (sgl_nb/language/diff.py) read one form."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sgl_nb.language.snapshot import ProgramSnapshot
from sgl_nb.runtime.compiler.ir import PROGRAM_NODES, ForkNode, NodeKind, TextNode
from sgl_nb.runtime.status import Status
from sgl_nb.tracing.timeline import NodeView, Timeline

# The figures of a Node's engine requests that a record keeps (summed over its requests,
# but finish_reason: the last one's).
USAGE_KEYS = ("input_tokens", "cached_tokens", "new_tokens", "output_tokens")


@dataclass
class NodeRecord:
    kind: NodeKind
    name: str | None
    line: int | None
    label: str
    params: dict  # a Gen's sampling parameters, a Select's choices and method
    status: Status  # DONE | ERROR | SKIPPED | CANCELLED | PENDING (held before it)
    text: str  # what it added to the program's text (a Text's, a Gen's output, a choice)
    id: int | None = None  # its Node id in that run
    file: str | None = None
    stack: tuple[str, ...] = ()
    usage: dict = field(default_factory=dict)  # USAGE_KEYS, finish_reason, replayed, ...
    tokens: list = field(default_factory=list)  # a Gen's TokenChoices, when recorded
    seconds: float | None = None
    branches: list[ProgramRecord] = field(default_factory=list)  # a Fork's, in order

    def same_step(self, kind: NodeKind, name: str | None, label: str, params: dict,
                  text: str | None) -> bool:
        """Is a Node of a new run the same step as this one (its output may differ)?"""
        if (kind, name) != (self.kind, self.name):
            return False
        if kind in (NodeKind.GEN, NodeKind.SELECT):
            return _canonical(params) == _canonical(self.params)
        if kind is NodeKind.TEXT:
            return text == self.text
        return label == self.label  # a role's, a fork's n, a join's mode


@dataclass
class ProgramRecord:
    function: str | None
    status: Status
    text: str
    nodes: list[NodeRecord]
    id: int | None = None  # its program (state) id in that run
    error: str | None = None
    call: dict = field(default_factory=dict)  # module, qualname, args (JSON), options (JSON)
    source: str = "state"  # "state" or the trace file it was read from

    def walk(self):
        """(path, index, node) for every Node, branches included: `path` is the (node
        index, branch index) steps from this program to the node's own program, `index` its
        place there."""
        yield from _walk(self, ())

    def find(self, path: tuple) -> ProgramRecord:
        """The program (this one or a branch) a path from walk() leads to."""
        p = self
        for i, b in path:
            p = p.nodes[i].branches[b]
        return p


def _walk(p: ProgramRecord, path: tuple):
    for i, n in enumerate(p.nodes):
        yield path, i, n
        for b, child in enumerate(n.branches):
            yield from _walk(child, (*path, (i, b)))


def _canonical(params: dict) -> str:
    return json.dumps(params, default=repr, sort_keys=True)


# ---- from a live state --------------------------------------------------------------------

def record_of_state(state) -> ProgramRecord:
    """The record of a ProgramState as it is now (finished, failed, cancelled or held)."""
    return record_of_snapshot(state.snapshot())


def record_of_snapshot(snap: ProgramSnapshot) -> ProgramRecord:
    nodes = [_node_of_snapshot(snap, n) for n in snap.own_nodes() if n.kind not in PROGRAM_NODES]
    return ProgramRecord(snap.function, snap.status, snap.text, nodes, snap.id,
                         repr(snap.error) if snap.error else None, dict(snap.call))


def _node_of_snapshot(snap: ProgramSnapshot, node) -> NodeRecord:
    seconds = None
    if node.start_ns is not None and node.end_ns is not None:
        seconds = (node.end_ns - node.start_ns) / 1e9
    rec = NodeRecord(node.kind, node.name, node.line, node.label(), node.params(),
                     node.status, node.output if node.output is not None else "",
                     node.id, node.file, tuple(node.stack),
                     _usage([ins.usage for ins in node.instructions if ins.usage]),
                     list(snap.tokens.get(node.id, ())), seconds)
    if isinstance(node, TextNode):
        rec.text = node.text  # what it adds even if it has not run
    if isinstance(node, ForkNode):
        rec.branches = [record_of_snapshot(c) for c in snap.forks.get(node.id, ())]
    return rec


def _usage(reports: list[dict]) -> dict:
    out: dict = {}
    for u in reports:
        for k in USAGE_KEYS:
            if u.get(k) is not None:
                out[k] = out.get(k, 0) + u[k]
        for k in ("finish_reason", "replayed", "edited"):
            if u.get(k) is not None:
                out[k] = u[k]
    return out


# ---- from a trace -------------------------------------------------------------------------

def record_of_timeline(tl: Timeline, program: int | None = None,
                       source: str = "trace") -> ProgramRecord:
    """The record of one program of a trace (default: its only top-level program)."""
    pid = _root_program(tl, program)
    return _program_of_timeline(tl, pid, source, tl.fork_children())


def _root_program(tl: Timeline, program: int | None) -> int:
    roots = [p.id for p in tl.programs.values() if p.parent is None]
    if program is not None:
        if program not in tl.programs:
            raise KeyError(f"no program {program} in this trace; it has {sorted(tl.programs)}")
        return program
    if len(roots) != 1:
        names = ", ".join(f"{p} ({tl.programs[p].function})" for p in roots) or "none"
        raise ValueError(f"this trace holds {len(roots)} top-level programs ({names}): "
                         "say which with program=ID")
    return roots[0]


def _program_of_timeline(tl: Timeline, pid: int, source: str, forks: dict) -> ProgramRecord:
    p = tl.programs[pid]
    nodes = []
    for nid in p.nodes:
        n = tl.nodes[nid]
        if n.kind is None or n.kind in PROGRAM_NODES:
            continue
        rec = _node_of_view(n)
        rec.branches = [_program_of_timeline(tl, c, source, forks) for c in forks.get(nid, ())
                        if c in tl.programs]
        nodes.append(rec)
    return ProgramRecord(p.function, p.status, tl.program_text(pid), nodes, pid, p.error,
                         dict(p.call), source)


def _node_of_view(n: NodeView) -> NodeRecord:
    seconds = None
    if n.start_ns is not None and n.end_ns is not None:
        seconds = (n.end_ns - n.start_ns) / 1e9
    text = n.text if n.text is not None else "".join(t.text for t in n.tokens)
    return NodeRecord(n.kind, n.name, n.line, n.label or n.kind, dict(n.params), n.status,
                      text, n.id, n.file, tuple(n.stack),
                      _usage([i.attrs for i in n.instructions]),
                      [t.choice() for t in n.tokens], seconds)
