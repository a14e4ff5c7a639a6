"""The program graph: Nodes, what the program said, one dataclass per kind
(runtime/compiler/lowering.py turns each into the Instructions it runs as;
runtime/compiler/listing.py prints both)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from sgl_nb.runtime.compiler.instructions import Extend, short
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
_NODE = {"eq": False, "kw_only": True}  # a Node is itself: compared by identity


@dataclass(**_NODE)
class Node:
    kind: ClassVar[NodeKind]
    program: int  # id of the program state the node belongs to
    preds: list[int] = field(default_factory=list)
    name: str | None = None  # the variable a Gen / Select / VarScope binds
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

    def label(self) -> str:
        return f"{self.kind.value} {self.name or ''}".rstrip()

    def params(self) -> dict[str, Any]:
        """What a Gen or Select was asked for (its sampling parameters; its choices and
        method): two runs' Nodes with the same kind, name and params are the same step."""
        return {}


@dataclass(**_NODE)
class InitNode(Node):
    """A program's start (the executor runs its Init Instruction, which says
    program_started)."""

    kind: ClassVar[NodeKind] = NodeKind.INIT
    function: str = ""
    # This program also computes this text for the others of its batch (a shared Extend).
    shared_prefix: str = ""
    after: Extend | None = None  # such an Extend of another program, to start after
    # Where its function is and what it was called with, for a re-run (ProgramCall.attrs).
    call: dict[str, str | None] = field(default_factory=dict)


@dataclass(**_NODE)
class TextNode(Node):
    kind: ClassVar[NodeKind] = NodeKind.TEXT
    text: str = ""
    fused: int = 1  # the Text Nodes the fuse_text pass joined into this one

    def label(self) -> str:
        return f"Text {short(self.text)}"


@dataclass(**_NODE)
class RoleNode(Node):
    """Where a chat turn begins or ends: its text is the chat template's, known once it
    runs (or traced with a template)."""

    role: str = ""
    text: str | None = None

    def label(self) -> str:
        return f"{self.kind.value} {self.role}"


@dataclass(**_NODE)
class RoleBeginNode(RoleNode):
    kind: ClassVar[NodeKind] = NodeKind.ROLE_BEGIN


@dataclass(**_NODE)
class RoleEndNode(RoleNode):
    kind: ClassVar[NodeKind] = NodeKind.ROLE_END


@dataclass(**_NODE)
class GenNode(Node):
    kind: ClassVar[NodeKind] = NodeKind.GEN
    sampling: dict[str, Any] = field(default_factory=dict)  # the request's sampling params

    def params(self) -> dict[str, Any]:
        return dict(self.sampling)


@dataclass(**_NODE)
class SelectNode(Node):
    kind: ClassVar[NodeKind] = NodeKind.SELECT
    choices: list[str] = field(default_factory=list)
    method: str | None = None  # the scoring method's name
    allowed: list[int] | None = None  # the choices the gen's grammar leaves (None: all)
    # A pass decided it at compile time (runtime/compiler/passes.py): its choice and why
    # ("static": one choice; "grammar": one the grammar allows).
    decided: str | None = None
    resolved: str | None = None

    def label(self) -> str:
        return f"Select {self.name} choices={self.choices}"

    def params(self) -> dict[str, Any]:
        return {"choices": list(self.choices), "method": self.method}

    def scored(self) -> list[int]:
        """The indexes of the choices to score, in choice order."""
        return list(self.allowed) if self.allowed is not None else list(range(len(self.choices)))


@dataclass(**_NODE)
class ForkNode(Node):
    kind: ClassVar[NodeKind] = NodeKind.FORK
    n: int = 1
    shared_prefix: bool = False  # the branches' common text is computed once, before them

    def label(self) -> str:
        return f"Fork n={self.n}"


@dataclass(**_NODE)
class JoinNode(Node):
    kind: ClassVar[NodeKind] = NodeKind.JOIN
    mode: str = "gather_variable"
    branches: tuple[int, ...] = ()  # the fork branches' program ids it waits for

    def label(self) -> str:
        return f"Join mode={self.mode}"


@dataclass(**_NODE)
class VarScopeNode(Node):
    """Where `with s.var_scope(name):` starts or ends: no Instruction."""

    kind: ClassVar[NodeKind] = NodeKind.VAR_SCOPE
    begin: bool = True


@dataclass(**_NODE)
class ReturnNode(Node):
    """A program's end: what its body raised, and in which file, end it."""

    kind: ClassVar[NodeKind] = NodeKind.RETURN


TEXT_NODES = (TextNode, RoleNode)  # what only adds text, known without the model


def dot(name: str, nodes: list[Node]) -> str:
    """Graphviz DOT: one box per Node, edges from its predecessors."""
    lines = [f'digraph "{name}" {{', "  node [shape=box, fontname=monospace];"]
    init = next((n for n in nodes if isinstance(n, InitNode)), None)
    for n in nodes:
        label = n.label().replace('"', r"\"")
        shape = ", shape=oval" if n.kind in PROGRAM_NODES else ""
        lines.append(f'  n{n.id} [label="{label}"{shape}];')
        preds = n.preds or ([init.id] if init is not None and n is not init else [])
        lines.extend(f"  n{p} -> n{n.id};" for p in preds)
    return "\n".join([*lines, "}"])
