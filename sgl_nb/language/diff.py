"""`sgl_nb.diff(a, b)`: compare two runs of a program.

Each side is a ProgramState, a ProgramRecord, a Timeline, a trace file path, or a pair
(trace path or Timeline, program id) for a trace holding several top-level programs. Both
become ProgramRecords (sgl_nb/language/run_record.py); their Nodes, fork branches included,
are aligned with difflib, and the first Node whose output differs is searched for the first
token where the runs part, with both tokens' probabilities and the top alternatives there.
The program arguments, the run's sampling defaults and each Node's parameters are compared
too, and time and token counts are put side by side per Node.

`bool(d)` is False when the runs are the same: the same Nodes with the same outputs and
statuses (arguments that differ without changing any output are listed, but do not count).
`str(d)` is a plain-text report, `d._repr_html_()` an HTML table for a notebook.
"""

from __future__ import annotations

import difflib
import html
import json
import math
import os
from dataclasses import dataclass, field
from enum import StrEnum

from sgl_nb.language.run_record import (
    NodeRecord,
    ProgramRecord,
    record_of_state,
    record_of_timeline,
)
from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.runtime.status import Status
from sgl_nb.runtime.token_choice import TokenChoice
from sgl_nb.tracing.timeline import Timeline

ABSENT = "(absent)"  # an argument only one run was given
TOP_SHOWN = 5  # alternatives shown at the divergence, per side


class PairOp(StrEnum):
    """How a NodePair's two Nodes compare."""

    SAME = "same"
    CHANGED = "changed"
    REMOVED = "removed"  # only in run a
    ADDED = "added"  # only in run b


MARKS = {PairOp.SAME: " ", PairOp.CHANGED: "~", PairOp.REMOVED: "-", PairOp.ADDED: "+"}


@dataclass
class Change:
    """One argument or parameter with a different value in each run."""

    name: str
    a: object
    b: object

    def __str__(self) -> str:
        return f"{self.name}: {_value(self.a)} | {_value(self.b)}"


@dataclass
class TokenSide:
    """One run's token where a Node's outputs part (`choice` None: see `note`)."""

    index: int | None  # its place among the Node's tokens
    choice: TokenChoice | None
    note: str = ""  # why there is no token: not recorded, edited, the output ended

    @property
    def probability(self) -> float | None:
        c = self.choice
        return None if c is None or c.logprob is None else math.exp(c.logprob)


@dataclass
class Divergence:
    """Where one Node's two outputs part."""

    char: int | None  # the first character that differs (None: equal texts, other status)
    a: TokenSide
    b: TokenSide
    a_text: str = ""  # the two outputs
    b_text: str = ""
    gen: bool = False  # a gen on either side: tokens are what to show

    @property
    def has_tokens(self) -> bool:
        return self.gen or self.a.choice is not None or self.b.choice is not None

    @property
    def token(self) -> int | None:
        """The index of the first token that differs, on either side."""
        return self.a.index if self.a.index is not None else self.b.index


@dataclass
class NodePair:
    """A Node of each run at the same place (one is None when only one run has it)."""

    op: PairOp
    a: NodeRecord | None
    b: NodeRecord | None
    branch: tuple = ()  # ((fork ordinal, branch index), ...): the fork branch it ran in
    params: list[Change] = field(default_factory=list)
    divergence: Divergence | None = None

    @property
    def node(self) -> NodeRecord:
        return self.a if self.a is not None else self.b  # type: ignore[return-value]

    @property
    def label(self) -> str:
        n = self.node
        return n.label + (f" (line {n.line})" if n.line is not None else "")

    @property
    def place(self) -> str:
        """Its label, with the fork branch it ran in ("branch 1", nested "branch 0.1")."""
        if not self.branch:
            return self.label
        return f"{self.label} in branch {'.'.join(str(b) for _, b in self.branch)}"


@dataclass
class RunDiff:
    a: ProgramRecord
    b: ProgramRecord
    pairs: list[NodePair]
    inputs: list[Change]  # the program's arguments
    sampling: list[Change]  # the run's sampling defaults (`f.run(..., temperature=...)`)
    program: list[Change]  # its function, status, error
    names: tuple[str, str] = ("a", "b")

    def __bool__(self) -> bool:
        return self.first is not None or any(c.name == "status" for c in self.program)

    @property
    def differing(self) -> list[int]:
        """The indexes in `pairs` of the Nodes that differ."""
        return [i for i, p in enumerate(self.pairs) if p.op is not PairOp.SAME]

    @property
    def first(self) -> NodePair | None:
        """The first Node (in program order) whose output differs, or None."""
        return next((p for p in self.pairs if p.op is not PairOp.SAME), None)

    @property
    def divergence(self) -> Divergence | None:
        return self.first.divergence if self.first is not None else None

    @property
    def params(self) -> list[NodePair]:
        """The aligned Nodes whose own parameters (a gen's sampling, ...) differ."""
        return [p for p in self.pairs if p.params]

    def summary(self) -> str:
        return summary(self)

    def __str__(self) -> str:
        return text_report(self)

    def __repr__(self) -> str:
        return f"<RunDiff {self.names[0]} {self.names[1]}: {self.summary()}>"

    def _repr_pretty_(self, p, cycle) -> None:  # IPython's terminal shows the report
        p.text(str(self))

    def _repr_html_(self) -> str:
        return html_report(self)


def diff(a, b=None, *, names: tuple[str, str] = ("a", "b")) -> RunDiff:
    """Compare run `a` with run `b`; with `b` omitted, `a` is a re-run and is compared
    with the run it repeats (`a.rerun_of`)."""
    if b is None:
        original = getattr(a, "rerun_of", None)
        if original is None:
            raise TypeError("diff(a) compares a re-run with its original; "
                            "this run is no re-run: give two runs, diff(a, b)")
        a, b = original, a
    ra, rb = as_record(a), as_record(b)
    sampling = _changes(_args(ra, "options"), _args(rb, "options"))
    pairs = align(ra, rb)
    for p in pairs:  # a Node's parameter that changed with the run's default: said once
        p.params = [c for c in p.params if not any(_same_change(c, s) for s in sampling)]
    return RunDiff(ra, rb, pairs, _changes(_args(ra, "args"), _args(rb, "args")), sampling,
                   _program(ra, rb), tuple(names))


# ---- the two sides as records ---------------------------------------------------------

def as_record(run) -> ProgramRecord:
    """A run as a ProgramRecord: see the module docstring for what it may be."""
    from sgl_nb.language.state import ProgramState

    if isinstance(run, ProgramRecord):
        return run
    if isinstance(run, ProgramState):
        return _of_state(run)
    if isinstance(run, tuple) and len(run) == 2:
        return _traced(run[0], run[1])
    if isinstance(run, Timeline | str | os.PathLike):
        return _traced(run, None)
    raise TypeError(f"diff takes ProgramStates, ProgramRecords, Timelines or trace file "
                    f"paths; got {type(run).__name__}")


def _of_state(state) -> ProgramRecord:
    state.sync()  # until it has ended (or a step controller holds it)
    return record_of_state(state)


def _traced(src, program: int | None) -> ProgramRecord:
    from sgl_nb.tracing import load

    where = "the timeline"
    if not isinstance(src, Timeline):
        where = os.fspath(src)
        if not os.path.isfile(where):
            raise FileNotFoundError(f"no such trace file: {where}")
        src = load(where)
    roots = sorted(p.id for p in src.programs.values() if p.parent is None)
    if program is None and len(roots) != 1:
        found = ", ".join(f"{i} ({src.programs[i].function})" for i in roots) or "none"
        raise ValueError(f"{where} holds {len(roots)} top-level programs ({found}): say which "
                         f"one, as diff(({where!r}, ID), ...) or `sgl-nb diff --program-a ID`")
    if program is not None and program not in src.programs:
        raise ValueError(f"{where} has no program {program}; its programs: {roots}")
    return record_of_timeline(src, program, source=where)


# ---- arguments ------------------------------------------------------------------------

def _args(rec: ProgramRecord, key: str) -> dict:
    raw = rec.call.get(key)
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {"(not JSON)": raw}
    return value if isinstance(value, dict) else {"": value}


def _changes(a: dict, b: dict) -> list[Change]:
    out = []
    for k in sorted(set(a) | set(b), key=str):
        va, vb = a.get(k, ABSENT), b.get(k, ABSENT)
        if _canonical(va) != _canonical(vb):
            out.append(Change(str(k), va, vb))
    return out


def _same_change(x: Change, y: Change) -> bool:
    return x.name == y.name and _canonical([x.a, x.b]) == _canonical([y.a, y.b])


def _program(a: ProgramRecord, b: ProgramRecord) -> list[Change]:
    return [Change(k, getattr(a, k), getattr(b, k)) for k in ("function", "status", "error")
            if getattr(a, k) != getattr(b, k)]


def _canonical(v) -> str:
    return json.dumps(v, default=repr, sort_keys=True)


# ---- aligning the Nodes ---------------------------------------------------------------

def flatten(rec: ProgramRecord) -> list[tuple[tuple, NodeRecord]]:
    """(branch, node) in program order, each fork's branches after the fork; `branch`
    names a fork by its ordinal among its program's forks, not by its index, so a Node
    added before a fork does not move the fork's branches out of alignment."""
    out: list[tuple[tuple, NodeRecord]] = []

    def visit(p: ProgramRecord, where: tuple) -> None:
        forks = 0
        for n in p.nodes:
            out.append((where, n))
            if n.kind is NodeKind.FORK:
                for i, child in enumerate(n.branches):
                    visit(child, (*where, (forks, i)))
                forks += 1

    visit(rec, ())
    return out


def _signature(where: tuple, n: NodeRecord, strict: bool) -> tuple:
    # A Text's label holds its (shortened) text: loosely, any Text matches any Text at the
    # same place, so a Text whose input changed pairs with its counterpart as "changed".
    if n.kind is NodeKind.TEXT:
        return (where, n.kind, n.text if strict else None)
    return (where, n.kind, n.name, n.label)


def _matches(xs: list, ys: list, strict: bool, i0: int = 0, j0: int = 0) -> list[tuple]:
    """(i, j) index pairs (None on the side a Node is missing from), in order."""
    sx = [_signature(w, n, strict) for w, n in xs]
    sy = [_signature(w, n, strict) for w, n in ys]
    out: list[tuple] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, sx, sy, autojunk=False).get_opcodes():
        if op == "equal":
            out += [(i0 + i, j0 + j) for i, j in zip(range(i1, i2), range(j1, j2), strict=True)]
        elif op == "replace" and strict:  # a second, looser look at what did not match
            out += _matches(xs[i1:i2], ys[j1:j2], False, i0 + i1, j0 + j1)
        else:
            out += [(i0 + i, None) for i in range(i1, i2)]
            out += [(None, j0 + j) for j in range(j1, j2)]
    return out


def align(a: ProgramRecord, b: ProgramRecord) -> list[NodePair]:
    xs, ys = flatten(a), flatten(b)
    pairs = []
    for i, j in _matches(xs, ys, True):
        if j is None:
            pairs.append(NodePair(PairOp.REMOVED, xs[i][1], None, xs[i][0]))
        elif i is None:
            pairs.append(NodePair(PairOp.ADDED, None, ys[j][1], ys[j][0]))
        else:
            pairs.append(_pair(xs[i][0], xs[i][1], ys[j][1]))
    return pairs


def _pair(where: tuple, a: NodeRecord, b: NodeRecord) -> NodePair:
    same = a.text == b.text and a.status == b.status
    op = PairOp.SAME if same else PairOp.CHANGED
    return NodePair(op, a, b, where, _changes(a.params, b.params),
                    None if same else divergence(a, b))


# ---- where two outputs part -----------------------------------------------------------

def divergence(a: NodeRecord, b: NodeRecord) -> Divergence:
    char = _first_char(a.text, b.text)
    token = _first_token(a.tokens, b.tokens) if a.tokens and b.tokens else None
    return Divergence(char, _side(a, token, char), _side(b, token, char), a.text, b.text,
                      NodeKind.GEN in (a.kind, b.kind))


def _first_char(x: str, y: str) -> int | None:
    if x == y:
        return None
    return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                min(len(x), len(y)))


def _first_token(x: list[TokenChoice], y: list[TokenChoice]) -> int | None:
    for i, (p, q) in enumerate(zip(x, y, strict=False)):
        if p.token != q.token:
            return i
    return None if len(x) == len(y) else min(len(x), len(y))


def _side(n: NodeRecord, token: int | None, char: int | None) -> TokenSide:
    if not n.tokens:
        return TokenSide(None, None, _no_tokens(n))
    if token is None and char is None:  # the same text: only the status differs
        return TokenSide(None, None, f"the same output, status {n.status.value}")
    i = token if token is not None else _token_at(n.tokens, char)
    if i is None or i >= len(n.tokens):
        reason = n.usage.get("finish_reason")
        return TokenSide(len(n.tokens), None, f"its output ended after {len(n.tokens)} "
                         f"tokens" + (f" (finish_reason {reason})" if reason else ""))
    return TokenSide(i, n.tokens[i])


def _token_at(tokens: list[TokenChoice], char: int | None) -> int | None:
    """The token whose text holds character `char` of the output."""
    if char is None:
        return None
    end = 0
    for i, t in enumerate(tokens):
        end += len(t.text)
        if char < end:
            return i
    return None


def _no_tokens(n: NodeRecord) -> str:
    if n.usage.get("edited"):
        return "its value was edited (no tokens generated)"
    if n.usage.get("replayed"):
        return "replayed from the record (no tokens generated)"
    if n.kind is not NodeKind.GEN:
        return f"a {n.kind.value} has no tokens"
    if n.status is not Status.DONE:
        return f"it did not finish ({n.status.value})"
    if not n.text:
        return "it generated nothing"
    return "its tokens were not recorded"


# ---- the reports ------------------------------------------------------------------------

def summary(d: RunDiff) -> str:
    first = d.first
    if first is None:
        status = next((c for c in d.program if c.name == "status"), None)
        if status is not None:
            return f"the same Nodes and outputs, but the status differs: {status}"
        return f"identical: {len(d.pairs)} Nodes, the same outputs"
    where = {PairOp.REMOVED: f": only in {d.names[0]}", PairOp.ADDED: f": only in {d.names[1]}"}
    tail = where.get(first.op, "")
    dv = first.divergence
    if dv is not None and dv.token is not None:
        tail = f", token {dv.token}"
    elif dv is not None and dv.char is not None:
        tail = f", character {dv.char}"
    n = len(d.differing)
    return f"differ at {first.place}{tail} ({n} Node{'s differ' if n != 1 else ' differs'})"


def text_report(d: RunDiff) -> str:
    lines = [f"runs {d.names[0]} and {d.names[1]}: {summary(d)}"]
    if d.first is not None and d.first.divergence is not None:
        lines += divergence_lines(d.first.divergence, d.names)
    lines += settings_lines(d)
    legend = " ".join(f"{m} {o.value}" for o, m in MARKS.items() if o is not PairOp.SAME)
    lines.append(f"Nodes ({legend}; tokens, cached tokens and seconds as a|b):")
    lines += _table_lines(d)
    return "\n".join(lines)


def divergence_lines(dv: Divergence, names: tuple[str, str]) -> list[str]:
    out = []
    if dv.char is not None:
        out.append(f"  the outputs part at character {dv.char}:")
        out += [f"    {name}: {_context(side_text, dv.char)}"
                for name, side_text in zip(names, (dv.a_text, dv.b_text), strict=True)]
    if not dv.has_tokens:
        return out  # a Text, a role, a fork: its text says it all
    out.append(f"  at token {dv.token}:" if dv.token is not None else "  tokens:")
    for name, side in zip(names, (dv.a, dv.b), strict=True):
        out.append(f"    {name}: {_token_words(side)}")
    tops = [s.choice.top[:TOP_SHOWN] for s in (dv.a, dv.b) if s.choice and s.choice.top]
    both = len(tops) == 2 and _canonical(_alts(tops[0])) == _canonical(_alts(tops[1]))
    for name, side in zip(names, (dv.a, dv.b), strict=True):
        if side.choice is not None and side.choice.top:
            who = "both" if both else name
            out.append(f"    top ({who}): " + ", ".join(_alt_words(dv, k)
                                                      for k in side.choice.top[:TOP_SHOWN]))
            if both:
                break
    if dv.a.choice is not None or dv.b.choice is not None:
        out.append("    (the model's probabilities, before temperature and the grammar mask)")
    return out


def _alts(top) -> list:
    return [a.to_json() for a in top]


def _context(text: str, char: int, before: int = 16, after: int = 28) -> str:
    head = "…" if char > before else ""
    tail = "…" if len(text) > char + after else ""
    return head + repr(text[max(0, char - before): char + after]) + tail


def _token_words(side: TokenSide) -> str:
    c = side.choice
    if c is None:
        return side.note
    extra = " forced" if c.forced else ""
    rank = f", rank {c.rank}" if c.rank is not None else (
        f", not in the top {len(c.top)}" if c.top else "")
    if not c.top:
        extra += ", alternatives not recorded (a trace below level 'token')"
    return f"{c.text!r} (id {c.token}) p={_pct(side.probability)}{rank}{extra}"


def _alt_words(dv: Divergence, alt) -> str:
    # * marks a's token, + b's (the alternatives are often the same distribution)
    mark = "*" if dv.a.choice and alt.token == dv.a.choice.token else ""
    mark += "+" if dv.b.choice and alt.token == dv.b.choice.token else ""
    masked = " masked" if alt.masked else ""
    return f"{mark}{alt.text!r} {_pct(math.exp(alt.logprob))}{masked}"


def settings_lines(d: RunDiff) -> list[str]:
    out = []
    for title, changes in (("inputs differ (program arguments)", d.inputs),
                           ("sampling arguments differ (the run's defaults)", d.sampling),
                           ("program differs", d.program)):
        if changes:
            out.append(f"{title}:")
            out += [f"  {c}" for c in changes]
    if d.params:
        out.append("Node parameters differ:")
        out += [f"  {p.place}: " + "; ".join(str(c) for c in p.params) for p in d.params]
    return out


def _table_lines(d: RunDiff) -> list[str]:
    head = f"   {'Node':<30} {d.names[0]:<24} {d.names[1]:<24} {'tokens':>7} {'cached':>9} " \
           f"{'seconds':>11}"
    rows = [head]
    for p in d.pairs:
        a, b = _cell_texts(p)
        rows.append(f" {MARKS[p.op]} {fit(_indent(p) + p.label, 30):<30} {a:<24} {b:<24} "
                    f"{_both(p, _out_tokens):>7} {_both(p, _cached):>9} "
                    f"{_both(p, _secs):>11}")
    return rows


def _cell_texts(p: NodePair, width: int = 24) -> tuple[str, str]:
    a = "" if p.a is None else fit(repr(p.a.text), width)
    b = "" if p.b is None else fit(repr(p.b.text), width)
    if p.op is PairOp.SAME:
        b = "="  # the same output: shown once
    return a, b


def _indent(p: NodePair) -> str:
    # A branch's Nodes, under their fork: indented by depth, with their branch's number.
    return "  " * len(p.branch) + f"[{p.branch[-1][1]}] " if p.branch else ""


def _both(p: NodePair, get) -> str:
    a, b = get(p.a), get(p.b)
    return f"{a}|{b}" if a or b else ""


def _out_tokens(n: NodeRecord | None) -> str:
    if n is None or n.kind not in (NodeKind.GEN, NodeKind.SELECT):
        return "" if n is not None else "·"
    return str(n.usage.get("output_tokens", len(n.tokens)))


def _cached(n: NodeRecord | None) -> str:
    if n is None:
        return "·"
    v = n.usage.get("cached_tokens")
    return "" if v is None else str(v)


def _secs(n: NodeRecord | None) -> str:
    if n is None:
        return "·"
    return "" if n.seconds is None else f"{n.seconds:.2f}"


def fit(s: str, width: int) -> str:
    """s cut to `width` characters, an ellipsis marking the cut."""
    return s if len(s) <= width else s[: width - 1] + "…"


def _pct(p: float | None) -> str:
    if p is None:
        return "?"
    return f"{p:.1%}" if p >= 0.001 else f"{p:.1e}"


def _value(v) -> str:
    return v if v is ABSENT else fit(repr(v), 60)


# ---- HTML ---------------------------------------------------------------------------------

HTML_CSS = ("border-collapse:collapse;font-family:var(--jp-code-font-family,monospace);"
            "font-size:12px")
# Translucent, so that the rows read on a light and on a dark notebook theme alike.
ROW_BG = {PairOp.CHANGED: "rgba(255,193,7,.25)", PairOp.REMOVED: "rgba(220,53,69,.25)",
          PairOp.ADDED: "rgba(25,135,84,.25)"}


def html_report(d: RunDiff) -> str:
    e = html.escape
    parts = [f"<div class='sgl-diff'><b>{e(d.names[0])}</b> vs <b>{e(d.names[1])}</b>: "
             f"{e(summary(d))}"]
    if d.first is not None and d.first.divergence is not None:
        parts.append("<pre style='margin:4px 0'>" + e("\n".join(
            divergence_lines(d.first.divergence, d.names))) + "</pre>")
    settings = settings_lines(d)
    if settings:
        parts.append("<pre style='margin:4px 0'>" + e("\n".join(settings)) + "</pre>")
    parts.append(_html_table(d))
    return "".join(parts) + "</div>"


def _html_table(d: RunDiff) -> str:
    e = html.escape
    cells = "".join(f"<th style='text-align:left;padding:1px 6px'>{e(h)}</th>" for h in
                    ("", "Node", d.names[0], d.names[1], "tokens", "cached", "seconds"))
    rows = [f"<tr>{cells}</tr>"]
    first = d.first
    for p in d.pairs:
        style = f"background:{ROW_BG[p.op]}" if p.op in ROW_BG else ""
        if p is first:
            style += ";outline:2px solid #d63384"
        a, b = _cell_texts(p, 40)
        row = (MARKS[p.op], _indent(p) + p.label, a, b, _both(p, _out_tokens),
               _both(p, _cached), _both(p, _secs))
        rows.append(f"<tr style='{style}'>" + "".join(
            f"<td style='padding:1px 6px;white-space:pre'>{e(c)}</td>" for c in row) + "</tr>")
    return f"<table style='{HTML_CSS}'>{''.join(rows)}</table>"
