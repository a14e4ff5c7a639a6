"""Replays of traces this module records with the real model (greedy, so the same every
run): stepping backwards, snapshots of the main screens, and `sgl-nb replay` in a real
terminal (tmux)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.tracing import load
from sgl_nb.tui.app import DebuggerApp
from sgl_nb.tui.program_file import load_program
from sgl_nb.tui.replay import ReplaySession

pytestmark = pytest.mark.slow

PROGRAM = Path(__file__).parent / "data" / "tui_program.py"
SIZE = (120, 40)


@pytest.fixture(scope="module")
def traces(runtime, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("traces")
    out = {}
    for name in ("story", "broken", "chat"):
        program = load_program(f"{PROGRAM}:{name}")
        _wait_idle(runtime)  # alone in its batches: the same figures every run
        runtime.flush_cache()  # the trace's cache hits must not depend on other tests
        out[name] = folder / f"{name}.jsonl"
        sgl.enable_tracing(file=out[name], runtime=runtime)
        try:
            program.function.run(backend=runtime).error()  # runs to its end
        finally:
            sgl.disable_tracing()
    return out


def _wait_idle(runtime, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while runtime.engine.scheduler.has_work():  # another test's program still running
        assert time.monotonic() < deadline, "the engine never became idle"
        time.sleep(0.1)


def replay_app(path: Path) -> DebuggerApp:
    return DebuggerApp(ReplaySession(load(path), path.name), show_timings=False)


def test_replay_steps_backwards(traces):
    async def run() -> None:
        app = replay_app(traces["story"])
        session = app.session
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.press("n", "n")
            assert app.status_text.startswith("REPLAY  held before #3 Text ' Then' (line 10)")
            assert len(session.timeline.nodes[session.rows()[1].id].tokens) == 6
            await pilot.press("N")
            assert app.status_text.startswith("REPLAY  held before #2 Gen a (line 9)")
            assert session.rows()[1].status == "pending" and "a = " not in pane(app, "state")
            await pilot.press("s", "s", "s", "s")  # the Decode, then three tokens
            assert "before token 3 of #2 Gen a" in app.status_text
            assert pane(app, "state").count("a = '") == 1
            await pilot.press("S")
            assert "before token 2 of #2 Gen a" in app.status_text
            assert len(session.timeline.nodes[session.rows()[1].id].tokens) == 1
            await pilot.press("N", "N")
            assert app.status_text.startswith("REPLAY  held before #1")
            # Before the first Node: queued ones are known, none has started.
            assert session.timeline.nodes and all(
                n.start_ns is None for n in session.timeline.nodes.values())
            await pilot.press("N")
            assert "at the first Node" in app.status_text

    asyncio.run(run())


def pane(app, name: str) -> str:
    return app.query_one(f"#{name}").plain


def test_replay_of_roles_a_select_and_a_fork(traces):
    async def run() -> None:
        app = replay_app(traces["chat"])
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.press("c")
            assert app.status_text.startswith("REPLAY  finished")
            rows = app.session.rows()
            assert [r.kind for r in rows[:7]] == ["RoleBegin", "Text", "RoleEnd", "RoleBegin",
                                                  "Select", "RoleEnd", "Fork"]
            assert sorted(r.kind for r in rows[7:11]) == ["Gen", "Gen", "Text", "Text"]
            assert {r.depth for r in rows[7:11]} == {1} and rows[11].kind == "Join"
            graph = pane(app, "graph").splitlines()
            assert all(line.startswith("    #") for line in graph[7:11])  # branches indented
            joined = {r.number for r in rows if r.kind == "Gen"}
            assert graph[11].endswith("← " + ",".join(f"#{n}" for n in sorted(joined))) or \
                graph[11].endswith("← " + ",".join(f"#{n}" for n in sorted(joined)[::-1]))
            state = pane(app, "state")
            assert "colour = " in state and "user: " in state and "assistant: " in state
            assert "(branch 0 of 2)" in state and "(branch 1 of 2)" in state
            assert pane(app, "tokens").count("⟨#") == 2

    asyncio.run(run())


def test_snapshot_replay_start(traces, snap_compare):
    assert snap_compare(replay_app(traces["story"]), terminal_size=SIZE)


def test_snapshot_replay_inside_a_gen(traces, snap_compare):
    # before #2, its Decode, two tokens: held before the Gen's third token
    assert snap_compare(replay_app(traces["story"]), press=["n", "s", "s", "s", "s"],
                        terminal_size=SIZE)


def test_snapshot_replay_of_a_failed_program(traces, snap_compare):
    assert snap_compare(replay_app(traces["broken"]), press=["c"], terminal_size=SIZE)


def test_snapshot_replay_of_fork_lanes(traces, snap_compare):
    # held before branch 1's Gen: a lane per branch in the Tokens pane, branch 0's Nodes
    # before branch 1's under the Fork
    def before_branch_1_gen(pilot) -> None:
        s = pilot.app.session
        while not s.position().finished:
            row = next((r for r in s.rows() if r.id == s.position().node), None)
            if row is not None and (row.kind, row.branch) == ("Gen", 1) \
                    and s.position().where == "node":
                break
            pilot.app.action_next_node()

    assert snap_compare(replay_app(traces["chat"]), run_before=before_branch_1_gen,
                        terminal_size=SIZE)


def _tmux_or_skip() -> str:
    tmux = shutil.which("tmux")
    if tmux is None:
        if os.environ.get("SGL_NB_CI") == "1" or os.environ.get("CI") == "true":
            pytest.fail("tmux is missing: `make test` installs it (make tmux)")
        pytest.skip("tmux is not installed (make tmux installs it)")
    return tmux


def test_replay_in_a_real_terminal(traces, tmp_path):
    tmux = [_tmux_or_skip(), "-L", f"sgl-nb-test-{os.getpid()}"]  # a server of our own
    cli = Path(sys.executable).with_name("sgl-nb")
    # COLUMNS/LINES, when a shell exported them, would override the pane's real size.
    # The pane stays after the exit (until kill-server below) so its last line can be read.
    command = (f"env -u COLUMNS -u LINES {cli} replay {traces['story']} --no-timings; "
               "echo sgl-nb exited $?; sleep infinity")
    subprocess.run([*tmux, "new-session", "-d", "-s", "dbg", "-x", str(SIZE[0]),
                    "-y", str(SIZE[1]), command], check=True)
    try:
        screen = wait_for(tmux, "q Quit")  # the footer: drawn last
        assert "REPLAY  held before #1" in screen and "Source · tui_program.py" in screen
        assert "n Next node" in screen
        assert "N Back node" in screen and "S Back instruction" in screen
        keys(tmux, "n")
        wait_for(tmux, "REPLAY  held before #2 Gen a (line 9)")
        keys(tmux, "n")
        screen = wait_for(tmux, "REPLAY  held before #3 Text ' Then' (line 10)")
        assert "a = '" in screen and "Tokens · 6 generated" in screen
        keys(tmux, "N")  # shift+n in a terminal
        screen = wait_for(tmux, "REPLAY  held before #2 Gen a (line 9)  ·  previous Node")
        assert "Tokens · 0 generated" in screen
        keys(tmux, "q")
        wait_for(tmux, "sgl-nb exited 0")
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)


def keys(tmux: list[str], *k: str) -> None:
    subprocess.run([*tmux, "send-keys", "-t", "dbg", *k], check=True)


def wait_for(tmux: list[str], text: str, timeout: float = WAIT) -> str:
    """The pane's text once it shows `text` (a guard against hanging, not a speed check)."""
    deadline = time.monotonic() + timeout
    while True:
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "dbg"], check=True,
                                capture_output=True, text=True).stdout
        if text in screen:
            return screen
        if time.monotonic() > deadline:
            size = subprocess.run([*tmux, "display", "-p", "-t", "dbg",
                                   "#{window_width}x#{window_height}"],
                                  capture_output=True, text=True).stdout
            raise AssertionError(f"the terminal ({size.strip()}) never showed {text!r}; "
                                 f"it shows:\n{screen}")
        time.sleep(0.2)
