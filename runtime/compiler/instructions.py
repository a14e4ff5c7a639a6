"""Instructions: what a program's Nodes lower to and what the executor runs, one kind each.

A program runs as Init, then each Node's Instructions in order, then Return. Text and role
markers are Extends (their tokens are computed as the prefill of the next Decode or Score,
or hoisted by a pass); a Gen is one Decode (one engine request: its prefill, then a token a
step); a Select is one Score per choice (and per choice again, unconditioned, for
`unconditional_likelihood_normalized`), submitted together. The step controller steps
these, the events name them, the listings print them: one source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from sgl_nb.runtime.status import Status


class Op(StrEnum):
    INIT = "Init"
    EXTEND = "Extend"
    DECODE = "Decode"
    SCORE = "Score"
    FORK = "Fork"
    JOIN = "Join"
    RETURN = "Return"


class Cancelled(Exception):  # noqa: N818 - the name the language layer's error extends
    """An Instruction (and its program) was cancelled; what it produced is kept."""


@dataclass(eq=False)
class Instruction:
    op: ClassVar[Op]
    program: int
    node: int | None  # the Node it came from (None for Init)
    index: int = 0  # its place among its Node's Instructions
    status: Status = Status.PENDING  # -> RUNNING -> DONE | ERROR | CANCELLED | SKIPPED
    request: int | None = None  # the engine request that runs it (Decode, Score)
    usage: dict | None = None  # what its instruction_finished event reported

    @property
    def kind(self) -> Op:
        """Its op (the name the Timeline's InstructionView and the events use)."""
        return self.op

    @property
    def on_engine(self) -> bool:
        """Whether it runs as an engine request (or a server's): Decode, Score, a shared
        Extend."""
        return self.op in (Op.DECODE, Op.SCORE)

    def args(self) -> dict[str, Any]:
        return {}

    def __str__(self) -> str:
        args = " ".join(f"{k}={short(v)}" for k, v in self.args().items() if v is not None)
        return f"{self.op.value:<7} node={self.node or 0:<5} {args}".rstrip()


@dataclass(eq=False)
class Extend(Instruction):
    op: ClassVar[Op] = Op.EXTEND
    text: str = ""
    name: str | None = None  # a select decided at compile time binds its choice here
    # The shared_prefix pass: the KV of a prefix several programs start from, computed once
    # as one prefill request that they wait for; it adds no text ("" text: the program's
    # text so far, filled in when it runs).
    shared: bool = False

    @property
    def on_engine(self) -> bool:
        return self.shared

    def args(self) -> dict[str, Any]:
        return {"text": self.text, "name": self.name, "shared": self.shared or None}


@dataclass(eq=False)
class Init(Instruction):
    op: ClassVar[Op] = Op.INIT
    function: str = ""
    after: Extend | None = None  # a run_batch item starts when the batch's prefix is in

    def args(self) -> dict[str, Any]:
        return {"program": self.program, "function": self.function or None}


@dataclass(eq=False)
class Decode(Instruction):
    op: ClassVar[Op] = Op.DECODE
    name: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # the request's sampling params

    def args(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}


@dataclass(eq=False)
class Score(Instruction):
    op: ClassVar[Op] = Op.SCORE
    name: str | None = None
    choice: str = ""
    choice_index: int = 0
    unconditional: bool = False  # scored after a bare start token, not the program's text

    def args(self) -> dict[str, Any]:
        return {"name": self.name, "choice": self.choice,
                "unconditional": self.unconditional or None}


@dataclass(eq=False)
class Fork(Instruction):
    op: ClassVar[Op] = Op.FORK
    n: int = 1

    def args(self) -> dict[str, Any]:
        return {"n": self.n}


@dataclass(eq=False)
class Join(Instruction):
    op: ClassVar[Op] = Op.JOIN
    mode: str = "gather_variable"
    branches: tuple[int, ...] = ()  # the fork branches' program ids it waits for

    def args(self) -> dict[str, Any]:
        return {"mode": self.mode}


@dataclass(eq=False)
class Return(Instruction):
    op: ClassVar[Op] = Op.RETURN


def short(v, n: int = 40) -> str:
    """A value as a listing shows it: a string quoted, at most n characters."""
    s = repr(v) if isinstance(v, str) else str(v)
    return s if len(s) <= n else s[: n - 3] + "..."
