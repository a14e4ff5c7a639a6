"""A program running under the debugger, live on the engine: it starts paused (step=True)
and the app drives its step controller; its events feed a Timeline.

Nothing here waits for the engine: the controller's methods only flip flags, `position`
reads plain attributes, and events arrive through `pump`, a worker thread that hands them
to the app in batches."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from sgl_nb.runtime.compiler.step_controller import Breakpoint
from sgl_nb.runtime.events import CacheEvict, Event
from sgl_nb.tracing.cache_tree import snapshot_events
from sgl_nb.tracing.timeline import Family, Timeline
from sgl_nb.tui.program_file import ProgramFile
from sgl_nb.tui.rows import NodeRow, Position, Where, number_rows, ordered_rows, started_rows
from sgl_nb.tui.session import error_line_in

_UNCHANGED = object()  # rerun(): no value given (the Node keeps its output)

BATCH_S = 1 / 30  # events that arrive within this long reach the app as one message


class LiveSession:
    mode = "live"

    def __init__(self, program: ProgramFile, backend, passes=None, start=None):
        """start: what starts the run instead (a re-run), called once we listen."""
        self.backend, self.program = backend, program
        self._bus = backend.events
        self._queue = self._bus.subscribe()  # before the run starts: no event is missed
        tree_so_far = snapshot_events(getattr(backend, "cache", None))
        self.state = start() if start is not None else program.function.run(
            backend=backend, step=True, passes=passes, **program.args)
        self.debug = self.state.debug
        self.breakpoints: set[Breakpoint] = self.debug.breakpoints
        self.timeline = Timeline(tree_so_far)  # the radix tree's events follow
        self._family = Family(self.state.id)
        self._file = str(program.path)
        self.title = f"{program.name} · {program.path.name}"

    # ---- events ------------------------------------------------------------------------

    def pump(self, post: Callable[[list[Event]], None], stop: threading.Event) -> None:
        """Run on a worker thread until `stop`: one `post` per batch of events."""
        while not stop.is_set():
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            stop.wait(BATCH_S)  # a burst of tokens becomes one batch, not one message each
            batch = [first]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            post(batch)

    def apply(self, events: list[Event]) -> int:
        """Fold the events of this program (and its fork branches) into the timeline."""
        n = 0
        for e in events:
            # An eviction is the one cache change no request (no program) owns.
            ours = [e] if e.program is None and isinstance(e, CacheEvict) else \
                self._family.take(e)
            for mine in ours:
                self.timeline.apply(mine)
                n += 1
        return n

    def close(self, release: bool = False) -> None:
        """Stop listening; with release, let the program run to its end (nothing holds it)."""
        self._bus.unsubscribe(self._queue)
        if release:
            self.debug.breakpoints.clear()
            self.debug.continue_()

    # ---- what the panes read -----------------------------------------------------------

    def root_program(self) -> int | None:
        return self.state.id

    def position(self) -> Position:
        p = self.timeline.programs.get(self.state.id)
        last = next((n.id for n in reversed(self.timeline.nodes.values())
                     if n.start_ns is not None), None)  # queued ones have not run
        if p is not None and p.status.ended:
            return Position(Where.of(p.status), last)
        if p is not None and p.held is not None and p.held_node is not None:
            return Position(Where(p.held.value), p.held_node)
        return Position(Where.RUNNING if self.timeline.events else Where.START, last)

    def rows(self) -> list[NodeRow]:
        # Queued Nodes too: the program's Python runs ahead of what has started.
        return number_rows(ordered_rows(started_rows(self.timeline),
                                        self.timeline.fork_children()))

    def source_file(self) -> str | None:
        return self._file

    def error_line(self) -> int | None:
        return error_line_in(self.timeline, self.state.id)

    def cache_tree(self) -> str | None:
        """The radix tree as this session's events built it (None: a remote backend)."""
        if getattr(self.backend, "cache", None) is None:
            return None
        return self.timeline.cache_tree.format_tree(self.backend.tokenizer.decode)

    # ---- controls ----------------------------------------------------------------------

    def _finished(self) -> bool:
        return self.position().finished

    def next_node(self) -> str:
        if self._finished():
            return "the program has finished"
        self.debug.step()
        return "running one Node"

    def next_instruction(self) -> str:
        if self._finished():
            return "the program has finished"
        if not self.backend.instruction_stepping:
            return "stepping by Node only: Instructions run on the server"
        self.debug.step_instruction()
        return "running one Instruction"

    def continue_(self) -> str:
        if self._finished():
            return "the program has finished"
        self.debug.continue_()
        return "continuing"

    def pause(self) -> str:
        if self._finished():
            return "the program has finished"
        self.debug.pause()
        return "pausing at the next Node or token"

    def cancel(self) -> str:
        if self._finished():
            return "the program has finished"
        self.state.cancel()
        return "cancelling: the running Node is aborted, the pending ones will not run"

    def back_node(self) -> str:
        return "a live run only goes forward: step backwards in a replay (sgl-nb replay)"

    back_instruction = back_node

    def rerun(self, row: NodeRow, value=_UNCHANGED, sampling: dict | None = None) -> LiveSession:
        """A live session over this program run again from `row`'s Node with an edit
        (ProgramState.rerun: what comes before is replayed). Raises on a bad edit."""
        edit = dict(sampling or {})
        if value is not _UNCHANGED:
            edit["value"] = value
        from_state = self.state.rerun  # checks the edit before anything runs
        return LiveSession(self.program, self.backend, start=lambda: from_state(
            row.id, stream=True, debug=True, **edit))

    def toggle_breakpoint(self, row: NodeRow) -> str:
        bp = row.breakpoint()
        if bp in self.debug.breakpoints:
            self.debug.clear_breakpoint(bp)
            return f"breakpoint cleared: {row.label}"
        self.debug.breakpoint(name=bp.name, kind=bp.kind, line=bp.line)
        return f"breakpoint set: {row.label}"
