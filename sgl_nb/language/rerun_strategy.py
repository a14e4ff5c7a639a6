"""How a run treats its Nodes: live (every run but a re-run's) or from a record.

The executor's side (sgl_nb/language/effects.py) asks its run's strategy at each Node: what
to do with it (`node_started`), a Gen's or Select's output when it is not to be computed
(`output`: a replayed Node's recorded one, an edited Node's new value), and what an edit
changes (`params`, `text`). A re-run (sgl_nb/language/rerun.py) hands its states a Rerun
over a RerunCursor; everything else runs with LIVE. The Instructions still start and finish
either way (their events say `replayed` / `edited`), so a re-run's listing and trace show
the same steps as any run."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_nb.language.rerun_cursor import MISSING, RerunCursor, Step, Stepped
from sgl_nb.runtime.compiler.ir import GenNode, Node


@dataclass(frozen=True)
class Output:
    """A Node's output taken from the record or the edit instead of the engine."""

    text: str
    flag: str  # "replayed" or "edited": what its events and meta say
    tokens: tuple | None = None  # a replayed Gen's recorded TokenChoices
    meta: dict | None = None  # a Gen's meta (finish_reason, completion_tokens, the flag)


class LiveRun:
    """Every Node runs: the engine computes each output."""

    def node_started(self, node: Node, branches: list) -> None:
        pass

    def output(self, node: Node) -> Output | None:
        return None

    def params(self, node: Node, params: dict) -> dict:
        return params

    def text(self, node: Node, text: str) -> str:
        return text

    def branch(self, node: Node, i: int) -> LiveRun:
        return self


LIVE = LiveRun()


class Rerun:
    """A re-run's states: before the edited Node a Node's recorded output, at it the edit,
    after it (or where the Python leaves the record) live."""

    def __init__(self, cursor: RerunCursor):
        self.cursor = cursor
        self.steps: dict[int, Stepped] = {}  # node id -> what the re-run does with it

    def node_started(self, node: Node, branches: list) -> None:
        """Decided at a Node's start, kept for its Instructions. `branches`: a Join's
        branches' strategies (what they gathered may leave the record)."""
        cursors = [b.cursor for b in branches if isinstance(b, Rerun)]
        stepped = self.steps[node.id] = self.cursor.step(node, cursors)
        if stepped.step is Step.EDIT and isinstance(node, GenNode) and self.cursor.edit.sampling:
            node.sampling.update(self.cursor.edit.sampling)  # its events and record show them

    def _stepped(self, node: Node | None) -> Stepped | None:
        """The decision for `node` when it is not to run live as recorded."""
        s = self.steps.get(node.id) if node is not None else None
        if s is None or s.step is Step.LIVE:
            return None
        if s.step is Step.EDIT and self.cursor.edit.value is MISSING:
            return None  # only its sampling arguments change: it runs live with them
        return s

    def output(self, node: Node) -> Output | None:
        s = self._stepped(node)
        if s is None:
            return None
        usage = s.record.usage
        if s.step is Step.EDIT:
            return Output(str(self.cursor.edit.value), "edited", None, {
                "finish_reason": usage.get("finish_reason"), "completion_tokens": 0,
                "edited": True})
        tokens = tuple(s.record.tokens)
        return Output(s.record.text, "replayed", tokens, {
            "finish_reason": usage.get("finish_reason"),
            "completion_tokens": usage.get("output_tokens", len(tokens)), "replayed": True})

    def params(self, node: Node, params: dict) -> dict:
        """The Decode's params (lowered before the edit was known) with the edit's."""
        s = self.steps.get(node.id)
        if s is not None and s.step is Step.EDIT:
            return {**params, **self.cursor.edit.sampling}
        return params

    def text(self, node: Node, text: str) -> str:
        s = self._stepped(node)
        return str(self.cursor.edit.value) if s is not None and s.step is Step.EDIT else text

    def branch(self, node: Node, i: int) -> Rerun:
        """The strategy of branch i of the Fork `node`."""
        return Rerun(self.cursor.branch(self.steps[node.id].index, i))
