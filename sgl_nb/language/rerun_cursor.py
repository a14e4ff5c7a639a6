"""A re-run's cursor over the run it repeats (`state.rerun`, sgl_nb/language/rerun.py).

Each program state of the re-run (the top one and every fork branch) holds a RerunCursor over
the record of the same program in the original run. The executor starts a state's Nodes in
order, so `step` sees them in the order they ran: Node k of the re-run is the record's
Node k while the program's Python takes the same path. Before the edited Node a Node's
recorded output is replayed (a gen is not decoded); at it, the edit applies; after it, and
from the first Node that differs from the record, everything runs live.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from sgl_nb.language.run_record import NodeRecord, ProgramRecord
from sgl_nb.runtime.compiler.ir import Node, TextNode
from sgl_nb.runtime.status import Status

MISSING = object()  # `value` not given: the edited Node keeps its own (sampling changes)


class Step(str, Enum):
    REPLAY = "replay"  # the recorded output, no engine work
    EDIT = "edit"  # the edited Node: its new value, or its new sampling arguments, live
    LIVE = "live"


@dataclass
class Stepped:
    step: Step
    record: NodeRecord | None  # the same Node in the record
    index: int  # its position in its program's record


@dataclass
class Edit:
    """What `rerun` changes at its Node."""

    value: object = MISSING
    sampling: dict = field(default_factory=dict)  # SamplingParams fields


@dataclass
class RerunReport:
    """What a re-run did with the record; `state.rerun_report`."""

    at: str  # the edited Node's label and line
    replayed: int = 0  # Nodes whose recorded output was reused
    reached: bool = False  # the edited Node ran
    diverged: str | None = None  # the first Node where the Python left the record, if any

    def __str__(self) -> str:
        parts = [f"re-run at {self.at}: {self.replayed} Node(s) replayed"]
        parts.append("the edit applied" if self.reached else "the edited Node was not reached")
        if self.diverged:
            parts.append(f"diverged at {self.diverged} (ran live from there)")
        return "; ".join(parts)


class RerunCursor:
    def __init__(self, record: ProgramRecord | None, at: tuple | None, edit: Edit,
                 report: RerunReport, live: bool = False):
        self.record = record
        self.at = at  # (path, index) of the edited Node from this program, or None
        self.edit, self.report = edit, report
        self.live = live or record is None  # from here on, nothing is replayed
        self.diverged = record is None  # positions no longer line up with the record
        self._next = 0

    def step(self, node: Node, branches: list[RerunCursor] = ()) -> Stepped:
        """What to do with `node`, the next Node this state runs. `branches`: a Join's."""
        if any(b.live for b in branches):
            self.live = True  # what the branches gathered differs from the record
        rec = self._match(node)
        index = self._next - 1
        if rec is None:
            return Stepped(Step.LIVE, None, index)
        if self.at is not None and self.at == ((), index):
            self.live = self.report.reached = True  # what follows depends on the edit
            return Stepped(Step.EDIT, rec, index)
        if self.live or rec.status is not Status.DONE:
            self.live = True  # a Node that did not end is not replayed, nor what follows
            return Stepped(Step.LIVE, rec, index)
        self.report.replayed += 1
        return Stepped(Step.REPLAY, rec, index)

    def _match(self, node: Node) -> NodeRecord | None:
        if self.diverged:
            return None
        nodes = self.record.nodes
        rec = nodes[self._next] if self._next < len(nodes) else None
        self._next += 1
        text = node.text if isinstance(node, TextNode) else None
        if rec is not None and rec.same_step(node.kind, node.name, node.label(),
                                             node.params(), text):
            return rec
        self.diverged = self.live = True
        if not self.report.reached and self.report.diverged is None:
            where = f"line {node.line}" if node.line is not None else "no line"
            was = rec.label if rec is not None else "the record's end"
            self.report.diverged = f"{node.label()} ({where}; the record has {was})"
        return None

    def branch(self, index: int, i: int) -> RerunCursor:
        """The cursor of branch i of the Fork at `index` (the fork Node's own position)."""
        rec = None
        if not self.diverged and index < len(self.record.nodes):
            kids = self.record.nodes[index].branches
            rec = kids[i] if i < len(kids) else None
        at = None
        if self.at is not None and self.at[0][:1] == ((index, i),):
            at = (self.at[0][1:], self.at[1])
        return RerunCursor(rec, at, self.edit, self.report, live=self.live)
