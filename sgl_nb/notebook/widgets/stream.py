"""The stream view: a program's text as it is generated, an anywidget (front end in
stream.js) fed by its model (stream_model.py: the lanes of pieces, from the Timeline).

`StreamView` keeps what it has sent of each lane and sends only what changed, in custom
messages: at most `rate` a second (default 10, fewer while each would carry only a token or
two; the renders come at up to 30 a second, what they change in between is merged), the
last one at once when the run ends:

    {"root": program, "l": [[lane, at, [item, ...]], ...],
     "n": {node: [kind, name, status]}, "s": {changed counts}, "x": header extra}

A lane's items (stream_model.py's wire form) from index `at` replace what the front end has
from there (almost always `at` is what it has: new tokens appended; less when a finished
Gen's stop string is cut or a cache hit recolours the prompt before it). A view that opens
while the program runs says "hello" and gets the whole state at once ("t": "f"). A click on
a token asks {"type": "why", "node", "index"} (its place among its Node's tokens); `on_why`
(the ProgramWidget's) answers, and the answer goes back as one message with "type": "why".
When the run ends the whole state goes into the `snapshot` trait and `text` and the counts
are synced; during the run those traits change in Python only (no re-sync on every render).
`static_html()` is the coloured text as self-contained HTML, for a notebook viewer that
runs no widgets.
"""

from __future__ import annotations

import contextlib
import html
import math
import pathlib
import threading
import time
from collections.abc import Callable

import anywidget
from traitlets import Dict, Float, Int, Unicode

from sgl_nb.notebook.widgets.stream_model import (
    ENDED,
    ORIGINS,
    StreamModel,
    inline_attr,
    render_html,
    stream_stats,
)
from sgl_nb.runtime.radix_cache import common_prefix_len

_CSS = """
.sgl-stream{white-space:pre-wrap;font-family:monospace;font-size:12px;line-height:1.5;
 max-height:360px;overflow:auto;border:1px solid #ddd;padding:6px}
.sgl-prompt{color:#333}.sgl-cached{background:#dbeafe}.sgl-generated{background:#dcfce7}
.sgl-forced{background:#fef3c7}.sgl-drafted{background:#cffafe}
.sgl-role{background:#ede9fe;color:#5b21b6;border-radius:3px;padding:0 3px;font-size:10px;
 margin-right:2px}.sgl-template{color:#888}
.sgl-var{border-bottom:2px solid #16a34a}.sgl-varname{font-size:9px;color:#15803d;
 vertical-align:super;margin-left:1px}.sgl-branch{display:block;border-left:3px solid #a78bfa;
 margin:2px 0 2px 8px;padding-left:6px}.sgl-mark{color:#7c3aed;font-size:10px}
.sgl-error{color:#b91c1c;font-weight:bold}.sgl-legend span{padding:0 4px;margin-right:4px}
.sgl-stream [data-node]{cursor:pointer}.sgl-why-on{outline:2px solid #2563eb}
.sgl-why{font-family:monospace;font-size:12px;border:1px solid #93c5fd;background:#f8fafc;
 padding:4px 6px;margin-top:4px;white-space:pre-wrap}.sgl-why table{border-collapse:collapse}
.sgl-why td,.sgl-why th{padding:0 8px;text-align:left}.sgl-why .sgl-why-taken{font-weight:bold}
.sgl-why .sgl-why-masked{color:#9ca3af;text-decoration:line-through}
.sgl-why-close{float:right;cursor:pointer;border:none;background:none;font-size:14px}
"""
_STYLE = f"<style>{_CSS}</style>"
_LEGEND = ('<div class="sgl-legend">' + "".join(
    f'<span class="sgl-{o}"{inline_attr(o)}>{o}</span>' for o in ORIGINS) + "</div>")


# The counts' keys in the messages ("s"), short: they go out on every render.
_STAT_KEYS = {"status": "status", "prompt_tokens": "p", "cached_tokens": "c",
              "generated_tokens": "g", "forced_tokens": "f", "tok_per_s": "r"}


class _Header:
    """`view.header.value`: the header line as HTML. What is set beyond the line itself
    (the ProgramWidget appends the program's error) is shown after it."""

    def __init__(self, view: StreamView):
        self._view = view

    @property
    def value(self) -> str:
        return self._view.header_html() + self._view._extra

    @value.setter
    def value(self, new: str) -> None:
        base = self._view.header_html()
        self._view.set_header_extra(new[len(base):] if new.startswith(base) else new)


class StreamView(anywidget.AnyWidget):
    """The text so far (`text`), the lanes in the front end, the counts. During the run the
    front end gets deltas (custom messages); the traits below are synced when it ends."""

    _esm = pathlib.Path(__file__).with_name("stream.js")
    _css = _CSS
    text = Unicode("").tag(sync=True)
    status = Unicode("waiting").tag(sync=True)
    prompt_tokens = Int(0).tag(sync=True)
    cached_tokens = Int(0).tag(sync=True)
    generated_tokens = Int(0).tag(sync=True)
    forced_tokens = Int(0).tag(sync=True)
    tok_per_s = Float(0.0).tag(sync=True)
    # The whole view (a "full" message with "final": true), set once the run has ended.
    snapshot = Dict().tag(sync=True)
    # The Node of the token last clicked in the front end.
    clicked_node = Int(None, allow_none=True).tag(sync=True)

    # Synced only once the run has ended: they change on every render.
    _QUIET = frozenset({"text", "status", "prompt_tokens", "cached_tokens",
                        "generated_tokens", "forced_tokens", "tok_per_s", "snapshot"})

    def __init__(self, rate: float = 10.0, **kwargs):
        if rate <= 0:
            raise ValueError(f"rate must be > 0 messages a second, got {rate}")
        self._interval = 1.0 / rate  # between two deltas; the renders come at up to 30/s
        self._last_send = -math.inf
        self._rate_sent_at = -math.inf
        self._timer: threading.Timer | None = None
        self._quiet = True
        self._send_lock = threading.RLock()
        self._root: int | None = None
        self._sent: dict[int, list] = {}  # lane -> the items the front end has
        self._nodes: dict[int, list] = {}  # node -> [kind, name, status] sent
        self._stats: dict = {}  # the counts sent ("s")
        self._extra = ""
        self._extra_sent = ""
        self._ended = False
        self._pending: dict | None = None  # the delta of this render, sent with the hold
        self.messages_sent = 0
        self.bytes_sent = 0  # the custom messages' content, as JSON
        super().__init__(**kwargs)
        self.header = _Header(self)
        # (node, index) -> the answer to a click on that token (set by the ProgramWidget).
        self.on_why: Callable[[object, object], dict] | None = None
        self.on_msg(self._on_msg)

    # ---- the traits: quiet during the run -----------------------------------------------

    def _should_send_property(self, key, value):
        if self._quiet and key in self._QUIET:
            return False
        return super()._should_send_property(key, value)

    @contextlib.contextmanager
    def hold_sync(self):
        outer = not self._holding_sync
        with super().hold_sync():
            yield
            if outer:
                self._settle()  # still held: the final traits go in the hold's one message
        if outer:
            self._flush()

    # ---- rendering ------------------------------------------------------------------------

    def update(self, model: StreamModel, status: str) -> None:
        """Set every trait from the model and send what changed (inside hold_sync: one
        message when the hold ends)."""
        stats = stream_stats(model.tl, model.program)
        self.text = model.text()
        self.status = status
        for k in ("prompt_tokens", "cached_tokens", "generated_tokens", "forced_tokens"):
            setattr(self, k, stats[k])
        self.tok_per_s = round(stats["tok_per_s"], 2)
        with self._send_lock:
            self._extra = ""  # the header line is new: what follows it is set anew
            self._ended = status in ENDED
            self._merge(self._diff(model.program, model.lanes(), model.nodes()))
        if not self._holding_sync:
            self._settle()
            self._flush()

    def header_html(self) -> str:
        return (f"<b>{html.escape(self.status)}</b> · prompt {self.prompt_tokens} tokens "
                f"({self.cached_tokens} cached) · generated {self.generated_tokens}"
                f"{f' ({self.forced_tokens} forced)' if self.forced_tokens else ''} · "
                f"{self.tok_per_s:.1f} tok/s")

    def set_header_extra(self, extra: str) -> None:
        """HTML shown after the header line (the program's error), until the next update."""
        with self._send_lock:
            self._extra = extra
        if not self._holding_sync:
            self._settle()
            self._flush()

    def _settle(self) -> None:
        """Before a render's message goes: the header's extra, and the final state."""
        with self._send_lock:
            if self._extra != self._extra_sent:
                self._extra_sent = self._extra
                self._merge({"x": self._extra})
            if self._ended:
                self._finish()

    def static_html(self) -> str:
        """The view as it stands, as self-contained HTML (style, header, coloured text)."""
        with self._send_lock:
            body = render_html(self._root, self._sent, self._nodes)
        head = f'<div class="sgl-head">{self.header.value}</div>'
        return (f'<div class="sgl-stream-static">{_STYLE}{head}{_LEGEND}'
                f'<div class="sgl-stream">{body}</div></div>')

    def widgets(self) -> list:
        return [self]

    def _diff(self, root: int, lanes: dict[int, list], nodes: dict[int, list]) -> dict:
        """What the front end lacks, and remember that it has it now."""
        delta: dict = {}
        if root != self._root:
            self._root = delta["root"] = root
        changed_nodes = {k: v for k, v in nodes.items() if self._nodes.get(k) != v}
        if changed_nodes:
            self._nodes.update(changed_nodes)
            delta["n"] = {str(k): v for k, v in changed_nodes.items()}
        out = []
        for lane, items in lanes.items():
            sent = self._sent.get(lane, [])
            at = common_prefix_len(sent, items)
            if at == len(sent) == len(items) and lane in self._sent:
                continue
            out.append([lane, at, items[at:]])
            self._sent[lane] = list(items)
        if out:
            delta["l"] = out
        stats = {"status": self.status, "p": self.prompt_tokens, "c": self.cached_tokens,
                 "g": self.generated_tokens, "f": self.forced_tokens,
                 "r": round(self.tok_per_s, 1)}
        changed = {k: v for k, v in stats.items() if self._stats.get(k) != v}
        now = time.monotonic()
        if "r" in changed and not self._ended and now - self._rate_sent_at < 1.0:
            del changed["r"]  # tokens a second: once a second is enough
        elif "r" in changed:
            self._rate_sent_at = now
        if changed:
            self._stats.update(changed)
            delta["s"] = changed
        return delta

    def _merge(self, delta: dict) -> None:
        """Add a delta to the one waiting to be sent."""
        if not delta:
            return
        if self._pending is None:
            self._pending = {}
        p = self._pending
        for key, value in delta.items():
            if key == "l":
                lanes = p.setdefault("l", [])
                for lane, at, items in value:
                    prev = next((x for x in lanes if x[0] == lane), None)
                    if prev is None:
                        lanes.append([lane, at, items])
                    elif at >= prev[1]:  # cut what it replaces, then append
                        prev[2] = prev[2][:at - prev[1]] + items
                    else:
                        prev[1], prev[2] = at, items
            elif key in ("n", "s"):
                p.setdefault(key, {}).update(value)
            else:
                p[key] = value

    def _flush(self) -> None:
        """Send the waiting delta: at most `rate` a second (what comes sooner waits, merged
        with the next, or for a timer when no render follows), a third of that while each
        would carry fewer than 3 pieces; at once when the run ended."""
        with self._send_lock:
            if not self._pending:
                return
            now = time.monotonic()
            # A delta of a token or two waits up to 3 intervals for more (a slow stream).
            pieces = sum(len(items) for _lane, _at, items in self._pending.get("l", []))
            interval = self._interval * (1 if pieces >= 3 or "n" in self._pending else 3)
            wait = self._last_send + interval - now
            if wait > 0 and not self._ended:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self._on_timer)
                    self._timer.daemon = True
                    self._timer.start()
                return
            msg, self._pending = self._pending, None
            self._last_send = now
            self._send_custom(msg)

    def _on_timer(self) -> None:
        with self._send_lock:
            self._timer = None
        self._flush()

    def _send_custom(self, msg: dict) -> None:
        if self.comm is None:
            return
        self.send(msg)
        self.messages_sent += 1

    def _full(self, final: bool = False) -> dict:
        msg = {"t": "f", "root": self._root,
               "l": [[lane, 0, items] for lane, items in self._sent.items()],
               "n": {str(k): v for k, v in self._nodes.items()}, "s": dict(self._stats),
               "x": self._extra_sent}
        if final:
            msg["final"] = True
        return msg

    def _finish(self) -> None:
        """The run has ended: the whole state into the traits, synced from now on."""
        self.snapshot = self._full(final=True)
        if self._quiet:
            self._quiet = False
            if self._holding_sync:
                self._states_to_send.update(self._QUIET)
            else:
                self.send_state(list(self._QUIET))

    def _on_msg(self, _widget, content, _buffers) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "hello":
            with self._send_lock:
                self._send_custom(self._full())
        elif kind == "why" and self.on_why is not None:
            reply = self.on_why(content.get("node"), content.get("index"))
            with self._send_lock:
                self._send_custom(reply)
