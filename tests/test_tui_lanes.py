"""Fork branches in lanes (#19): the Tokens pane shows each branch's text in a lane of its
own under the fork point (branch 0 first), and the Nodes pane lists branch 0's Nodes before
branch 1's, nested under their Fork, however the branches' events interleaved. Hand-made
events (branch 1 runs first), then the real model live and from a recorded trace."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
from support.waits import WAIT
from textual.geometry import Region

import sgl_nb as sgl
from sgl_nb.runtime.events import (
    Event,
    Forked,
    NodeFinished,
    NodeKind,
    NodeStarted,
    ProgramFinished,
    ProgramStarted,
    Token,
)
from sgl_nb.tracing import load
from sgl_nb.tracing.timeline import Timeline, fork_children
from sgl_nb.tui.app import DebuggerApp
from sgl_nb.tui.live import LiveSession
from sgl_nb.tui.program_file import load_program
from sgl_nb.tui.replay import ReplaySession
from sgl_nb.tui.rows import Position
from sgl_nb.tui.tokens_pane import Lane, _plain, _visible

SIZE = (120, 60)
N_BRANCHES = 3

SOURCE = f'''
import sgl_nb as sgl


@sgl.function
def ideas(s):
    s += "Three ideas for a party."
    forks = s.fork({N_BRANCHES})
    for i, f in enumerate(forks):
        f += f" Idea {{i}}:" + sgl.gen("idea", max_tokens=8, ignore_eos=True)
    forks.join()
    s += " The end."
'''


# ---- what the panes show -------------------------------------------------------------------

def lanes(app) -> list[Lane]:
    return [b for b in app.query_one("#tokens").blocks if isinstance(b, Lane)]


def lane_text(lane: Lane) -> str:
    """A lane's own text: its runs, without the lane's frame."""
    return "\n".join(_plain(b) for b in lane.blocks)


def screen_lanes(app) -> tuple[list[str], dict[str, str]]:
    """The Tokens pane as the app draws it (every line of its content, scrolled or not),
    and each lane's inside as drawn: the lines between its box's top and bottom, without
    the frame."""
    static = app.query_one("#tokens-text")
    width, height = static.size
    lines = [s.text for s in static.render_lines(Region(0, 0, width, height))]
    inside: dict[str, str] = {}
    label = None
    for line in lines:
        if line.startswith("╭─ branch "):
            label = line[3:].split(" ─")[0].strip()
            inside[label] = ""
        elif line.startswith("╰"):
            label = None
        elif label is not None:
            inside[label] += line.strip()[1:-1]  # between │ and │
    return lines, inside


def squash(s: str) -> str:
    """Without whitespace: a lane's text wraps where the pane is narrow."""
    return "".join(s.split())


def check_lanes(app, rows, ideas: list[str], texts: dict[int, str],
                before: str = "Three ideas for a party.", after: str = " The end.") -> None:
    """The finished run: one lane per branch in branch order, each exactly its branch's
    Text and Gen, the parent's text before the lanes and after them."""
    numbers = {r.id: r.number for r in rows}
    gens = [r for r in rows if r.kind == "Gen"]
    assert [g.branch for g in gens] == list(range(len(ideas)))
    got = lanes(app)
    assert [lane.label for lane in got] == [f"branch {i}" for i in range(len(ideas))]
    for i, (lane, idea) in enumerate(zip(got, ideas)):
        want = f" Idea {i}:\n⟨#{numbers[gens[i].id]} idea⟩{_visible(idea)}"
        assert lane_text(lane) == want, f"lane {i}"
        assert texts[gens[i].id] == idea  # the lane's Gen is the branch's: state["idea"][i]
    plain = app.query_one("#tokens").plain
    starts = [plain.index(f"╭─ branch {i}\n") for i in range(len(ideas))]
    assert starts == sorted(starts)  # branch 0's lane wholly before branch 1's
    for i, start in enumerate(starts):
        end = plain.index("╰─", start)
        assert end < (starts[i + 1] if i + 1 < len(starts) else len(plain))
        body = plain[start:end]
        assert all(f"Idea {j}:" not in body for j in range(len(ideas)) if j != i)
    assert plain.startswith(before) and plain.index(before) < starts[0]
    assert plain.rindex("╰─") < plain.index(after) and plain.endswith(after)
    state = app.query_one("#state").plain  # the variables name the same branches
    for i, idea in enumerate(ideas):
        assert f"idea = {idea!r} (branch {i} of {len(ideas)})" in state
    # What the pane draws: the boxes in branch order, each holding its branch's text only.
    lines, inside = screen_lanes(app)
    titles = [k for k, line in enumerate(lines) if line.startswith("╭─ branch ")]
    assert [lines[k][3:11] for k in titles] == [f"branch {i}" for i in range(len(ideas))]
    for i, idea in enumerate(ideas):
        want = f" Idea {i}:⟨#{numbers[gens[i].id]} idea⟩{_visible(idea)}"
        assert squash(inside[f"branch {i}"]) == squash(want), f"drawn lane {i}"


def check_rows(rows) -> None:
    """The Nodes: the Fork, then branch 0's Nodes, branch 1's, ..., then the Join; every
    branch row nested one level under the Fork; numbered in that order."""
    kinds = [r.kind for r in rows]
    fork, join = kinds.index("Fork"), kinds.index("Join")
    branch_rows = rows[fork + 1:join]
    assert [r.branch for r in branch_rows] == sorted(r.branch for r in branch_rows)
    assert [r.kind for r in branch_rows] == ["Text", "Gen"] * (len(branch_rows) // 2)
    assert {r.depth for r in branch_rows} == {1}
    assert len({r.program for r in branch_rows}) == len(branch_rows) // 2
    assert all(r.branch is None and r.depth == 0 for r in rows[:fork + 1] + rows[join:])
    assert [r.number for r in rows] == list(range(1, len(rows) + 1))


def check_graph(app, rows) -> None:
    graph = app.query_one("#graph").plain.splitlines()
    assert len(graph) == len(rows)
    for line, r in zip(graph, rows):
        assert f"#{r.number:<3}" in line
        if r.branch is not None:
            assert line[2:].startswith("  " * r.depth + "#")  # indented under its Fork
            assert f" b{r.branch}" in line


def check_current(app) -> None:
    """The status line and the Nodes pane name the same row: numbering stays consistent."""
    graph = app.query_one("#graph").plain.splitlines()
    here = [line for line in graph if line[1:2] == "▶"]
    assert len(here) <= 1
    where = app.status_text.split("  ·  ")[0]  # "held before #5 …", "before token 2 of #4 …"
    if here and "#" in where:
        number = int(here[0].split("#")[1].split()[0])
        assert f"#{number} " in where


# ---- hand-made events: branch 1 starts and decodes first -----------------------------------

def _numbered(events: list[Event]) -> list[Event]:
    return [replace(e, seq=seq) for seq, e in enumerate(events, 1)]


def _fork_events() -> list[Event]:
    def node(program, nid, kind, label, name=None, preds=()):
        return NodeStarted(program=program, node=nid, node_kind=kind, label=label, name=name,
                           line=3, preds=tuple(preds))

    def done(program, nid, text=None):
        return NodeFinished(program=program, node=nid, text=text)

    def start(program, fork, function):
        return ProgramStarted(program=program, node=fork, function=function, parent=1)

    out = [
        ProgramStarted(program=1, function="ideas"),
        node(1, 10, NodeKind.TEXT, "Text 'Q:'"), done(1, 10, "Q:"),
        node(1, 11, NodeKind.FORK, "Fork n=2", preds=[10]),
        Forked(program=1, node=11, n=2, children=(2, 3)),
        start(3, 11, "branch 1"), start(2, 11, "branch 0"),
        done(1, 11),
        node(3, 31, NodeKind.TEXT, "Text ' Idea 1:'", preds=[11]), done(3, 31, " Idea 1:"),
        node(2, 21, NodeKind.TEXT, "Text ' Idea 0:'", preds=[11]), done(2, 21, " Idea 0:"),
        node(3, 32, NodeKind.GEN, "Gen idea", name="idea", preds=[31]),
        node(2, 22, NodeKind.GEN, "Gen idea", name="idea", preds=[21]),
    ]
    for k in range(3):
        out += [Token(program=3, node=32, token=k, text=f" b{k}"),
                Token(program=2, node=22, token=k, text=f" a{k}")]
    out += [done(3, 32), done(2, 22),
            node(1, 12, NodeKind.JOIN, "Join mode=gather_variable", preds=[22, 32]),
            done(1, 12),
            node(1, 13, NodeKind.TEXT, "Text ' The end.'", preds=[12]), done(1, 13, " The end."),
            ProgramFinished(program=3), ProgramFinished(program=2), ProgramFinished(program=1)]
    return _numbered(out)


def test_fork_children_in_branch_order():
    tl = Timeline(_fork_events())
    assert fork_children(tl.events) == tl.fork_children() == {11: [2, 3]}
    assert Timeline().fork_children() == {}


def test_lanes_and_rows_of_hand_made_events():
    async def run() -> None:
        session = ReplaySession(Timeline(_fork_events()), "ideas.jsonl")
        app = DebuggerApp(session, show_timings=False)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            order = [r.id for r in session.rows()]
            assert order == [10, 11, 21, 22, 31, 32, 12, 13]  # not the start order
            seen_nodes = set()
            while not session.position().finished:  # every stop: same rows, same numbers
                rows = session.rows()
                assert [r.id for r in rows] == order
                check_rows(rows)
                check_graph(app, rows)
                check_current(app)
                got = lanes(app)
                if got:
                    assert [lane.label for lane in got] == ["branch 0", "branch 1"]
                    assert " b" not in lane_text(got[0]) and " a" not in lane_text(got[1])
                seen_nodes.add(session.position().node)
                await pilot.press("s")
            assert seen_nodes >= {21, 22, 31, 32}
            rows = session.rows()
            texts = {22: " a0 a1 a2", 32: " b0 b1 b2"}
            check_lanes(app, rows, [" a0 a1 a2", " b0 b1 b2"], texts, "Q:", " The end.")
            assert app.query_one("#tokens").plain == (
                "Q:\n╭─ branch 0\n│  Idea 0:\n│ ⟨#4 idea⟩ a0 a1 a2\n╰─\n"
                "╭─ branch 1\n│  Idea 1:\n│ ⟨#6 idea⟩ b0 b1 b2\n╰─\n The end.")

    asyncio.run(run())


def test_decode_cursor_in_its_lane():
    async def run() -> None:
        session = ReplaySession(Timeline(_fork_events()), "ideas.jsonl")
        app = DebuggerApp(session, show_timings=False)
        async with app.run_test(size=(120, 20)) as pilot:  # more lines than the pane has
            await pilot.pause()
            for _ in range(40):  # by Instruction to the stop before branch 0's 2nd token
                if (session.position() == Position("decode", 22)
                        and len(session.timeline.nodes[22].tokens) == 1):
                    break
                await pilot.press("s")
            assert "before token 2 of #4 Gen idea" in app.status_text
            b0, b1 = lanes(app)
            assert b0.current and not b1.current
            assert lane_text(b0).endswith("⟨#4 idea⟩ a0▮") and "▮" not in lane_text(b1)
            await pilot.pause()
            pane = app.query_one("#tokens")
            lines, _ = screen_lanes(app)
            assert lines[1].startswith("╭─ ▶ branch 0 ─") and lines[5].startswith("╭─ branch 1")
            cursor = next(k for k, line in enumerate(lines) if "▮" in line)
            view = pane.scrollable_content_region.height
            assert len(lines) > view  # the end of the stream alone would hide the ▮ ...
            assert pane.scroll_y <= cursor < pane.scroll_y + view  # ... which is in view

    asyncio.run(run())


def _nested_events() -> list[Event]:
    """Branch 0 forks again; branch 1 starts first; then a second Fork of one branch."""
    def node(program, nid, kind, text=None, preds=()):
        return [NodeStarted(program=program, node=nid, node_kind=kind, label=kind.value,
                            name="g", line=1, preds=tuple(preds)),
                NodeFinished(program=program, node=nid, text=text)]

    def gen(program, nid, token):
        return [NodeStarted(program=program, node=nid, node_kind=NodeKind.GEN, label="Gen g",
                            name="g", line=1),
                Token(program=program, node=nid, token=1, text=token),
                NodeFinished(program=program, node=nid)]

    def fork(program, nid, children):
        return Forked(program=program, node=nid, children=tuple(children))

    def start(program, fork):
        return ProgramStarted(program=program, node=fork, parent=1)

    text, fork_kind, join = NodeKind.TEXT, NodeKind.FORK, NodeKind.JOIN
    out = [ProgramStarted(program=1, function="nested"), *node(1, 10, text, "T"),
           *node(1, 11, fork_kind), fork(1, 11, [2, 3]), start(2, 11), start(3, 11),
           *gen(3, 31, "z"), *node(2, 21, text, "U"), *node(2, 22, fork_kind),
           fork(2, 22, [4, 5]), *gen(5, 51, "y"), *gen(4, 41, "x"),
           *node(2, 23, join), *node(1, 12, join), *node(1, 13, fork_kind),
           fork(1, 13, [6]), *gen(6, 61, "w"), *node(1, 14, join),
           ProgramFinished(program=1)]
    return _numbered(out)


def test_nested_forks_and_a_second_fork():
    async def run() -> None:
        session = ReplaySession(Timeline(_nested_events()), "nested.jsonl")
        app = DebuggerApp(session, show_timings=False)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("c")
            assert app.status_text.startswith("REPLAY  finished")
            rows = session.rows()
            assert [(r.id, r.depth, r.branch) for r in rows] == [
                (10, 0, None), (11, 0, None), (21, 1, 0), (22, 1, 0), (41, 2, 0), (51, 2, 1),
                (23, 1, 0), (31, 1, 1), (12, 0, None), (13, 0, None), (61, 1, 0),
                (14, 0, None)]
            check_graph(app, rows)
            assert app.query_one("#tokens").plain == (
                "T\n"
                "╭─ branch 0\n│ U\n"
                "│ ╭─ branch 0\n│ │ ⟨#5 g⟩x\n│ ╰─\n"
                "│ ╭─ branch 1\n│ │ ⟨#6 g⟩y\n│ ╰─\n"
                "╰─\n"
                "╭─ branch 1\n│ ⟨#8 g⟩z\n╰─\n"
                "╭─ branch 0\n│ ⟨#11 g⟩w\n╰─")
            lines, _ = screen_lanes(app)
            drawn = [line.strip() for line in lines]
            assert drawn[0] == "T" and drawn[1].startswith("╭─ branch 0 ─")
            assert drawn[3].startswith("│ ╭─ branch 0 ─") and "⟨#5 g⟩x" in drawn[4]

    asyncio.run(run())


# ---- the real model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def program_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lanes") / "ideas.py"
    path.write_text(SOURCE)
    return path


async def until(pilot, cond, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw: {what}; status: {pilot.app.status_text!r}")
        await pilot.pause(0.05)


def held_after(session, events: int) -> bool:
    """Something ran since the timeline held `events` events, and the program is held
    again (or finished), not merely running on."""
    now = session.position()
    ran = len(session.timeline.events) > events
    return now.finished or (ran and now.where in ("node", "decode"))


def _node_texts(tl: Timeline) -> dict[int, str]:
    return {nid: "".join(t.text for t in n.tokens) for nid, n in tl.nodes.items()}


@pytest.mark.slow
def test_lanes_live(runtime, program_file):
    session = LiveSession(load_program(f"{program_file}:ideas"), runtime)

    async def run() -> None:
        app = DebuggerApp(session, show_timings=False)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: "LIVE  held before #1" in app.status_text, "the hold")
            held_in_branches = 0
            for _ in range(6):  # by Node: the Text, the Fork, then into the branches
                app.refresh_panes(force=True)
                check_current(app)
                got = lanes(app)
                assert [lane.label for lane in got] == [f"branch {i}" for i in range(len(got))]
                assert sum(lane.current for lane in got) <= 1
                held_in_branches += any(lane.current for lane in got)
                seen = len(session.timeline.events)
                await pilot.press("n")
                await until(pilot, lambda k=seen: held_after(session, k), "the next hold")
                if session.position().finished:
                    break
            # One controller holds all the branches, which run side by side: which branch
            # takes a step is the runtime's choice, so only some steps are checked here.
            assert held_in_branches >= 1
            # One continue runs to the end, though a step granted to one branch may still
            # be running when another was the one held.
            await pilot.press("c")
            await until(pilot, lambda: "LIVE  finished" in app.status_text, "the end")
            app.refresh_panes(force=True)
            await pilot.pause()
            rows = session.rows()
            check_rows(rows)
            check_graph(app, rows)
            check_lanes(app, rows, session.state["idea"], _node_texts(session.timeline))
            await pilot.press("q")

    try:
        asyncio.run(run())
    finally:
        session.close(release=True)
        session.state.error()


@pytest.mark.slow
def test_lanes_replayed(runtime, program_file, tmp_path):
    program = load_program(f"{program_file}:ideas")
    trace = tmp_path / "ideas.jsonl"
    sgl.enable_tracing(file=trace, runtime=runtime)
    try:
        state = program.function.run(backend=runtime)
        assert state.error() is None
    finally:
        sgl.disable_tracing()
    ideas = state["idea"]
    assert len(ideas) == N_BRANCHES

    async def run() -> None:
        session = ReplaySession(load(trace), trace.name)
        app = DebuggerApp(session, show_timings=False)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            order = [r.id for r in session.rows()]
            while not session.position().finished:  # every stop: the rows keep their place
                rows = session.rows()
                assert [r.id for r in rows] == order
                check_current(app)
                for i, lane in enumerate(lanes(app)):  # each lane: a start of its branch
                    assert lane.label == f"branch {i}"
                    assert all(f"Idea {j}:" not in lane_text(lane)
                               for j in range(N_BRANCHES) if j != i)
                await pilot.press("s")
            rows = session.rows()
            check_rows(rows)
            check_graph(app, rows)
            check_lanes(app, rows, ideas, _node_texts(session.timeline))

    asyncio.run(run())
