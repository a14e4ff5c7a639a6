"""The run_batch summary: one widget for a whole `f.run_batch(items)` in a notebook cell,
however many items, instead of a widget per program.

A progress bar and one line (items done / running / failed / cancelled of N, generated
tokens, tok/s over the batch's wall time, cache hit) follow the event stream through one
subscription, folded into one Timeline and rendered at most `rate` times a second. The
items are opened on demand from a dropdown (`open_item(i)` from Python): an opened item shows
its own compact line and its text, and its **Full widget** button (`open_full(i)`) builds
that item's ProgramWidget, fed with the item's events recorded so far and then the live
ones. Nothing is built for the items nobody opens.
"""

from __future__ import annotations

import html
import threading
import time

import ipywidgets as W

from sgl_nb.notebook.widgets.compact import (
    StaticCopy,
    Tally,
    cache_text,
    gen_seconds,
    line_html,
)
from sgl_nb.notebook.widgets.compact import line_parts as program_parts
from sgl_nb.notebook.widgets.stream_model import StreamModel
from sgl_nb.notebook.widgets.throttle import EventPump, PumpedView, held
from sgl_nb.runtime.events import TREE_EVENTS, Event, EventBus, Forked
from sgl_nb.runtime.status import Status
from sgl_nb.tracing.timeline import Timeline

_LABEL_CHARS = 60


def _label(i: int, kwargs: dict) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    if len(args) > _LABEL_CHARS:
        args = args[:_LABEL_CHARS - 1] + "…"
    return f"#{i} {args}".rstrip()


class _Replay:
    """The backend an item's ProgramWidget sees when it is opened late: the real one's model,
    tokenizer and cache, and an event stream of its own, fed by the summary with what it
    recorded for the item and then, while the item runs, what comes next."""

    def __init__(self, backend):
        self._backend = backend
        self.events = EventBus()

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_backend":
            raise AttributeError(name)
        return getattr(self._backend, name)


class BatchSummary(PumpedView, StaticCopy, W.VBox):
    """Create it (it subscribes) before the items start, `attach(futures)` once they are
    queued. `counts()` and `text` say where the batch is; `open_item(i)` shows item i."""

    def __init__(self, backend, name: str, batch_kwargs: list[dict], rate: float = 30.0,
                 **kwargs):
        self.backend, self.name, self.rate = backend, name, rate
        self.n = len(batch_kwargs)
        self.timeline = Timeline()
        self.futures: list = []
        self.tallies: list[Tally] = [Tally() for _ in range(self.n)]
        self.pump: EventPump | None = None
        self.text = ""
        self.renders = 0
        self._root: dict[int, int] = {}  # program id (an item's or a fork branch's) -> item
        self._opened: int | None = None
        self._start_ns: int | None = None
        self._lock = threading.RLock()
        self._queue = backend.events.subscribe()
        self.progress = W.IntProgress(value=0, min=0, max=max(self.n, 1), bar_style="info",
                                      layout=W.Layout(width="30%"))
        self.line = W.HTML("")
        self.items = W.Dropdown(options=[("open an item…", None)]
                                + [(_label(i, kw), i) for i, kw in enumerate(batch_kwargs)],
                                value=None, layout=W.Layout(width="auto"))
        self.items.observe(lambda change: self._show(change["new"]), "value")
        self.item_line = W.HTML("")
        self.item_text = W.HTML("", _dom_classes=["sgl-stream-view"])
        self.full_button = W.Button(description="Full widget", icon="search-plus",
                                    tooltip="this item's stream view, stepper and cache tree",
                                    layout=W.Layout(width="auto"))
        self.full_button.on_click(lambda _: self._opened is not None
                                  and self.open_full(self._opened))
        self.full: dict[int, W.Widget] = {}  # item -> its ProgramWidget, once opened
        self._replays: dict[int, _Replay] = {}
        self.item = W.VBox([])
        super().__init__(children=[W.HBox([self.progress, self.line],
                                          layout=W.Layout(align_items="center")),
                                   self.items, self.item], **kwargs)
        self.render()

    # ---- wiring ------------------------------------------------------------------------

    def attach(self, futures: list) -> BatchSummary:
        """Follow these items (their events may already be queued: nothing is lost). Fewer
        than announced when queuing one failed: the summary is of those that run."""
        with self._lock:
            self.futures = list(futures)
            if len(self.futures) < self.n:
                self.n = len(self.futures)
                del self.tallies[self.n:]
                self.progress.max = max(self.n, 1)
            self._root = {f.state.id: i for i, f in enumerate(self.futures)}
        self.pump = EventPump(self._queue, self._fold, self.render, self._finished,
                              rate=self.rate, on_stop=self._stopped).start()
        return self

    def _fold(self, events: list[Event]) -> bool:
        changed = False
        with self._lock:
            for e in sorted(events, key=lambda e: e.seq):
                if isinstance(e, TREE_EVENTS):  # the radix tree: every opened item's cache tab
                    for replay in self._replays.values():
                        replay.events.publish(e)
                    continue
                item = self._root.get(e.program)
                if item is None:
                    continue
                self.timeline.apply(e)
                if item in self._replays:  # an opened full widget follows it live
                    self._replays[item].events.publish(e)
                self.tallies[item].add(e)
                changed = True
                if self._start_ns is None or e.ts < self._start_ns:
                    self._start_ns = e.ts
                if isinstance(e, Forked):
                    for child in e.children:
                        self._root[child] = item
        return changed

    def status(self, i: int) -> Status:
        """Item i's status as its events say (PENDING: queued, nothing heard of it yet)."""
        pid = self._program_of(i)
        p = self.timeline.programs.get(pid) if pid is not None else None
        if p is None:
            return Status.PENDING
        return p.status if p.status.ended else Status.RUNNING

    def _program_of(self, i: int) -> int | None:
        return self.futures[i].state.id if i < len(self.futures) else None

    def counts(self) -> dict:
        """How many items are done, running (started or queued), failed and cancelled."""
        with self._lock:
            statuses = [self.status(i) for i in range(self.n)]
        done, failed, cancelled = (statuses.count(k) for k in (Status.DONE, Status.ERROR,
                                                                Status.CANCELLED))
        return {"total": self.n, "done": done, "failed": failed, "cancelled": cancelled,
                "running": self.n - done - failed - cancelled}

    def _finished(self) -> bool:
        return len(self.futures) == self.n and all(
            self.status(i).ended for i in range(self.n))

    # ---- rendering -------------------------------------------------------------------------

    def render(self) -> None:
        with self._lock:
            c = self.counts()
            tokens = sum(t.generated for t in self.tallies)
            cached = sum(t.cached for t in self.tallies)
            prompt = sum(t.prompt for t in self.tallies)
            now = time.monotonic_ns()
            ends = [p.end_ns for p in self.timeline.programs.values() if p.end_ns]
            last = max(ends) if self._finished() and ends else now
            seconds = (last - self._start_ns) / 1e9 if self._start_ns is not None else 0.0
            tok_s = tokens / seconds if seconds > 0 else 0.0
            ended = c["done"] + c["failed"] + c["cancelled"]
            parts = [f"{ended}/{c['total']}", f"{c['done']} done", f"{c['running']} running",
                     f"{c['failed']} failed", f"{c['cancelled']} cancelled",
                     f"{tokens} tokens", f"{tok_s:.1f} tok/s", cache_text(cached, prompt)]
            self.text = f"run_batch {self.name} · " + " · ".join(parts)
            style = ("danger" if c["failed"] else "warning" if c["cancelled"]
                     else "success" if ended == self.n else "info")
            head = (f"<b>run_batch {html.escape(self.name)}</b> · "
                    + " · ".join(html.escape(p) for p in parts))
            with held([self.progress, self.line, self.item_line, self.item_text]):
                self.progress.value, self.progress.bar_style = ended, style
                if self.line.value != head:
                    self.line.value = head
                if self._opened is not None:
                    self._render_item(self._opened)
            self.renders += 1

    def static_html(self) -> str:
        """The summary as a viewer that runs no widgets shows it: its line of counts."""
        return f'<div class="sgl-batch">{self.line.value}</div>'

    def _resend(self) -> None:
        for w in (self, self.progress, self.line):
            w.send_state()

    def _repr_mimebundle_(self, **kwargs):
        return self._mimebundle(super()._repr_mimebundle_(**kwargs))

    # ---- one item, on demand ---------------------------------------------------------------

    def open_item(self, i: int) -> W.VBox:
        """Show item i under the summary (as picking it in the dropdown does)."""
        if not 0 <= i < self.n:
            raise IndexError(f"item {i}: this batch has items 0 to {self.n - 1}")
        self.items.value = i  # the observer shows it
        return self.item

    def _show(self, i: int | None) -> None:
        if i is not None and i >= self.n:  # listed, but its start failed: nothing to show
            i = None
        with self._lock:
            self._opened = i
            with held([self.item, self.item_line, self.item_text]):
                if i is None:
                    self.item_line.value = self.item_text.value = ""
                    self.item.children = ()
                else:
                    self._render_item(i)
                    self.item.children = (self.item_line, self.item_text,
                                          self.full.get(i, self.full_button))

    def open_full(self, i: int):
        """Item i's ProgramWidget (built on the first call): its events so far are replayed
        into it, the rest follow live. Shown under the item when the item is open."""
        from sgl_nb.notebook.widgets.program import ProgramWidget

        with self._lock:
            if i not in self.full:
                replay = _Replay(self.backend)
                widget = ProgramWidget(replay, title=f"{self.name} #{i}")  # subscribes
                family = {p for p, item in self._root.items() if item == i}
                for e in list(self.timeline.events):
                    if e.program in family:
                        replay.events.publish(e)  # its own seq
                self._replays[i] = replay
                self.full[i] = widget.attach(self.futures[i].state)
            if self._opened == i:
                self.item.children = (self.item_line, self.item_text, self.full[i])
            return self.full[i]

    def item_line_text(self, i: int) -> str:
        return " · ".join(self._item_parts(i))

    def _item_parts(self, i: int) -> list[str]:
        t = self.tallies[i]
        pid = self._program_of(i)
        family = [p for p, item in self._root.items() if item == i]
        seconds = gen_seconds(self.timeline, family, time.monotonic_ns())
        tok_s = t.generated / seconds if seconds > 0 else 0.0
        name = f"#{i}" + (f" program {pid}" if pid is not None else "")
        status = self.status(i)
        word = "queued" if status is Status.PENDING else status.value
        return program_parts(word, name, t.generated, tok_s, t.cached, t.prompt)

    def _render_item(self, i: int) -> None:
        pid = self._program_of(i)
        p = self.timeline.programs.get(pid) if pid is not None else None
        self.item_line.value = line_html(self._item_parts(i), (p.error or "") if p else "")
        text = self.item_text_now(i)
        self.item_text.value = f'<pre style="white-space:pre-wrap">{html.escape(text)}</pre>'

    def item_text_now(self, i: int) -> str:
        """Item i's text so far, as its events tell it (never waits: this runs on the
        kernel's thread)."""
        pid = self._program_of(i)
        if pid is None or pid not in self.timeline.programs:
            return ""
        return StreamModel(self.timeline, pid).text()
