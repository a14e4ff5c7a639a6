"""The debugger's time-travel keys (Pilot, live on the engine): `r` re-runs the program from
the selected Node with an edit, `w` shows why a token was chosen."""

from __future__ import annotations

import asyncio

import pytest
from test_tui_live import PROGRAM, shown, until

from sgl_nb.tui.app import DebuggerApp
from sgl_nb.tui.live import LiveSession
from sgl_nb.tui.program_file import load_program

pytestmark = pytest.mark.slow


def finished_app(runtime, scenario) -> None:
    """`scenario(pilot)` on the app once the `story` program has run to its end."""
    session = LiveSession(load_program(f"{PROGRAM}:story"), runtime)

    async def run() -> None:
        app = DebuggerApp(session, show_timings=False)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, shown(pilot, "held before #1"), "the first hold")
            await pilot.press("c")
            await until(pilot, shown(pilot, "finished"), "the end of the run")
            await scenario(pilot)
            await pilot.press("q")

    try:
        asyncio.run(run())
    finally:
        session.close(release=True)


async def select(pilot, label: str) -> None:
    graph = pilot.app.query_one("#graph")
    i = next(k for k, r in enumerate(graph.rows) if r.label == label)
    graph.nodes.highlighted = i
    await pilot.pause()


def test_rerun_key_runs_the_edit_and_replays_what_came_before(runtime):
    async def scenario(pilot):
        app = pilot.app
        first = app.session.state
        await select(pilot, "Gen b")
        await pilot.press("r")
        value = app.screen.query_one("#value")
        assert value.value == first["b"]  # the edit box starts from the Node's output
        value.value = " the end."
        await pilot.press("enter")
        await until(pilot, shown(pilot, "re-run from #4 Gen b"), "the re-run starting")
        again = app.session.state
        assert again is not first
        await until(pilot, shown(pilot, "finished"), "the re-run's end")
        assert again["b"] == " the end." and again["a"] == first["a"]
        assert again.rerun_report.replayed >= 3
        assert "the end." in app.query_one("#tokens").plain

    finished_app(runtime, scenario)


def test_rerun_key_with_sampling_arguments_and_a_bad_one(runtime):
    async def scenario(pilot):
        app = pilot.app
        first = app.session.state
        await select(pilot, "Gen b")
        await pilot.press("r")
        app.screen.query_one("#sampling").value = "max_tokens=2"
        await pilot.press("enter")
        await until(pilot, shown(pilot, "re-run from"), "the re-run starting")
        await until(pilot, shown(pilot, "finished"), "the re-run's end")
        assert first["b"].startswith(app.session.state["b"])  # greedy, cut at 2 tokens
        await select(pilot, "Gen b")
        await pilot.press("r")
        app.screen.query_one("#sampling").value = "temprature=2"
        await pilot.press("enter")
        await until(pilot, shown(pilot, "cannot re-run: unknown sampling"), "the error")

    finished_app(runtime, scenario)


def test_why_token_key_shows_the_alternatives(runtime):
    async def scenario(pilot):
        app = pilot.app
        await select(pilot, "Gen a")
        await pilot.press("w")
        screen = app.screen
        tokens = app.session.timeline.nodes[app.query_one("#graph").selected_row().id].tokens
        assert f"token {len(tokens)} of {len(tokens)}" in screen.plain
        await pilot.press("left")
        assert f"token {len(tokens) - 1} of" in screen.plain
        assert screen.plain.count("%") >= 5  # the top alternatives with their probabilities
        assert "> " in screen.plain  # the chosen one marked
        chosen = tokens[-2].text
        assert repr(chosen)[:17] in screen.plain
        await pilot.press("escape")
        assert app.screen is not screen

    finished_app(runtime, scenario)


def test_why_token_key_in_a_replay(runtime, tmp_path):
    """A trace at the default level keeps each token's alternatives: `w` shows them in a
    replay as in a live run; `r` has no run to start there."""
    import sgl_nb as sgl
    from sgl_nb.tracing import load
    from sgl_nb.tui.replay import ReplaySession

    path = tmp_path / "story.jsonl"
    sgl.enable_tracing(file=path, runtime=runtime)
    try:
        load_program(f"{PROGRAM}:story").function.run(backend=runtime).wait()
    finally:
        sgl.disable_tracing()

    async def run() -> None:
        app = DebuggerApp(ReplaySession(load(path), path.name), show_timings=False)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("n", "n")  # Gen a has run
            await until(pilot, shown(pilot, "held before #3"), "the Text after Gen a")
            await pilot.press("r")
            assert app.screen is app.screen_stack[0]  # no re-run dialog in a replay
            await select(pilot, "Gen a")
            await pilot.press("w")
            assert "token 6 of 6" in app.screen.plain
            assert app.screen.plain.count("%") >= 5

    asyncio.run(run())
