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
from sgl_nb.runtime.compiler.ir import Node, NodeKind

UNCONDITIONAL = "unconditional_likelihood_normalized"


def lower(node: Node) -> list[Instruction]:
    """The Instructions of `node`, numbered within it. VarScope has none: it only marks
    where a variable's text starts and ends."""
    d, p, n = node.detail, node.program, node.id
    if node.kind in (NodeKind.TEXT, NodeKind.ROLE_BEGIN, NodeKind.ROLE_END):
        out: list[Instruction] = [Extend(p, n, text=d.get("text", ""))]
    elif node.kind is NodeKind.GEN:
        out = [Decode(p, n, name=node.name, params={k: v for k, v in d.items() if k != "text"})]
    elif node.kind is NodeKind.SELECT:
        out = _select(node)
    elif node.kind is NodeKind.FORK:
        # The branches start from the text so far: computed once, before they start.
        out = [Extend(p, n, shared=True)] if d.get("shared_prefix") else []
        out.append(Fork(p, n, n=d["n"]))
    elif node.kind is NodeKind.JOIN:
        out = [Join(p, n, mode=d["mode"], branches=tuple(d.get("branches", ())))]
    elif node.kind is NodeKind.INIT:  # the program's own: no Node in the views
        out = [Init(p, None, function=d.get("function", ""), after=d.get("after"))]
        if d.get("shared_prefix"):  # a run_batch's prefix, computed by its first item
            out.append(Extend(p, None, text=d["shared_prefix"], shared=True))
    elif node.kind is NodeKind.RETURN:
        out = [Return(p, None)]
    else:
        out = []
    for i, ins in enumerate(out):
        ins.index = i
    return out


def _select(node: Node) -> list[Instruction]:
    d, p, n = node.detail, node.program, node.id
    if "decided" in d:  # a pass fixed the choice: no Score runs
        return [Extend(p, n, text=d["decided"], name=node.name)]
    # Choices the gen's grammar ruled out are never scored.
    scored = [(k, d["choices"][k]) for k in d.get("allowed", range(len(d["choices"])))]
    scores: list[Instruction] = [Score(p, n, name=node.name, choice=c, choice_index=k)
                                 for k, c in scored]
    if d.get("method") == UNCONDITIONAL:
        scores += [Score(p, n, name=node.name, choice=c, choice_index=k, unconditional=True)
                   for k, c in scored]
    return scores
