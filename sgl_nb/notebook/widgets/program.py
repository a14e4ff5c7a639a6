"""The widget a `%%sgl` cell shows: its stream view, its stepper and the cache tree, all fed
from one subscription to the runtime's events, folded into one Timeline. What it shows comes
from that Timeline alone (a replay's events render the same); the program's state is used
for its controls only (Stop, the step buttons, Re-run).

Create it (it subscribes) before the program starts, `attach(state)` once the program runs;
its pump thread then renders at most ~30 times a second and stops after the program ends,
leaving the final state in the traits. `sync()` folds and renders now (headless use, tests).

Beside the stream: the Variables panel (variables.py) and the Call stack panel
(call_stack.py); the stepper lists each Node with its timing (timing.py). A click on a
token (the stream view's `clicked_node`) selects the Node that produced it and shows its
line. `show()` displays it with a static `text/html` copy for viewers that run no widgets
(static_view.py), brought up to date when the program ends.

Time travel (rerun_panel.py): a click on a generated token asks for its alternatives ("why
this token"), answered to the stream view alone; a Node the user selects in the stepper (or
through a token) opens the "Re-run from here" panel under the tabs, where each re-run
shows as a ProgramWidget of its own with its diff against this run.
"""

from __future__ import annotations

import html
import linecache
import threading
import time

import ipywidgets as W
from traitlets import Int, Unicode

from sgl_nb.notebook.widgets.cache_tree import CacheTreeView
from sgl_nb.notebook.widgets.call_stack import CallStackPanel, frames_of
from sgl_nb.notebook.widgets.rerun_panel import RerunPanel, why_reply
from sgl_nb.notebook.widgets.static_view import static_html, stop_after_cell
from sgl_nb.notebook.widgets.stepper import StepperView, graph_rows, source_line
from sgl_nb.notebook.widgets.stream import StreamView
from sgl_nb.notebook.widgets.stream_model import StreamModel
from sgl_nb.notebook.widgets.throttle import EventPump, PumpedView, held
from sgl_nb.notebook.widgets.timing import Timings
from sgl_nb.notebook.widgets.variables import VariablesPanel, variables_of
from sgl_nb.runtime.events import CACHE_EVENTS, TREE_EVENTS, Event, Forked
from sgl_nb.tracing.cache_tree import CacheTree, snapshot_events
from sgl_nb.tracing.timeline import Family, Timeline

# While tokens stream, the views beside the stream (stepper, cache tree, variables, call
# stack) refresh at most this often, and at once when a Node's status changes, the program
# is held or it ends: a token changes their counts only, and a message per view per render
# would exceed the 30 messages a second a program may send.
SIDE_VIEWS_INTERVAL_S = 1.0


class ProgramWidget(PumpedView, W.VBox):
    program_id = Int(None, allow_none=True).tag(sync=True)
    status = Unicode("starting").tag(sync=True)
    error = Unicode("").tag(sync=True)

    def __init__(self, backend, title: str = "program", rate: float = 30.0, **kwargs):
        self.backend = backend
        self.timeline = Timeline()
        self.timings = Timings()
        self._handle = None  # the display handle show() made (its text/html is updated)
        self._final_shown = False  # the final state was re-sent from the kernel's thread
        self._shown_state: dict[str, dict] = {}  # model id -> its state when displayed
        self._final_updated = False  # the display was updated once the program ended
        self._final_parent: tuple | None = None  # the request the final state went out under
        self._side_key: tuple | None = None  # what the side views last showed, in brief
        self._side_at = 0.0  # when they were last refreshed (monotonic)
        self.forks: dict[int, list[int]] = {}
        self.state = None
        self.pump: EventPump | None = None
        self.rate = rate
        self._lock = threading.RLock()
        self._poked = False  # a button was pressed: render at the pump's next poll
        self._cached_chars: dict[tuple[int, int], int] = {}
        self._family = Family(-1)  # this program and its fork branches (set by attach)
        self.on_final: list = []  # called with the widget after its final render (pump thread)
        self.rerun_panel: RerunPanel | None = None  # built on the user's first selection
        self._render_thread: int | None = None  # the thread inside render(), if any
        self._queue = backend.events.subscribe()
        for e in snapshot_events(backend.cache):  # the tree so far; its events follow
            self.timeline.apply(e)
        self.title_text = title
        self.title = W.HTML(f"<b>%%sgl {html.escape(title)}</b>")
        self.stream = StreamView()
        self.stepper = StepperView()
        # Stop cancels the program (state.cancel()): a click only asks, and returns. It is
        # shown with the step buttons (their layout), while the program runs.
        self.stop_button = W.Button(description="Stop", icon="stop", button_style="danger",
                                    tooltip="cancel this program (what it produced is kept)",
                                    layout=self.stepper.controls)
        self.stop_button.on_click(lambda _: self.stop())
        self.stepper.on_command = self._poke
        self.cache = CacheTreeView()
        self.variables = VariablesPanel()
        self.call_stack = CallStackPanel()
        self.tabs = W.Tab(children=[self.stepper, self.cache], titles=("Stepper", "Cache tree"))
        header = W.HBox([self.title, self.stop_button],
                        layout=W.Layout(justify_content="space-between", align_items="center"))
        panels = W.HBox([
            W.VBox([W.HTML("<b>Variables</b>"), self.variables], layout=W.Layout(flex="2")),
            W.VBox([W.HTML("<b>Call stack</b>"), self.call_stack], layout=W.Layout(flex="1")),
        ])
        super().__init__(children=[header, self.stream, panels, self.tabs], **kwargs)
        if self.stream.has_trait("clicked_node"):  # a click on a token names its Node
            self.stream.observe(self._token_clicked, names="clicked_node")
        self.stream.on_why = self._why
        self.stepper.on_select = self._open_rerun
        self.stepper.node_choice.observe(self._node_chosen, names="value")

    # ---- wiring ------------------------------------------------------------------------

    def attach(self, state) -> ProgramWidget:
        """Follow this program (its events may already be queued: nothing is lost)."""
        self.state = state
        self.program_id = state.id
        self._family = Family(state.id)  # grows with the fork events
        self.stepper.bind(state.debug,
                          node_only=not state.backend.instruction_stepping)
        self.pump = EventPump(self._queue, self._fold, self.render, self._finished,
                              changed=self._was_poked, rate=self.rate,
                              on_stop=self._unsubscribe).start()
        return self

    def _unsubscribe(self) -> None:
        self.backend.events.unsubscribe(self._queue)

    def discard(self) -> None:
        """A widget never attached (its program did not start): unsubscribe and close."""
        self._unsubscribe()
        for w in _tree(self):
            w.close()

    def _fold(self, events: list[Event]) -> bool:
        """Fold this program's events (and its fork branches'); others only say whether the
        cache tree changed. Returns whether anything shown may have changed."""
        changed = False
        with self._lock:
            for event in sorted(events, key=lambda e: e.seq):
                ours = self._family.take(event)
                if not ours:
                    changed |= isinstance(event, CACHE_EVENTS)
                for e in ours:
                    self.timeline.apply(e)
                    self.timings.apply(e)
                    changed = True
                    if isinstance(e, Forked) and e.children:
                        self.forks[e.node] = list(e.children)
        return changed

    def _finished(self) -> bool:
        p = self.timeline.programs.get(self.program_id)
        return p is not None and p.status.ended

    def _was_poked(self) -> bool:
        poked, self._poked = self._poked, False
        return poked

    def stop(self) -> bool:
        """The Stop button: cancel the program; False if it had already ended."""
        self._poke()
        return self.state is not None and self.state.cancel()

    def _poke(self) -> None:
        self._poked = True  # the controls changed (paused, breakpoints): show it soon

    # ---- rendering -------------------------------------------------------------------------

    def render(self) -> None:
        self._render_thread = threading.get_ident()
        try:
            self._render()
        finally:
            self._render_thread = None

    def _render(self) -> None:
        parent = _output_parent()
        with self._lock:
            if self.program_id is None or self.program_id not in self.timeline.programs:
                return
            tl, pid = self.timeline, self.program_id
            model = StreamModel(tl, pid, self._prefix_chars, self.forks)
            finished = self._finished()
            rows = graph_rows(tl, tl.family(pid), self.timings)
            text = model.text()
            widgets = [self, *self.stream.widgets(), *self.stepper.widgets(),
                       *self.cache.widgets(), self.variables, self.call_stack]
            with held(widgets):
                p = tl.programs[pid]
                hold = p.held if not finished else None
                self.status = f"held at a {hold.value}" if hold else p.status.value
                self.error = self._error_text(p) if p.error else ""
                self.stream.update(model, self.status if not self.error else "error")
                if self.error:
                    self.stream.header.value += (
                        f'<div style="color:#b91c1c">{html.escape(self.error)}</div>')
                if finished:
                    # The final rows in the widget state: frozen first, a view sends them
                    # as its snapshot alone (one message, not a patch and the snapshot).
                    for view in (self.variables, self.call_stack, self.cache.tree):
                        view.freeze()
                if self._side_views_due(rows, len(p.variables), finished):
                    self.stepper.update(rows, finished, hold, p.held_node)
                    self.cache.update(tl.cache_tree if self.backend.cache is not None else None,
                                      self._tokenizer(), self._path_tokens(model, text))
                    self.variables.update(variables_of(tl, pid))
                    self._update_call_stack(finished)
        if finished and not self._final_updated:
            self._final_updated = True
            self._show_final()
            # Recorded where the final state went (see _after_cell); None if that moved
            # while it was being sent.
            self._final_parent = parent if _output_parent() == parent else None
            for fn in list(self.on_final):
                fn(self)

    def _side_views_due(self, rows: list, n_variables: int, finished: bool) -> bool:
        held_now = self.status.startswith("held")  # a step: show it
        key = (finished, self.status, tuple((r.id, r.status) for r in rows), n_variables)
        now = time.monotonic()
        if (not held_now and key == self._side_key
                and now - self._side_at < SIDE_VIEWS_INTERVAL_S):
            return False
        self._side_key, self._side_at = key, now
        return True

    def _update_call_stack(self, finished: bool) -> None:
        """The frames of the Node the program is at (the stepper's current Node)."""
        nid = None if finished else self.stepper.current_node
        view = self.timeline.nodes.get(nid) if nid is not None else None
        frames = [] if view is None else frames_of(view.stack, view.stack_args, view.line,
                                                   source_line(view.file, view.line))
        self.call_stack.update(frames, nid, "program finished" if finished else "")

    # ---- token clicks, display, the static copy -----------------------------------------

    def _token_clicked(self, change) -> None:
        nid = change.get("new")
        if nid is not None:
            self.select_node(nid)

    def select_node(self, node_id: int) -> bool:
        """Select the Node in the stepper and show its line (what a token click does);
        False if the program has no such Node."""
        with self._lock:
            ok = self.stepper.select(node_id)
        if ok:
            self.tabs.selected_index = 0
        return ok

    def _node_chosen(self, change) -> None:
        """The stepper's Node list changed its choice: the user's, unless render made it."""
        if change.get("new") is not None and self._render_thread != threading.get_ident():
            self._open_rerun(change["new"])

    def _open_rerun(self, node_id: int) -> None:
        if self.state is None:
            return
        if self.rerun_panel is None:
            self.rerun_panel = RerunPanel(self)
            self.children = (*self.children, self.rerun_panel)
        self.rerun_panel.show_node(node_id)

    def _why(self, node_id, index) -> dict:
        """The stream view's question about one of its tokens (rerun_panel.why_reply)."""
        with self._lock:
            return why_reply(self.timeline, node_id, index)

    def rerun_view(self, title: str) -> ProgramWidget:
        """A widget for a re-run of this program (the rerun panel shows it under itself),
        subscribed before the re-run starts."""
        widget = ProgramWidget(self.backend, title=title)
        widget.title.value = f"<b>{html.escape(title)}</b>"
        return widget

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        if isinstance(data, tuple):  # (data, metadata)
            data = data[0]
        data = dict(data or {})
        data["text/html"] = self.static_html()
        return data

    def static_html(self) -> str:
        """The program as a viewer that runs no widgets shows it: its text coloured by
        origin, its Node list with statuses and timing, its variables."""
        with self._lock:
            return static_html(self)

    def show(self):
        """Display the widget (with its static text/html copy) and keep the handle: when
        the program ends the copy is updated, so a saved notebook shows the final state."""
        from IPython import get_ipython
        from IPython.display import display

        ip = get_ipython()
        if ip is None or getattr(ip, "kernel", None) is None:
            display(self)  # a terminal prints it once: no saved output to keep up to date
            return None
        self._handle = display(self, display_id=True)
        # What the notebook recorded when each widget opened: _after_cell re-sends only
        # what differs from it.
        self._shown_state = {w.model_id: w.get_state() for w in _tree(self)}
        ip.events.register("post_execute", self._after_cell)
        return self._handle

    def _show_final(self) -> None:
        if self._handle is not None:
            self._handle.update(self)

    def _after_cell(self) -> None:
        """After each cell, on the kernel's own thread, once the program has ended: send the
        final state and the final static copy again, unless they went out as this cell's
        own output. Messages sent from the pump thread carry the request the kernel handled
        last; a notebook runner (nbclient) records only those of the cell it is running, so
        a program that ended between cells (or while a widget message was handled) would
        leave its final state unrecorded. One that ended while this cell ran was recorded:
        sending it again would only double the messages of that second."""
        if self._final_shown or not self._finished() or (
                self.pump is not None and not self.pump.join(0)):
            return
        self._final_shown = True
        stop_after_cell(self._after_cell)
        if self._final_parent is not None and self._final_parent == _output_parent():
            return
        for w in _tree(self):
            before, now = self._shown_state.get(w.model_id), w.get_state()
            changed = list(now) if before is None else [k for k in now if now[k] != before.get(k)]
            if changed:
                w.send_state(key=changed)
        self._show_final()

    def _error_text(self, p) -> str:
        """The program's error and the line it names, as written."""
        line = p.error_line
        file = next((self.timeline.nodes[n].file for n in p.nodes
                     if self.timeline.nodes[n].file), None)
        src = linecache.getline(file, line).strip() if file and line else ""
        where = f" at cell line {line}: {src}" if line else ""
        return f"{p.error}{where}"

    def _tokenizer(self):
        return self.backend.tokenizer

    def _path_tokens(self, model: StreamModel, text: str) -> list[int]:
        """The token ids of this program's path in the radix tree: its last Gen's prompt as
        the engine tokenized it plus the ids it generated (re-tokenizing the whole text
        could split differently), else the text so far."""
        tok = self._tokenizer()
        if tok is None:
            return []
        prompt, generated = model.last_request()
        if generated:
            return tok.encode(prompt) + generated
        return tok.encode(text) if text else []

    def _prefix_chars(self, prompt: str, n_tokens: int) -> int:
        """Characters spanned by the first n tokens of prompt (where the cached part ends)."""
        key = (hash(prompt), n_tokens)
        if key not in self._cached_chars:
            tok = self._tokenizer()
            ids = tok.encode(prompt) if tok is not None else []
            self._cached_chars[key] = (len(tok.decode(ids[:n_tokens])) if n_tokens < len(ids)
                                       else len(prompt))
        return self._cached_chars[key]


def _tree(widget) -> list:
    """The widget and every widget under it, their layouts included (the step buttons are
    shown and hidden through theirs)."""
    out, todo = [], [widget]
    while todo:
        w = todo.pop()
        if isinstance(w, W.Widget) and w not in out:
            out.append(w)
            todo.extend(getattr(w, "children", ()) or ())
            layout = getattr(w, "layout", None)
            if isinstance(layout, W.Layout):
                todo.append(layout)
    return out


def _output_parent() -> tuple | None:
    """The request that a widget message or a display update sent from this thread now
    goes out under (the ids of its comm parent and of its display parent), or None
    outside a kernel. A thread's messages carry the request the kernel handled last."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
        kernel = getattr(ip, "kernel", None)
        comm = kernel.get_parent() if kernel is not None else None
        display = ip.display_pub.parent_header if kernel is not None else None
    except Exception:  # noqa: BLE001 - an older or other kernel: send again, to be safe
        return None
    # get_parent() is the whole request; the display publisher keeps its header only.
    ids = ((comm or {}).get("header", {}).get("msg_id"), (display or {}).get("msg_id"))
    return ids if all(ids) else None


class LiveCacheTree(CacheTreeView):
    """`%sgl_cache`: the cache tree folded from the engine's events (after a snapshot of
    the tree so far), re-rendered (throttled) on every change until `stop()` (a newer view
    stops the older one, so only one pump runs)."""

    _current: LiveCacheTree | None = None

    def __init__(self, backend, rate: float = 10.0, **kwargs):
        super().__init__(**kwargs)
        self.backend = backend
        self.model = CacheTree()
        self._queue = backend.events.subscribe()
        self._fold(snapshot_events(backend.cache))
        self._stopped = threading.Event()
        self.render()
        if LiveCacheTree._current is not None:
            LiveCacheTree._current.stop()
        LiveCacheTree._current = self
        self.pump = EventPump(self._queue, self._fold, self.render, self._stopped.is_set,
                              rate=rate, on_stop=self._unsubscribe).start()

    def _fold(self, events: list[Event]) -> bool:
        mine = [e for e in events if isinstance(e, TREE_EVENTS)]
        for e in mine:
            self.model.apply(e)
        return bool(mine)

    def render(self) -> None:
        with held(self.widgets()):
            self.update(self.model if self.backend.cache is not None else None,
                        self.backend.tokenizer)

    def stop(self) -> None:
        self._stopped.set()

    def _unsubscribe(self) -> None:
        self.backend.events.unsubscribe(self._queue)
