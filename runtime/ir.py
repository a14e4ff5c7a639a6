"""The program graph: Nodes (what the program said) and the Instructions they lower to."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

NODE_KINDS = (
    "Text", "RoleBegin", "RoleEnd", "Gen", "Select", "Fork", "Join", "VarScope", "Return",
)
INSTRUCTION_KINDS = ("Init", "Extend", "Decode", "Score", "Fork", "Join", "Return")
_node_ids = itertools.count(1)


@dataclass
class Node:
    kind: str
    program: int  # id of the program state the node belongs to
    preds: list[int] = field(default_factory=list)
    name: str | None = None  # variable a Gen / Select / VarScope binds
    detail: dict = field(default_factory=dict)  # text, role, choices, sampling params, ...
    file: str | None = None  # where the program said it (a cell or a .py file) ...
    line: int | None = None  # ... and on which line
    status: str = "pending"  # pending -> running -> done | error | skipped
    stack: tuple[str, ...] = ()  # the program's call stack when it was added (outermost first)
    id: int = field(default_factory=lambda: next(_node_ids))

    def __post_init__(self) -> None:
        assert self.kind in NODE_KINDS, self.kind

    def label(self) -> str:
        d = self.detail
        if self.kind == "Text":
            return f"Text {_short(d.get('text', ''))}"
        if self.kind in ("RoleBegin", "RoleEnd"):
            return f"{self.kind} {d.get('role')}"
        if self.kind == "Select":
            return f"Select {self.name} choices={d.get('choices')}"
        if self.kind == "Fork":
            return f"Fork n={d.get('n')}"
        if self.kind == "Join":
            return f"Join mode={d.get('mode')}"
        return f"{self.kind} {self.name or ''}".rstrip()


@dataclass
class Instruction:
    kind: str
    node: int  # the Node it came from (0 for a program's Init / Return)
    args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.kind in INSTRUCTION_KINDS, self.kind

    def __str__(self) -> str:
        args = " ".join(f"{k}={_short(v)}" for k, v in self.args.items())
        return f"{self.kind:<7} node={self.node:<5} {args}".rstrip()


def lower(node: Node) -> list[Instruction]:
    """The Instructions a Node runs as. Text and role markers become Extends (computed
    lazily, as part of the prefill of the next Decode or Score)."""
    d = node.detail
    if node.kind in ("Text", "RoleBegin", "RoleEnd"):
        return [Instruction("Extend", node.id, {"text": d.get("text", "")})]
    if node.kind == "Gen":
        params = {k: v for k, v in d.items() if k != "text"}
        return [Instruction("Decode", node.id, {"name": node.name, **params})]
    if node.kind == "Select":
        return [Instruction("Score", node.id, {"name": node.name, "choices": d["choices"]})]
    if node.kind == "Fork":
        return [Instruction("Fork", node.id, {"n": d["n"]})]
    if node.kind == "Join":
        return [Instruction("Join", node.id, {"mode": d["mode"]})]
    if node.kind == "Return":
        return [Instruction("Return", node.id)]
    return []  # VarScope only marks where a variable's text starts and ends


def listing(nodes: list[Node], program: int | None = None) -> str:
    """A printable program: one line per Node, its Instructions indented under it; with
    `program`, opened by the program's Init Instruction."""
    lines = [] if program is None else [f"      {Instruction('Init', 0, {'program': program})}"]
    for n in nodes:
        where = f"line {n.line}" if n.line else ""
        lines.append(f"#{n.id:<4} {n.label():<48} {where:<9} [{n.status}]")
        lines.extend(f"      {ins}" for ins in lower(n))
    return "\n".join(lines)


def dot(name: str, nodes: list[Node]) -> str:
    """Graphviz DOT: one box per Node, edges from its predecessors."""
    lines = [f'digraph "{name}" {{', "  node [shape=box, fontname=monospace];"]
    for n in nodes:
        label = n.label().replace('"', r"\"")
        lines.append(f'  n{n.id} [label="{label}"];')
        lines.extend(f"  n{p} -> n{n.id};" for p in n.preds)
    return "\n".join([*lines, "}"])


def _short(v, n: int = 40) -> str:
    s = repr(v) if isinstance(v, str) else str(v)
    return s if len(s) <= n else s[: n - 3] + "..."
