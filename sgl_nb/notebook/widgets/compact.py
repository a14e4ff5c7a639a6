"""The compact view: one line per program (status, generated tokens, tok/s, cache hit), like
a progress bar, for `%config SglMagics.widget = "compact"` or `%%sgl --widget compact`.

It follows the event stream as the ProgramWidget does (a subscribed queue, an EventPump,
one Timeline) but renders a single short HTML line, at most `rate` times a second: one
small message per render. Its `value` is that line, so a saved notebook's widget state
shows the final one, and `text` is the same line in plain text. Shown with `show()`, it
also leaves a static text/html copy of the line, updated once the program has ended, for
viewers that run no widgets.
"""

from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass

import ipywidgets as W
from traitlets import Float, Int, Unicode

from sgl_nb.notebook.widgets.static_view import stop_after_cell
from sgl_nb.notebook.widgets.throttle import EventPump, PumpedView, held
from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.runtime.events import CacheHit, Event, Forked, Token
from sgl_nb.runtime.status import Status
from sgl_nb.tracing.timeline import Timeline

_COLOURS = {"done": "#15803d", "error": "#b91c1c", "cancelled": "#a16207",
            "running": "#2563eb", "starting": "#6b7280"}


@dataclass
class Tally:
    """Counts folded from one program's events (its fork branches' included)."""

    generated: int = 0
    cached: int = 0
    prompt: int = 0

    def add(self, e: Event) -> None:
        if isinstance(e, Token):
            self.generated += 1
        elif isinstance(e, CacheHit):
            self.cached += e.cached_tokens
            self.prompt += e.prompt_tokens


def gen_seconds(tl: Timeline, pids, now_ns: int) -> float:
    """Seconds the programs' Gen Nodes ran (what tok/s divides by, as the stream view)."""
    spans = [(n.end_ns or now_ns) - n.start_ns
             for pid in pids if pid in tl.programs
             for n in (tl.nodes[i] for i in tl.programs[pid].nodes)
             if n.kind is NodeKind.GEN and n.start_ns is not None]
    return sum(spans) / 1e9


def cache_text(cached: int, prompt: int) -> str:
    if not prompt:
        return "cache -"
    return f"cache {100 * cached / prompt:.0f}% ({cached}/{prompt})"


def line_parts(status: str, name: str, tokens: int, tok_per_s: float, cached: int,
               prompt: int) -> list[str]:
    return [status, name, f"{tokens} tokens", f"{tok_per_s:.1f} tok/s",
            cache_text(cached, prompt)]


def line_html(parts: list[str], error: str = "") -> str:
    status = parts[0]
    colour = _COLOURS.get(status, _COLOURS["running"])
    cells = [f'<b style="color:{colour}">● {html.escape(status)}</b>',
             *(html.escape(p) for p in parts[1:])]
    err = (f' · <span style="color:#b91c1c">{html.escape(error[:200])}</span>'
           if error else "")
    return ('<div class="sgl-compact" style="font-family:monospace;white-space:nowrap;'
            f'overflow:hidden;text-overflow:ellipsis">{" · ".join(cells)}{err}</div>')


class StaticCopy:
    """`show()`: display the widget with a static text/html copy (`static_html()`) and, in a
    kernel, keep the handle: once the view has ended (`_finished()`, its pump joined) the
    copy is updated, from the pump's last step and again after the next cell on the
    kernel's thread (a notebook runner records only the messages of the cell it runs)."""

    _handle = None
    _final_shown = False

    def show(self):
        from IPython import get_ipython
        from IPython.display import display

        ip = get_ipython()
        if ip is None or getattr(ip, "kernel", None) is None:
            display(self)  # a terminal prints it once: no saved output to keep up to date
            return None
        self._handle = display(self, display_id=True)
        ip.events.register("post_execute", self._after_cell)
        return self._handle

    def _mimebundle(self, data) -> dict:
        if isinstance(data, tuple):  # (data, metadata)
            data = data[0]
        data = dict(data or {})
        data["text/plain"] = self.text
        data["text/html"] = self.static_html()
        return data

    def _show_final(self) -> None:
        if self._handle is not None:
            self._handle.update(self)

    def _after_cell(self) -> None:
        pump = self.pump
        if self._final_shown or not self._finished() or (pump is not None
                                                          and not pump.join(0)):
            return
        self._final_shown = True
        stop_after_cell(self._after_cell)
        self._resend()
        self._show_final()

    def _resend(self) -> None:
        self.send_state()

    def _stopped(self) -> None:
        """The pump ended: stop listening, leave the final static copy."""
        self.backend.events.unsubscribe(self._queue)
        self._show_final()


class CompactView(PumpedView, StaticCopy, W.HTML):
    """One program's line. Create it (it subscribes) before the program starts,
    `attach(state)` once it runs; `sync()` renders now, `wait()` for the final render."""

    # Only `value` (the line) is synced: the counts below stay on the Python side.
    program_id = Int(None, allow_none=True)
    status = Unicode("starting")
    error = Unicode("")
    generated_tokens = Int(0)
    tok_per_s = Float(0.0)
    cached_tokens = Int(0)
    prompt_tokens = Int(0)
    text = Unicode("")

    def __init__(self, backend, title: str = "program", rate: float = 30.0, **kwargs):
        super().__init__(**kwargs)
        self.backend, self.program_name, self.rate = backend, title, rate
        self.timeline = Timeline()
        self.tally = Tally()
        self.state = None
        self.pump: EventPump | None = None
        self._family: set[int] = set()
        self._lock = threading.RLock()
        self._queue = backend.events.subscribe()
        self.render()

    def attach(self, state) -> CompactView:
        """Follow this program (its events may already be queued: nothing is lost)."""
        self.state = state
        self.program_id = state.id
        self._family = {state.id}
        self.pump = EventPump(self._queue, self._fold, self.render, self._finished,
                              rate=self.rate, on_stop=self._stopped).start()
        return self

    def _fold(self, events: list[Event]) -> bool:
        changed = False
        with self._lock:
            for e in sorted(events, key=lambda e: e.seq):
                if e.program not in self._family:
                    continue
                self.timeline.apply(e)
                self.tally.add(e)
                changed = True
                if isinstance(e, Forked):
                    self._family.update(e.children)
        return changed

    def _finished(self) -> bool:
        p = self.timeline.programs.get(self.program_id)
        return p is not None and p.status.ended

    def stop(self) -> bool:
        """Cancel the program; False if it had already ended."""
        return self.state is not None and self.state.cancel()

    def render(self) -> None:
        with self._lock:
            p = self.timeline.programs.get(self.program_id)
            status = "starting" if p is None else p.status.value
            if p is not None and p.status is Status.SUSPENDED and p.reason:
                status = "held" if p.reason.startswith("held") else "suspended"
            seconds = gen_seconds(self.timeline, self._family, time.monotonic_ns())
            t = self.tally
            tok_s = t.generated / seconds if seconds > 0 else 0.0
            parts = line_parts(status, self.program_name, t.generated, tok_s, t.cached, t.prompt)
            error = (p.error or "") if p is not None else ""
            with held([self]):
                self.status, self.error = status, error
                self.generated_tokens, self.tok_per_s = t.generated, round(tok_s, 2)
                self.cached_tokens, self.prompt_tokens = t.cached, t.prompt
                self.text = " · ".join(parts) + (f" · {error}" if error else "")
                value = line_html(parts, error)
                if value != self.value:
                    self.value = value

    def static_html(self) -> str:
        return self.value

    def _repr_mimebundle_(self, **kwargs):
        return self._mimebundle(super()._repr_mimebundle_(**kwargs))
