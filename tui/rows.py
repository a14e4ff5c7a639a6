"""What the debugger shows about Nodes, the same for a live run and a replay: where the
program stands (Position) and one row per Node, started or still to come (NodeRow)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_nb.runtime.compiler.step_controller import Breakpoint
from sgl_nb.tracing.timeline import InstructionView, NodeView, Timeline

# Position.where:
#   "node"         held before `node` starts
#   "instruction"  (replay) before one of `node`'s Instructions starts
#   "decode"       held inside a Gen or Select, before its next token
#   "running"      the program runs (live)
#   "done" / "error" / "cancelled"  the program has finished
#   "start"        nothing known yet (live, before the first event)


@dataclass(frozen=True)
class Position:
    where: str
    node: int | None = None

    @property
    def finished(self) -> bool:
        return self.where in ("done", "error", "cancelled")


@dataclass
class NodeRow:
    id: int
    program: int | None
    kind: str
    name: str | None
    label: str
    line: int | None
    file: str | None
    status: str  # pending | running | done | error | skipped | cancelled
    depth: int = 0  # fork branches are indented under their parent
    preds: list[int] = field(default_factory=list)
    instructions: list[str] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    number: int = 0  # 1-based place in the list: raw ids are process-wide counters

    def breakpoint(self) -> Breakpoint:
        """A breakpoint that stops before this Node (and any Node like it on its line)."""
        return Breakpoint(name=self.name, kind=self.kind, line=self.line)


def started_rows(tl: Timeline) -> list[NodeRow]:
    """One row per Node the timeline saw start, in start order."""
    return [_row(n, tl) for n in tl.nodes.values()]


def pending_row(n: NodeView, tl: Timeline) -> NodeRow:
    """A Node known from a full replay timeline that has not started at the cursor."""
    row = _row(n, tl)
    row.status, row.tokens, row.error = "pending", 0, None
    row.instructions = [f"{ins.kind}[{ins.index}] pending" for ins in n.instructions]
    return row


def number_rows(rows: list[NodeRow]) -> list[NodeRow]:
    for i, r in enumerate(rows, 1):
        r.number = i
    return rows


def _row(n: NodeView, tl: Timeline) -> NodeRow:
    kind = n.kind or "?"
    return NodeRow(
        id=n.id, program=n.program, kind=kind, name=n.name,
        label=n.label or f"{kind} {n.name or ''}".rstrip(), line=n.line, file=n.file,
        status=n.status, depth=program_depth(tl, n.program), preds=list(n.preds),
        instructions=[describe_instruction(i) for i in n.instructions],
        tokens=len(n.tokens), error=n.error,
    )


def program_depth(tl: Timeline, pid: int | None) -> int:
    depth, seen = 0, set()
    p = tl.programs.get(pid) if pid is not None else None
    while p is not None and p.parent is not None and p.id not in seen:
        seen.add(p.id)
        depth += 1
        p = tl.programs.get(p.parent)
    return depth


_ATTRS = (("input_tokens", "in"), ("cached_tokens", "cached"), ("new_tokens", "new"),
          ("output_tokens", "out"), ("batch_size", "batch"), ("finish_reason", "finish"))


def describe_instruction(ins: InstructionView) -> str:
    parts = [f"{ins.kind}[{ins.index}] {ins.status}"]
    parts += [f"{short}={ins.attrs[k]}" for k, short in _ATTRS if ins.attrs.get(k) is not None]
    marks: dict[str, int] = {}
    for kind, _ts, _data in ins.marks:
        marks[kind] = marks.get(kind, 0) + 1
    parts += [f"{k}×{v}" for k, v in marks.items()]
    return " ".join(parts)
