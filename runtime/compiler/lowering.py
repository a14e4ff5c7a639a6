"""Lowering: a Node to the Instructions it runs as (runtime/compiler/instructions.py)."""

from __future__ import annotations

from sgl_nb.runtime.compiler.instructions import (
    Decode,
    Extend,
    Fork,
    Init,
    Instruction,
    Join,
    Return,
    Score,
)
from sgl_nb.runtime.compiler.ir import (
    ForkNode,
    GenNode,
    InitNode,
    JoinNode,
    Node,
    ReturnNode,
    RoleNode,
    SelectNode,
    TextNode,
)

UNCONDITIONAL = "unconditional_likelihood_normalized"


def lower(node: Node) -> list[Instruction]:
    """The Instructions of `node`, numbered within it. VarScope has none: it only marks
    where a variable's text starts and ends."""
    out = _instructions(node)
    for i, ins in enumerate(out):
        ins.index = i
    return out


def _instructions(node: Node) -> list[Instruction]:
    p, n = node.program, node.id
    match node:
        case TextNode():
            return [Extend(p, n, text=node.text)]
        case RoleNode():  # its text is the chat template's, known when it runs
            return [Extend(p, n, text=node.text or "")]
        case GenNode():
            return [Decode(p, n, name=node.name, params=dict(node.sampling))]
        case SelectNode():
            return _select(node)
        case ForkNode():
            # The branches start from the text so far: computed once, before they start.
            shared: list[Instruction] = [Extend(p, n, shared=True)] if node.shared_prefix else []
            return [*shared, Fork(p, n, n=node.n)]
        case JoinNode():
            return [Join(p, n, mode=node.mode, branches=tuple(node.branches))]
        case InitNode():  # the program's own: no Node in the views
            out: list[Instruction] = [Init(p, None, function=node.function, after=node.after)]
            if node.shared_prefix:  # a run_batch's prefix, computed by its first item
                out.append(Extend(p, None, text=node.shared_prefix, shared=True))
            return out
        case ReturnNode():
            return [Return(p, None)]
    return []


def _select(node: SelectNode) -> list[Instruction]:
    p, n = node.program, node.id
    if node.decided is not None:  # a pass fixed the choice: no Score runs
        return [Extend(p, n, text=node.decided, name=node.name)]
    # Choices the gen's grammar ruled out are never scored.
    scored = [(k, node.choices[k]) for k in node.scored()]
    scores: list[Instruction] = [Score(p, n, name=node.name, choice=c, choice_index=k)
                                 for k, c in scored]
    if node.method == UNCONDITIONAL:
        scores += [Score(p, n, name=node.name, choice=c, choice_index=k, unconditional=True)
                   for k, c in scored]
    return scores
