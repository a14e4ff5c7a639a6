"""The debugger app live on the engine (Pilot): stepping by Node and by Instruction, a
breakpoint, continue, pause, and an exception inside the program."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.tui.app import DebuggerApp
from sgl_nb.tui.live import LiveSession
from sgl_nb.tui.program_file import load_program

pytestmark = pytest.mark.slow

PROGRAM = Path(__file__).parent / "data" / "tui_program.py"
SAGA = Path(__file__).parent / "data" / "tui_saga.py"


async def until(pilot, cond, what: str, timeout: float = WAIT) -> None:
    """Let the app run until cond() holds (a guard against hanging, not a speed check)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw: {what}; status: {pilot.app.status_text!r}")
        await pilot.pause(0.05)


def shown(pilot, text: str):
    return lambda: text in pilot.app.status_text


def held_in_timeline(session) -> bool:
    p = session.timeline.programs.get(session.state.id)
    return p is not None and p.status == "suspended" and (p.reason or "").startswith("held")


def pane(app, name: str) -> str:
    return app.query_one(f"#{name}").plain


def debug(runtime, function: str, scenario, program: Path = PROGRAM) -> None:
    """Run `scenario(pilot, session)` in the app on a live run of `function`."""
    session = LiveSession(load_program(f"{program}:{function}"), runtime)

    async def run() -> None:
        app = DebuggerApp(session, show_timings=False)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, shown(pilot, "LIVE  held before #1"), "the first hold")
            await scenario(pilot, session)
            await pilot.press("q")
        assert not app.is_running

    try:
        asyncio.run(run())
    finally:
        session.close(release=True)  # nothing stays held on the shared runtime ...
        session.state.error()  # ... or runs on into the next test (this waits for the end)


def test_step_by_node(runtime):
    async def scenario(pilot, session):
        app = pilot.app
        assert [r.kind for r in session.rows()] == ["Text", "Gen", "Text", "Gen"]
        assert "▶   8" in pane(app, "source")  # the line of the first `s +=`
        await pilot.press("n")
        await until(pilot, shown(pilot, "held before #2 Gen a (line 9)"), "the Gen a")
        assert "✓ Text 'Once upon a" in pane(app, "graph")
        await pilot.press("n")
        await until(pilot, shown(pilot, "held before #3 Text ' Then' (line 10)"), "the Text")
        gen = session.timeline.nodes[session.rows()[1].id]
        assert gen.status == "done" and len(gen.tokens) == 6  # all of the Gen ran
        assert "a = '" in pane(app, "state") and "tokens   6 generated" in pane(app, "state")
        assert "⟨#2 a⟩" in pane(app, "tokens")
        assert "▶  10" in pane(app, "source")

    debug(runtime, "story", scenario)


def test_step_by_instruction(runtime):
    async def scenario(pilot, session):
        app = pilot.app
        await pilot.press("s")  # the Text's Extend
        await until(pilot, shown(pilot, "held before #2 Gen a"), "the Gen a")
        await pilot.press("s")  # the Gen's prefill: its first token
        await until(pilot, shown(pilot, "before token 2 of #2 Gen a"), "the first token")
        await pilot.press("s")  # one Decode: one more token
        await until(pilot, shown(pilot, "before token 3 of #2 Gen a"), "the second token")
        gen = session.timeline.nodes[session.rows()[1].id]
        assert len(gen.tokens) == 2 and gen.status == "running"
        assert "▶ next: token 3" in app.query_one("#instructions").render().plain
        assert "Decode[0] running" in app.query_one("#instructions").render().plain
        assert pane(app, "tokens").endswith("▮")

    debug(runtime, "story", scenario)


def test_breakpoint_then_continue(runtime):
    async def scenario(pilot, session):
        app = pilot.app
        await pilot.press("down", "down", "down", "b")  # the row of Gen b
        assert "breakpoint set: Gen b" in app.status_text
        assert "●" in pane(app, "graph").splitlines()[3]
        assert "●   11" in pane(app, "source")
        await pilot.press("c")
        await until(pilot, shown(pilot, "held before #4 Gen b (line 11)"), "the breakpoint")
        rows = session.rows()
        assert [r.status for r in rows] == ["done", "done", "done", "pending"]
        await pilot.press("b")  # the highlight follows the program: clears Gen b's breakpoint
        assert "breakpoint cleared: Gen b" in app.status_text and not session.breakpoints
        await pilot.press("c")
        await until(pilot, shown(pilot, "LIVE  finished"), "the end")
        state = pane(app, "state")
        assert "story  done" in state and "a = '" in state and "b = '" in state
        assert "tokens   10 generated" in state

    debug(runtime, "story", scenario)


def test_pause(runtime):
    async def scenario(pilot, session):
        def tokens() -> int:
            return sum(len(n.tokens) for n in session.timeline.nodes.values())

        await pilot.press("c")
        await until(pilot, lambda: tokens() > 0, "the first token")
        await pilot.press("p")
        await until(pilot, shown(pilot, "of #2 Gen tale"), "the pause inside the Gen")
        # The hold shows at once (the controller says so); the tokens decoded before it
        # reach the timeline with the events, the pause's own event after them.
        await until(pilot, lambda: held_in_timeline(session), "the pause's event")
        held = tokens()
        assert held < 4096 and not session.position().finished
        await pilot.press("s")  # paused: one step is exactly one more token
        await until(pilot, shown(pilot, f"before token {held + 2} of #2"), "one more token")
        assert tokens() == held + 1

    # Prompt lookup off: a step that checks drafts takes every draft the model agrees with,
    # so it may add several tokens.
    settings = runtime.engine.settings
    runtime.engine.settings = dataclasses.replace(settings, prompt_lookup=False)
    try:
        debug(runtime, "saga", scenario, SAGA)
    finally:
        runtime.engine.settings = settings


def test_error_inside_the_program(runtime):
    async def scenario(pilot, session):
        app = pilot.app
        await pilot.press("c")
        await until(pilot, shown(pilot, "LIVE  failed"), "the failure")
        await until(pilot, lambda: "Error" in pane(app, "state"), "the error in the state")
        state = pane(app, "state")
        assert "ValueError('no number in" in state and "at line 24" in state
        assert "broken  error" in state
        await pilot.press("n")  # the app keeps running and answers
        assert "the program has finished" in app.status_text
        assert app.is_running

    debug(runtime, "broken", scenario)


def test_cancel_key(runtime):
    async def scenario(pilot, session):
        app = pilot.app
        await pilot.press("c")
        await until(pilot, lambda: any(n.tokens for n in session.timeline.nodes.values()),
                    "the first token")
        await pilot.press("x")
        await until(pilot, shown(pilot, "LIVE  cancelled"), "the cancel")
        # The panes repaint after the status line: each waited for, not read at once.
        await until(pilot, lambda: "⊘ Gen tale" in pane(app, "graph"), "the cancelled gen")
        await until(pilot, lambda: "saga  cancelled" in pane(app, "state"),
                    "the cancelled program")
        assert isinstance(session.state.error(), sgl.ProgramCancelled)
        await pilot.press("x")
        assert "the program has finished" in app.status_text

    debug(runtime, "saga", scenario, SAGA)
