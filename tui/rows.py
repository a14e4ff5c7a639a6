"""What the debugger shows about Nodes, the same for a live run and a replay: where the
program stands (Position) and one row per Node, started or still to come (NodeRow)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.runtime.compiler.step_controller import Breakpoint
from sgl_nb.runtime.status import Status
from sgl_nb.tracing.timeline import InstructionView, NodeView, Timeline


class Where(StrEnum):
    START = "start"  # nothing known yet (live, before the first event)
    RUNNING = "running"  # the program runs (live)
    NODE = "node"  # held before `node` starts
    INSTRUCTION = "instruction"  # (replay) before one of `node`'s Instructions starts
    DECODE = "decode"  # held inside a Gen or Select, before its next token
    DONE = "done"  # the program has finished ...
    ERROR = "error"
    CANCELLED = "cancelled"
    END = "end"  # (a replay's last stop) after every event

    @classmethod
    def of(cls, status: Status) -> Where:
        """Where a program that has ended stands."""
        return cls(status.value)


_FINISHED = frozenset({Where.DONE, Where.ERROR, Where.CANCELLED})


@dataclass(frozen=True)
class Position:
    where: Where
    node: int | None = None

    @property
    def finished(self) -> bool:
        return self.where in _FINISHED


@dataclass
class NodeRow:
    id: int
    program: int | None
    kind: NodeKind | None
    name: str | None
    label: str
    line: int | None
    file: str | None
    status: Status
    depth: int = 0  # fork branches are indented under their parent
    branch: int | None = None  # its place among its Fork's branches (0 first), if in one
    preds: list[int] = field(default_factory=list)
    instructions: list[str] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    number: int = 0  # 1-based place in the list: raw ids are process-wide counters

    def breakpoint(self) -> Breakpoint:
        """A breakpoint that stops before this Node (and any Node like it on its line)."""
        return Breakpoint(name=self.name, kind=self.kind, line=self.line)


def started_rows(tl: Timeline) -> list[NodeRow]:
    """One row per Node the timeline knows (started, or queued: its Instructions pending),
    in program order (`ordered_rows`)."""
    return ordered_rows([_row(n, tl) for n in tl.nodes.values()], tl.fork_children())


def ordered_rows(rows: list[NodeRow], forks: dict[int, list[int]]) -> list[NodeRow]:
    """The rows in program order: each program's rows in the order given, and right after
    a Fork's row its branches' rows, branch 0's wholly before branch 1's (not interleaved
    as they started: the branches run side by side), nested one level deeper. `forks` maps
    a Fork Node id to its branches' program ids (`Timeline.fork_children`). Rows of a
    program no Fork here names keep their place at the top level."""
    by_program: dict[int | None, list[NodeRow]] = {}
    for r in rows:
        by_program.setdefault(r.program, []).append(r)
    branches = {cid for children in forks.values() for cid in children}
    out: list[NodeRow] = []
    walked: set[int | None] = set()

    def walk(pid: int | None, depth: int, branch: int | None) -> None:
        walked.add(pid)
        for r in by_program.get(pid, ()):
            r.depth, r.branch = depth, branch
            out.append(r)
            for i, cid in enumerate(forks.get(r.id, ()) if r.kind is NodeKind.FORK else ()):
                if cid not in walked:
                    walk(cid, depth + 1, i)

    for pid in by_program:
        if pid not in walked and pid not in branches:
            walk(pid, 0, None)
    # A branch whose Fork has no row (not expected): after the rest, as it was.
    out += [r for pid, rs in by_program.items() if pid not in walked for r in rs]
    return out


def pending_row(n: NodeView, tl: Timeline) -> NodeRow:
    """A Node known from a full replay timeline that has not started at the cursor."""
    row = _row(n, tl)
    row.status, row.tokens, row.error = Status.PENDING, 0, None
    row.instructions = [f"{ins.kind.value}[{ins.index}] pending" for ins in n.instructions]
    return row


def number_rows(rows: list[NodeRow]) -> list[NodeRow]:
    for i, r in enumerate(rows, 1):
        r.number = i
    return rows


def _row(n: NodeView, tl: Timeline) -> NodeRow:
    kind = n.kind.value if n.kind is not None else "?"
    return NodeRow(
        id=n.id, program=n.program, kind=n.kind, name=n.name,
        label=n.label or f"{kind} {n.name or ''}".rstrip(), line=n.line, file=n.file,
        status=n.status, depth=program_depth(tl, n.program), preds=list(n.preds),
        instructions=([describe_instruction(i) for i in n.instructions] if n.start_ns is not None
                      else [f"{op.value}[{k}] pending" for k, op in enumerate(n.ops)]),
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
    parts = [f"{ins.kind.value}[{ins.index}] {ins.status.value}"]
    parts += [f"{short}={ins.attrs[k]}" for k, short in _ATTRS if ins.attrs.get(k) is not None]
    marks: dict[str, int] = {}
    for e in ins.marks:
        marks[e.kind.value] = marks.get(e.kind.value, 0) + 1
    parts += [f"{k}×{v}" for k, v in marks.items()]
    return " ".join(parts)
