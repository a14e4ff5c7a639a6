"""The debugger app: source, Node graph with Instructions, state, tokens and radix cache,
driven by pdb-like keys over a live run or a replay (a Session)."""

from __future__ import annotations

import threading

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Footer, Header, Static

from sgl_nb.language.rerun import EDITABLE
from sgl_nb.runtime.events import Event
from sgl_nb.runtime.status import Status
from sgl_nb.tui.cache_pane import CachePane
from sgl_nb.tui.graph_pane import GraphPane
from sgl_nb.tui.rerun_screens import DIALOG_CSS, RerunScreen, TokenScreen
from sgl_nb.tui.rows import NodeRow, Position, Where
from sgl_nb.tui.session import Session
from sgl_nb.tui.source_pane import SourcePane
from sgl_nb.tui.state_pane import StatePane
from sgl_nb.tui.tokens_pane import TokensPane

POLL_S = 0.1  # how often a live app looks at the step controller (held or not)
CACHE_TREE_S = 0.25  # the live radix tree is re-read at most this often


class EventBatch(Message):
    """Runtime events for the app, posted by the live session's worker thread."""

    def __init__(self, events: list[Event]):
        super().__init__()
        self.events = events


class DebuggerApp(App):
    TITLE = "sgl-nb"
    ENABLE_COMMAND_PALETTE = False
    CSS = DIALOG_CSS + """
    #status { height: 1; padding: 0 1; background: $boost; }
    #top { height: 3fr; }
    #bottom { height: 2fr; }
    .pane { border: round $primary-darken-1; border-title-color: $text; }
    .pane:focus-within { border: round $accent; }
    #source { width: 4fr; }
    #source-text, #cache-text { text-wrap: nowrap; text-overflow: ellipsis; }
    #graph { width: 3fr; }
    #state { width: 4fr; }
    #tokens { width: 3fr; }
    #cache { width: 2fr; }
    #nodes { height: 1fr; border: none; padding: 0; }
    #instructions { height: auto; max-height: 9; border-top: solid $primary-darken-2; }
    """
    BINDINGS = [
        Binding("n", "next_node", "Next node"),
        Binding("s", "next_instruction", "Step instruction"),
        Binding("c", "continue", "Continue"),
        Binding("p", "pause", "Pause"),
        Binding("b", "breakpoint", "Break"),
        Binding("x", "cancel", "Cancel program"),
        Binding("r", "rerun", "Re-run"),  # from the selected Node, with an edit
        Binding("w", "why_token", "Why token"),  # the selected Node's tokens, alternatives
        Binding("q", "quit", "Quit"),
        Binding("N", "back_node", "Back node"),
        Binding("S", "back_instruction", "Back instruction"),
    ]

    def __init__(self, session: Session, show_timings: bool = True):
        super().__init__()
        self.session = session
        self.show_timings = show_timings
        self.message = ""  # the last control's answer, shown in the status line
        self.status_text = ""  # the status line as plain text (tests read it)
        self._stop = threading.Event()
        self._shown: tuple | None = None  # what the panes show, to skip needless redraws
        self._tree_events = -1

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="status")
        with Horizontal(id="top"):
            yield SourcePane(id="source", classes="pane")
            yield GraphPane(id="graph", classes="pane")
            yield StatePane(show_timings=self.show_timings, id="state", classes="pane")
        with Horizontal(id="bottom"):
            yield TokensPane(id="tokens", classes="pane")
            yield CachePane(id="cache", classes="pane")
        yield Footer()

    def on_mount(self) -> None:
        self.title = self.session.title
        self.sub_title = self.session.mode
        self.query_one("#nodes").focus()
        if self.session.mode == "live":
            self._start_pump()
            self.set_interval(POLL_S, self.refresh_panes)
            self.set_interval(CACHE_TREE_S, self._refresh_cache)
        self.refresh_panes(force=True)
        self._refresh_cache()
        self.call_after_refresh(self.refresh_panes, True)  # again, now that panes have sizes

    def _start_pump(self) -> None:
        pump, stop = self.session.pump, self._stop  # type: ignore[attr-defined]
        self.run_worker(lambda: pump(self._post_events, stop), thread=True, name="events",
                        exit_on_error=False)

    def on_resize(self) -> None:
        self.call_after_refresh(self.refresh_panes, True)

    def on_unmount(self) -> None:
        self._stop.set()
        close = getattr(self.session, "close", None)
        if close is not None:
            close()

    def _post_events(self, events: list[Event]) -> None:
        self.post_message(EventBatch(events))  # thread-safe: the worker runs off the loop

    def on_event_batch(self, message: EventBatch) -> None:
        if self.session.apply(message.events):  # type: ignore[attr-defined]
            self.refresh_panes()

    # ---- drawing -----------------------------------------------------------------------

    def refresh_panes(self, force: bool = False) -> None:
        s = self.session
        position = s.position()
        key = (position, len(s.timeline.events), len(s.breakpoints), self.message)
        if key == self._shown and not force:
            return
        self._shown = key
        rows = s.rows()
        current = next((r for r in rows if r.id == position.node), None)
        where = describe(position, current)
        self.status_text = f"{s.mode.upper()}  {where}" + (
            f"  ·  {self.message}" if self.message else "")
        self.query_one("#status", Static).update(Text(self.status_text))  # not markup
        bp_lines = {r.line for r in rows if r.line and any(bp.hits(r) for bp in s.breakpoints)}
        error_line = s.error_line() if position.where is Where.ERROR or _failed(s) else None
        self.query_one(SourcePane).show(s.source_file(), current.line if current else None,
                                        bp_lines, error_line)
        self.query_one(GraphPane).show(rows, position, s.breakpoints)
        self.query_one(TokensPane).show(s.timeline, rows, position)
        self.query_one(StatePane).show(s.timeline, s.root_program(), rows, position, where,
                                       error_line)
        if s.mode == "replay":
            self.query_one(CachePane).show(s.timeline, rows, None)

    def _refresh_cache(self) -> None:
        s = self.session
        if s.mode == "replay":
            return
        changes = len(s.timeline.cache_events) + s.timeline.cache_tree.changes
        if changes != self._tree_events:  # the tree only changes with a cache event
            self._tree_events = changes
            self.query_one(CachePane).show(s.timeline, s.rows(), s.cache_tree())

    # ---- keys --------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action in ("back_node", "back_instruction"):
            return self.session.mode == "replay"  # hidden in a live run
        if action in ("cancel", "rerun"):
            return self.session.mode == "live"  # nothing runs in a replay
        return True

    def _did(self, message: str) -> None:
        self.message = message
        self.refresh_panes()

    def action_next_node(self) -> None:
        self._did(self.session.next_node())

    def action_next_instruction(self) -> None:
        self._did(self.session.next_instruction())

    def action_continue(self) -> None:
        self._did(self.session.continue_())

    def action_pause(self) -> None:
        self._did(self.session.pause())

    def action_cancel(self) -> None:
        self._did(self.session.cancel())

    def action_back_node(self) -> None:
        self._did(self.session.back_node())

    def action_back_instruction(self) -> None:
        self._did(self.session.back_instruction())

    def action_rerun(self) -> None:
        row = self.query_one(GraphPane).selected_row()
        if row is None or row.kind not in EDITABLE:
            self._did("select a gen, a select or a text Node to re-run from")
            return
        node = self.session.timeline.nodes.get(row.id)
        current = node.text if node is not None and node.text is not None else ""
        self.push_screen(RerunScreen(row, current), lambda edit: self._rerun(row, edit))

    def _rerun(self, row: NodeRow, edit) -> None:
        if edit is None:
            return
        try:
            session = self.session.rerun(row, *edit)  # type: ignore[attr-defined]
        except (TypeError, ValueError, KeyError) as e:
            self._did(f"cannot re-run: {e}")
            return
        self._stop.set()
        self.session.close(release=True)  # type: ignore[attr-defined]
        self.session, self._stop, self._shown = session, threading.Event(), None
        self._start_pump()
        self._did(f"re-run from #{row.number} {row.label}: what came before is replayed")

    def action_why_token(self) -> None:
        row = self.query_one(GraphPane).selected_row()
        node = self.session.timeline.nodes.get(row.id) if row is not None else None
        if node is None or not node.tokens:
            self._did("select a Node that generated tokens")
            return
        self.push_screen(TokenScreen(row, node.tokens))

    def action_breakpoint(self) -> None:
        row = self.query_one(GraphPane).selected_row()
        self._did("select a Node first" if row is None else self.session.toggle_breakpoint(row))


def _failed(s: Session) -> bool:
    root = s.root_program()
    p = s.timeline.programs.get(root) if root is not None else None
    return p is not None and p.status is Status.ERROR


def describe(position: Position, row: NodeRow | None) -> str:
    """Where the program stands, in words (the status line and the state pane)."""
    node = f"#{row.number} {row.label}" if row else "a Node"
    line = f" (line {row.line})" if row and row.line else ""
    return {
        Where.START: "starting",
        Where.NODE: f"held before {node}{line}",
        Where.INSTRUCTION: f"before an Instruction of {node}{line}",
        Where.DECODE: f"before token {row.tokens + 1 if row else '?'} of {node}{line}",
        Where.RUNNING: f"running {node}{line}" if row else "running",
        Where.DONE: "finished",
        Where.ERROR: "failed",
        Where.CANCELLED: "cancelled",
    }.get(position.where, position.where.value)
