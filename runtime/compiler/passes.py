"""Compiler passes over a program's Nodes. Each returns what it changed, so tests and the
debugger can say which pass did what; none changes the program's output."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_nb.runtime.compiler.ir import TEXT_NODES, ForkNode, Node, SelectNode, TextNode

ALL_PASSES = ("fuse_text", "static_select", "shared_prefix")


@dataclass
class PassReport:
    name: str
    changed: int  # nodes merged / selects resolved / programs sharing a prefix
    detail: str = ""


def check_passes(passes) -> frozenset[str]:
    chosen = frozenset(ALL_PASSES if passes is None else passes)
    unknown = chosen - set(ALL_PASSES)
    if unknown:
        raise ValueError(f"unknown passes {sorted(unknown)}; available: {ALL_PASSES}")
    return chosen


def run_passes(nodes: list[Node], chosen: frozenset[str]) -> tuple[list[Node], list[PassReport]]:
    """The passes stage: the chosen passes, in order, over the Nodes a program recorded
    since its last flush (sgl_nb/language/state.py); what they return is what gets lowered."""
    reports = []
    if "fuse_text" in chosen:
        nodes, report = fuse_text(nodes)
        reports.append(report)
    if "static_select" in chosen:
        reports.append(decide_selects(nodes))
    if "shared_prefix" in chosen:
        reports.append(share_fork_prefixes(nodes))
    return nodes, reports


def fuse_text(nodes: list[Node]) -> tuple[list[Node], PassReport]:
    """Adjacent Text nodes of one program become one (one Extend instead of several)."""
    out: list[Node] = []
    merged = 0
    renamed: dict[int, int] = {}  # a fused Node's id -> the Node it went into
    for n in nodes:
        n.preds = [renamed.get(p, p) for p in n.preds]
        prev = out[-1] if out else None
        if (isinstance(n, TextNode) and isinstance(prev, TextNode)
                and prev.program == n.program and n.preds == [prev.id]):
            prev.text += n.text
            prev.fused += 1
            renamed[n.id] = prev.id
            merged += 1
            continue
        out.append(n)
    return out, PassReport("fuse_text", merged)


def fixed_choice(node: Node) -> tuple[str, str] | None:
    """A select's answer when it is known without the model, and why: one choice ("static",
    repeats counted once), or one the gen's grammar (regex=, dtype=) leaves ("grammar")."""
    if not isinstance(node, SelectNode):
        return None
    choices = node.choices
    if len(set(choices)) == 1:
        return choices[0], "static"
    left = {choices[i] for i in node.scored()}
    return (left.pop(), "grammar") if len(left) == 1 else None


def decide_selects(nodes: list[Node]) -> PassReport:
    """Selects decided at compile time: they lower to an Extend of their choice, no Score."""
    why: dict[str, int] = {}
    for node in nodes:
        fixed = fixed_choice(node)
        if fixed is not None:
            node.decided, node.resolved = fixed
            why[fixed[1]] = why.get(fixed[1], 0) + 1
    detail = ", ".join(f"{n} {reason}" for reason, n in sorted(why.items()))
    return PassReport("static_select", sum(why.values()), detail)


def share_fork_prefixes(nodes: list[Node]) -> PassReport:
    """A fork into several branches: the text they all start from is computed once, as one
    shared Extend before the Fork, instead of by each branch's first request."""
    n = 0
    for node in nodes:
        if isinstance(node, ForkNode) and node.n > 1:
            node.shared_prefix = True
            n += 1
    return PassReport("shared_prefix", n, f"{n} forks")


def leading_text(nodes: list[Node]) -> str:
    """The text a program starts with before anything depends on the model."""
    text = []
    for n in nodes:
        if not isinstance(n, TEXT_NODES) or n.text is None:
            break
        text.append(n.text)
    return "".join(text)


def shared_prefix(prefixes: list[str]) -> tuple[str, PassReport]:
    """The longest start every program of a batch shares: the first program computes it
    (one shared Extend after its Init), the others' Init waits for that."""
    if len(prefixes) < 2:
        return "", PassReport("shared_prefix", 0)
    first, n = prefixes[0], min(len(p) for p in prefixes)
    i = 0
    while i < n and all(p[i] == first[i] for p in prefixes):
        i += 1
    common = first[:i]
    return common, PassReport("shared_prefix", len(prefixes) if common else 0,
                              f"{len(common)} characters")
