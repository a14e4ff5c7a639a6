"""A program as text: one line per Node, the Instructions it ran (or will run) under it."""

from __future__ import annotations

from sgl_nb.runtime.compiler.instructions import Instruction
from sgl_nb.runtime.compiler.ir import PROGRAM_NODES, Node
from sgl_nb.runtime.compiler.lowering import lower
from sgl_nb.runtime.status import Status


def instructions_of(node: Node) -> list[Instruction]:
    """The Instructions the Node was queued with, or (not queued: a traced graph) those it
    lowers to."""
    return node.instructions or lower(node)


def listing(nodes: list[Node]) -> str:
    """The program's own Init and Return print as their Instruction alone."""
    lines = []
    for n in nodes:
        if n.kind not in PROGRAM_NODES:
            where = f"line {n.line}" if n.line else ""
            lines.append(f"#{n.id:<4} {n.label():<48} {where:<9} [{n.status.value}]")
        lines.extend(f"      {ins}" + _status(ins) for ins in instructions_of(n))
    return "\n".join(lines)


def _status(ins: Instruction) -> str:
    return "" if ins.status is Status.PENDING else f"  [{ins.status.value}]"
