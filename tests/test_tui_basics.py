"""The terminal debugger without the model: loading a program file, its arguments, the
CLI's errors, and the replay cursor over hand-made events driven through the real app."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from sgl_nb.cli import main
from sgl_nb.runtime.events import (
    CacheHit,
    Event,
    InstructionFinished,
    InstructionStarted,
    NodeFinished,
    NodeKind,
    NodeStarted,
    Op,
    ProgramFinished,
    ProgramStarted,
    Token,
)
from sgl_nb.tracing.timeline import Timeline
from sgl_nb.tui.app import DebuggerApp
from sgl_nb.tui.program_file import load_program, parse_args, split_target
from sgl_nb.tui.replay import ReplaySession

PROGRAM = Path(__file__).parent / "data" / "tui_program.py"


def test_split_target():
    assert split_target("a/prog.py:story") == (Path("a/prog.py"), "story")
    assert split_target("prog.py") == (Path("prog.py"), None)


def test_parse_args_literals_and_strings():
    assert parse_args(["n=3", "xs=[1, 2]", "topic=a dragon", "q='hi'"]) == {
        "n": 3, "xs": [1, 2], "topic": "a dragon", "q": "hi"}
    with pytest.raises(ValueError, match="key=value"):
        parse_args(["novalue"])


def test_load_program_picks_the_function_and_checks_arguments():
    prog = load_program(f"{PROGRAM}:story", ["topic=a forest"])
    assert prog.name == "story" and prog.args == {"topic": "a forest"}
    with pytest.raises(ValueError, match="4 @sgl.function programs.*broken, chat, long_st"):
        load_program(str(PROGRAM))
    with pytest.raises(ValueError, match="no @sgl.function named 'nope'"):
        load_program(f"{PROGRAM}:nope")
    with pytest.raises(ValueError, match=r"no argument\(s\) \['colour'\]"):
        load_program(f"{PROGRAM}:story", ["colour=red"])
    with pytest.raises(ValueError, match="no such program file"):
        load_program("does/not/exist.py:story")


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert main(["debug", f"{PROGRAM}:nope"]) == 2
    assert "no @sgl.function named 'nope'" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such trace file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"resourceSpans": []}\n')
    assert main(["replay", str(bad)]) == 2
    assert "no sgl-nb spans" in capsys.readouterr().err


def _events() -> list[Event]:
    """A program of a Text and a Gen of two tokens, as the runtime reports it."""
    text, gen = {"program": 7, "node": 70}, {"program": 7, "node": 71}
    ev = [
        ProgramStarted(program=7, function="tiny"),
        NodeStarted(**text, node_kind=NodeKind.TEXT, label="Text 'Hi'", line=3),
        InstructionStarted(**text, op=Op.EXTEND),
        InstructionFinished(**text, op=Op.EXTEND),
        NodeFinished(**text, text="Hi"),
        NodeStarted(**gen, node_kind=NodeKind.GEN, name="x", label="Gen x", line=4,
                    preds=(70,)),
        InstructionStarted(**gen, request=5, op=Op.DECODE),
        CacheHit(**gen, request=5, cached_tokens=0, prompt_tokens=1),
        Token(**gen, request=5, token=1, text=" there"),
        Token(**gen, request=5, token=2, text="!"),
        InstructionFinished(**gen, request=5, op=Op.DECODE),
        NodeFinished(**gen),
        ProgramFinished(program=7),
    ]
    return [replace(e, seq=i) for i, e in enumerate(ev, 1)]


def test_replay_cursor_forward_and_back():
    s = ReplaySession(Timeline(_events()), "tiny.jsonl")
    assert (s.position().where, s.position().node) == ("node", 70)
    assert s.timeline.nodes == {}  # before the first Node: nothing has run
    s.next_node()
    assert (s.position().where, s.position().node) == ("node", 71)
    s.next_instruction(), s.next_instruction(), s.next_instruction()
    assert s.position().where == "decode" and len(s.timeline.nodes[71].tokens) == 1
    s.back_instruction()
    assert s.position().where == "decode" and s.timeline.nodes[71].tokens == []
    s.back_node()
    assert s.position() == s.position().__class__("node", 71)
    s.back_node()
    assert s.position().node == 70 and s.back_node() == "at the first Node"
    assert s.continue_() == "end" and s.position().where == "done"
    assert len(s.timeline.events) == 13


def test_replay_app_keys_and_breakpoint():
    async def run() -> None:
        s = ReplaySession(Timeline(_events()), "tiny.jsonl")
        app = DebuggerApp(s, show_timings=False)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            assert app.status_text.startswith("REPLAY  held before #1 Text 'Hi'")
            await pilot.press("down", "b")  # a breakpoint on the Gen
            assert "breakpoint set: Gen x" in app.status_text
            await pilot.press("c")
            assert app.status_text.startswith("REPLAY  held before #2 Gen x (line 4)")
            await pilot.press("s", "s", "s")
            assert "before token 2 of #2 Gen x" in app.status_text
            assert "⟨#2 x⟩ there" in app.query_one("#tokens").plain
            await pilot.press("S", "N")  # back to the start of this Node, then the one before
            assert app.status_text.startswith("REPLAY  held before #2")
            await pilot.press("N")
            assert app.status_text.startswith("REPLAY  held before #1")
            await pilot.press("c")
            assert app.status_text.startswith("REPLAY  held before #2")  # the breakpoint
            await pilot.press("b", "c")  # cleared: runs to the end
            assert app.status_text.startswith("REPLAY  finished")
            assert "x = ' there!'" in app.query_one("#state").plain
            await pilot.press("p")
            assert "nothing runs in a replay" in app.status_text
            await pilot.press("q")
        assert not app.is_running

    asyncio.run(run())
