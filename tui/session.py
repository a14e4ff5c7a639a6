"""The one interface the debugger app drives: a live run (live.py) or a replay (replay.py).

Every method returns at once: the app calls them on its own thread and must never wait for
the engine. The control methods return a short message for the status line."""

from __future__ import annotations

from typing import Protocol

from sgl_nb.runtime.compiler.step_controller import Breakpoint
from sgl_nb.runtime.events import Failed, ProgramFinished
from sgl_nb.tracing.timeline import Timeline
from sgl_nb.tui.rows import NodeRow, Position


class Session(Protocol):
    mode: str  # "live" | "replay"
    title: str  # program name and file (base name: snapshots must not depend on the path)
    timeline: Timeline  # what is known at the current position
    breakpoints: set[Breakpoint]

    def position(self) -> Position: ...

    def rows(self) -> list[NodeRow]: ...

    def root_program(self) -> int | None: ...

    def source_file(self) -> str | None: ...

    def error_line(self) -> int | None: ...

    def cache_tree(self) -> str | None:
        """The radix tree as text (live), or None when only its changes are known."""
        ...

    def next_node(self) -> str: ...

    def next_instruction(self) -> str: ...

    def continue_(self) -> str: ...

    def pause(self) -> str: ...

    def cancel(self) -> str:
        """Cancel the program (live); what it produced stays on screen."""
        ...

    def back_node(self) -> str: ...

    def back_instruction(self) -> str: ...

    def toggle_breakpoint(self, row: NodeRow) -> str: ...


def error_line_in(tl: Timeline, program: int | None) -> int | None:
    """The line an error event of the program (or, failing that, any program) named."""
    fallback = None
    for e in reversed(tl.events):
        line = e.line if isinstance(e, Failed | ProgramFinished) else None
        if line is None:
            continue
        if e.program == program:
            return line
        fallback = fallback if fallback is not None else line
    return fallback
