"""The program graph: Nodes, what the program said (runtime/compiler/lowering.py turns each into the
Instructions it runs as; runtime/compiler/listing.py prints both)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import StrEnum

from sgl_nb.runtime.status import Status


class NodeKind(StrEnum):
    INIT = "Init"
    TEXT = "Text"
    ROLE_BEGIN = "RoleBegin"
    ROLE_END = "RoleEnd"
    GEN = "Gen"
    SELECT = "Select"
    FORK = "Fork"
    JOIN = "Join"
    VAR_SCOPE = "VarScope"
    RETURN = "Return"


# A program's own Nodes, its first and its last: the views show them as the program's span,
# not as steps of their own.
PROGRAM_NODES = frozenset({NodeKind.INIT, NodeKind.RETURN})
_node_ids = itertools.count(1)


@dataclass
class Node:
    kind: NodeKind
    program: int  # id of the program state the node belongs to
    preds: list[int] = field(default_factory=list)
    name: str | None = None  # variable a Gen / Select / VarScope binds
    detail: dict = field(default_factory=dict)  # text, role, choices, sampling params, ...
    file: str | None = None  # where the program said it (a cell or a .py file) ...
    line: int | None = None  # ... and on which line
    status: Status = Status.PENDING  # -> RUNNING -> DONE | ERROR | SKIPPED | CANCELLED
    stack: tuple[str, ...] = ()  # the program's call stack when it was added (outermost first)
    id: int = field(default_factory=lambda: next(_node_ids))
    # What it lowered to, once queued to run (runtime/compiler/lowering.py): what the executor runs.
    instructions: list = field(default_factory=list, repr=False)
    # Once it ran: what it added to the program's text, and when (time.monotonic_ns).
    output: str | None = field(default=None, repr=False)
    start_ns: int | None = field(default=None, repr=False)
    end_ns: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.kind = NodeKind(self.kind)

    def label(self) -> str:
        d = self.detail
        if self.kind is NodeKind.TEXT:
            return f"Text {_short(d.get('text', ''))}"
        if self.kind in (NodeKind.ROLE_BEGIN, NodeKind.ROLE_END):
            return f"{self.kind} {d.get('role')}"
        if self.kind is NodeKind.SELECT:
            return f"Select {self.name} choices={d.get('choices')}"
        if self.kind is NodeKind.FORK:
            return f"Fork n={d.get('n')}"
        if self.kind is NodeKind.JOIN:
            return f"Join mode={d.get('mode')}"
        return f"{self.kind} {self.name or ''}".rstrip()


def node_params(node: Node) -> dict:
    """What a Gen or Select was asked for (its sampling parameters; its choices and
    method): two runs' Nodes with the same kind, name and params are the same step."""
    d = node.detail
    if node.kind is NodeKind.SELECT:
        return {"choices": list(d.get("choices", ())), "method": d.get("method")}
    if node.kind is NodeKind.GEN:
        return {k: v for k, v in d.items() if k not in ("decided", "resolved", "text")}
    return {}


def dot(name: str, nodes: list[Node]) -> str:
    """Graphviz DOT: one box per Node, edges from its predecessors."""
    lines = [f'digraph "{name}" {{', "  node [shape=box, fontname=monospace];"]
    init = next((n for n in nodes if n.kind is NodeKind.INIT), None)
    for n in nodes:
        label = n.label().replace('"', r"\"")
        shape = ", shape=oval" if n.kind in PROGRAM_NODES else ""
        lines.append(f'  n{n.id} [label="{label}"{shape}];')
        preds = n.preds or ([init.id] if init is not None and n is not init else [])
        lines.extend(f"  n{p} -> n{n.id};" for p in preds)
    return "\n".join([*lines, "}"])


def _short(v, n: int = 40) -> str:
    s = repr(v) if isinstance(v, str) else str(v)
    return s if len(s) <= n else s[: n - 3] + "..."
