"""Why this token: `state.token_info(var, i)`.

The engine records one TokenChoice per generated token (runtime/token_choice.py): the
step's top alternatives, which of them the grammar masked, whether the token was forced.
A finished Gen keeps its request's TokenChoices on its state (`snapshot().tokens`, by Node
id); `token_info` finds the Gen Node behind a variable and puts its token
together with where it came from: the Node, its Instruction, the source line and the
prompt's cache hit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from sgl_nb.language.snapshot import ProgramSnapshot
from sgl_nb.runtime.compiler.instructions import Op
from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.runtime.token_choice import Alternative, TokenChoice


class InstructionRef(NamedTuple):
    kind: Op  # Op.DECODE
    index: int  # its place among its Node's Instructions
    request: int | None  # the engine request that ran it

    def __str__(self) -> str:
        return f"{self.kind.value} #{self.index} (request {self.request})"


@dataclass
class TokenInfo:
    choice: TokenChoice
    variable: str
    index: int  # the token's place in the variable's tokens (0-based, never negative)
    node: int
    label: str  # the Node's label ("Gen answer")
    instruction: InstructionRef | None
    line: int | None
    file: str | None
    cached_tokens: int | None  # of its request's prompt, found in the radix cache
    prompt_tokens: int | None
    branch: int | None = None  # the fork branch it was read from, if any

    @property
    def token(self) -> int:
        return self.choice.token

    @property
    def text(self) -> str:
        return self.choice.text

    @property
    def top(self) -> list[Alternative]:
        return self.choice.top

    @property
    def forced(self) -> bool:
        return self.choice.forced

    @property
    def allowed(self) -> int:
        return self.choice.allowed

    @property
    def masked(self) -> list[Alternative]:
        """The alternatives the grammar ruled out."""
        return [a for a in self.choice.top if a.masked]

    @property
    def prob(self) -> float | None:
        """The chosen token's probability (before the grammar mask, as the alternatives')."""
        lp = self.choice.logprob
        return None if lp is None else math.exp(lp)

    def __str__(self) -> str:
        return "\n".join([*self._header(), *choice_table(self.choice)])

    def _header(self) -> list[str]:
        where = f"line {self.line}" if self.line is not None else "no line"
        if self.file:
            where += f" of {self.file}"
        branch = f" (branch {self.branch})" if self.branch is not None else ""
        cache = ("" if self.prompt_tokens is None
                 else f"; cache hit {self.cached_tokens or 0}/{self.prompt_tokens} prompt tokens")
        c = self.choice
        grammar = ("no grammar" if c.allowed < 0 else
                   f"grammar allowed {c.allowed} token{'s' if c.allowed != 1 else ''}")
        return [f"token {self.index} of {self.variable!r}{branch}: {c.text!r} "
                f"({'forced' if c.forced else 'sampled'}; {grammar})",
                f"  {self.label}, {where}; {self.instruction or 'no instruction'}{cache}"]


def choice_table(c: TokenChoice) -> list[str]:
    rows = [f"  {'rank':>4}  {'token':<20} {'prob':>7}  marks"]
    for rank, a in enumerate(c.top, 1):
        rows.append(_row(rank, a.text, a.logprob, a.masked, a.token == c.token, c.forced))
    if c.rank is None and c.logprob is not None:  # chosen from outside the top k
        rows.append(_row(None, c.text, c.logprob, False, True, c.forced))
    if not c.top:
        rows.append("  (no alternatives recorded)")
    return rows


def _row(rank, text: str, logprob: float, masked: bool, chosen: bool, forced: bool) -> str:
    marks = [m for m, on in (("masked", masked), ("forced", chosen and forced)) if on]
    pointer = ">" if chosen else " "
    shown = repr(text) if len(repr(text)) <= 20 else repr(text)[:17] + "..."
    return (f"{pointer} {'-' if rank is None else rank:>4}  {shown:<20} "
            f"{100 * math.exp(logprob):>6.2f}%  {' '.join(marks)}").rstrip()


# ---- reading ---------------------------------------------------------------------------

def token_info(snap: ProgramSnapshot, var: str, i: int, branch: int | None = None) -> TokenInfo:
    """Why the i-th token (negative: from the end) of variable `var` was chosen. In a
    program that forked, a variable gathered from the branches needs `branch=k`."""
    if branch is not None:
        info = token_info(_branch(snap, var, branch), var, i)
        info.branch = branch
        return info
    if isinstance(snap.vars.get(var), list) and _fork_of(snap, var) is not None:
        n = len(_fork_of(snap, var))
        raise ValueError(f"{var!r} was gathered from {n} fork branches: pass branch=k "
                         f"(0..{n - 1}), e.g. state.token_info({var!r}, {i}, branch=0)")
    node = _node_of(snap, var)
    tokens = snap.tokens.get(node.id)
    if tokens is None:
        raise ValueError(f"{var!r} ({node.label()}) has no recorded tokens: its value was "
                         "not decoded token by token here (read off a speculated answer, "
                         "sent to a server, or recording is off: token_alternatives=0)")
    return _info(snap, var, node, tokens, i)


def _info(snap: ProgramSnapshot, var: str, node, tokens, i: int) -> TokenInfo:
    n = len(tokens)
    if not -n <= i < n:
        raise IndexError(f"token {i} of {var!r}: it has {n} tokens"
                         + (f" (indices {-n}..{n - 1})" if n else ""))
    ins = next((x for x in node.instructions if x.op is Op.DECODE), None)
    usage = dict(snap.meta.get(var) or {})
    usage.update({k: v for k, v in ((ins.usage if ins is not None else None) or {}).items()
                  if v is not None})
    prompt = usage.get("input_tokens", usage.get("prompt_tokens"))
    ref = InstructionRef(ins.kind, ins.index, ins.request) if ins is not None else None
    return TokenInfo(tokens[i], var, i % n, node.id, node.label(), ref, node.line, node.file,
                     usage.get("cached_tokens"), prompt)


def _node_of(snap: ProgramSnapshot, var: str):
    """The Gen Node of this program that last bound `var`."""
    own = [n for n in snap.nodes if n.program == snap.id and n.name == var]
    gens = [n for n in own if n.kind is NodeKind.GEN]
    if gens:
        return gens[-1]
    if own:
        raise ValueError(f"{var!r} was bound by a {own[-1].kind.value} ({own[-1].label()}), "
                         "not generated token by token: it has no tokens")
    raise KeyError(f"no generated variable {var!r} in program {snap.id}; variables with "
                   f"tokens: {_with_tokens(snap)}")


def _with_tokens(snap: ProgramSnapshot) -> list[str]:
    own = {n.name for n in snap.nodes
           if n.program == snap.id and n.name is not None and n.id in snap.tokens}
    forked = {k for children in snap.forks.values() for c in children
              for k in _bound_by(c) if k not in own}
    return sorted(own) + [f"{k} (fork branches: pass branch=k)" for k in sorted(forked)]


def _fork_of(snap: ProgramSnapshot, var: str) -> list | None:
    """The branches of the last fork whose branches bound `var` (not only inherited it)."""
    for children in reversed(list(snap.forks.values())):
        if any(var in _bound_by(c) for c in children):
            return children
    return None


def _bound_by(branch) -> set[str]:
    """The variables a branch's own Nodes bind (a branch also has the parent's, copied)."""
    return {n.name for n in branch.nodes if n.program == branch.id and n.name is not None}


def _branch(snap: ProgramSnapshot, var: str, k: int) -> ProgramSnapshot:
    children = _fork_of(snap, var)
    if children is None:
        raise KeyError(f"{var!r} was not produced by a fork branch of program {snap.id}; "
                       f"variables with tokens: {_with_tokens(snap)}")
    if not 0 <= k < len(children):
        raise IndexError(f"branch {k} of {var!r}: the fork has {len(children)} branches "
                         f"(0..{len(children) - 1})")
    return children[k]
