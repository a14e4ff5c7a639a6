"""A cursor over a recorded Timeline: forward and backward by Node and by Instruction.

A stop is "just before event X": the view is the timeline up to the event before it, so a
replay stands where a live run would be held (before a Node, before one of its
Instructions, before a Gen's next token, since each token is one Decode step)."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_nb.runtime.compiler.step_controller import Breakpoint
from sgl_nb.runtime.events import TREE_EVENTS, InstructionStarted, NodeStarted, Token
from sgl_nb.runtime.status import Status
from sgl_nb.tracing.timeline import Timeline
from sgl_nb.tui.rows import (
    NodeRow,
    Position,
    Where,
    number_rows,
    ordered_rows,
    pending_row,
    started_rows,
)
from sgl_nb.tui.session import error_line_in

_STOPS = ((NodeStarted, Where.NODE), (InstructionStarted, Where.INSTRUCTION),
          (Token, Where.DECODE))


@dataclass(frozen=True)
class Stop:
    seq: int  # the view holds the events before this one
    where: Where
    node: int | None


class ReplaySession:
    mode = "replay"

    def __init__(self, timeline: Timeline, name: str = "trace"):
        if not timeline.events:
            raise ValueError(f"{name}: the trace holds no events")
        self.full = timeline
        self._has_tree = any(isinstance(e, TREE_EVENTS) for e in timeline.events)
        self.breakpoints: set[Breakpoint] = set()
        roots = [p for p in timeline.programs.values() if p.parent is None]
        self._root = roots[0].id if roots else None
        function = roots[0].function if roots and roots[0].function else "program"
        self.title = f"{function} · {name}"
        self._forks = timeline.fork_children()
        self._stops = self._find_stops()
        self._i = 0
        self.timeline = self._view()

    def _find_stops(self) -> list[Stop]:
        node_of_request: dict[int, int] = {}
        stops = []
        for e in self.full.events:
            if isinstance(e, InstructionStarted) and e.request is not None \
                    and e.node is not None:
                node_of_request[e.request] = e.node
            where = next((w for cls, w in _STOPS if isinstance(e, cls)), None)
            node = e.node if e.node is not None else node_of_request.get(e.request)
            if where is not None and node in self.full.nodes:
                stops.append(Stop(e.seq, where, node))
        end = self.full.events[-1].seq + 1  # after everything: the whole run
        return [*stops, Stop(end, Where.END, None)]

    def _view(self) -> Timeline:
        stop = self._stops[self._i]
        return self.full.upto(stop.seq - 1)

    def _move(self, i: int, message: str) -> str:
        self._i = max(0, min(i, len(self._stops) - 1))
        self.timeline = self._view()
        return message

    # ---- what the panes read -----------------------------------------------------------

    def root_program(self) -> int | None:
        return self._root

    def position(self) -> Position:
        stop = self._stops[self._i]
        if stop.where is not Where.END:
            return Position(stop.where, stop.node)
        p = self.full.programs.get(self._root) if self._root is not None else None
        last = next(reversed(self.full.nodes), None)
        failed = p is not None and p.status is Status.ERROR
        return Position(Where.ERROR if failed else Where.DONE, last)

    def rows(self) -> list[NodeRow]:
        # Every Node of the trace, ordered by the whole run's forks: a row keeps its place
        # and number at every stop, whichever branch ran first.
        started = {r.id: r for r in started_rows(self.timeline)}
        rows = [started.get(nid) or pending_row(n, self.full)
                for nid, n in self.full.nodes.items()]
        return number_rows(ordered_rows(rows, self._forks))

    def source_file(self) -> str | None:
        node = self.full.nodes.get(self._stops[self._i].node)
        if node is not None and node.file:
            return node.file
        return next((n.file for n in self.full.nodes.values() if n.file), None)

    def error_line(self) -> int | None:
        return error_line_in(self.timeline, self._root)

    def cache_tree(self) -> str | None:
        """The radix tree as the trace's events built it up to here; None when the trace
        has none of the tree's events (recorded before they existed): its changes then."""
        if not self._has_tree:
            return None
        return self.timeline.cache_tree.format_tree()

    # ---- controls ----------------------------------------------------------------------

    def _next(self, want, forward: bool = True) -> int | None:
        order = range(self._i + 1, len(self._stops)) if forward else range(self._i - 1, -1, -1)
        return next((j for j in order if want(self._stops[j])), None)

    def next_node(self) -> str:
        j = self._next(lambda s: s.where in (Where.NODE, Where.END))
        return "at the end of the trace" if j is None else self._move(j, "next Node")

    def next_instruction(self) -> str:
        if self._i == len(self._stops) - 1:
            return "at the end of the trace"
        return self._move(self._i + 1, "next Instruction")

    def back_node(self) -> str:
        j = self._next(lambda s: s.where is Where.NODE, forward=False)
        return "at the first Node" if j is None else self._move(j, "previous Node")

    def back_instruction(self) -> str:
        if self._i == 0:
            return "at the start of the trace"
        return self._move(self._i - 1, "previous Instruction")

    def continue_(self) -> str:
        def hit(s: Stop) -> bool:
            node = self.full.nodes.get(s.node)
            return s.where is Where.END or (s.where is Where.NODE and node is not None
                                        and any(bp.hits(node) for bp in self.breakpoints))

        j = self._next(hit)
        if j is None:
            return "at the end of the trace"
        return self._move(j, "at a breakpoint" if self._stops[j].where is Where.NODE else "end")

    def pause(self) -> str:
        return "nothing runs in a replay: n/s step forward, N/S back, c to the next breakpoint"

    def cancel(self) -> str:
        return "nothing runs in a replay: there is nothing to cancel"

    def toggle_breakpoint(self, row: NodeRow) -> str:
        bp = row.breakpoint()
        if bp in self.breakpoints:
            self.breakpoints.discard(bp)
            return f"breakpoint cleared: {row.label}"
        self.breakpoints.add(bp)
        return f"breakpoint set: {row.label}"
