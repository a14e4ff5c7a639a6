"""The stream view: a program's text as it is generated, from the Timeline.

Each piece is coloured by where its tokens came from: prompt (computed by a prefill),
cached (read from the radix cache instead), generated (sampled), grammar-forced (the
grammar allowed one token only), or drafted (a prompt-lookup draft the model agreed with,
runtime/prompt_lookup.py). A generated token shows its probability on hover (the
title). Roles and variables are marked; each fork branch has its own lane under its Fork.

`StreamModel` turns the Timeline into lanes of items (one lane a program, fork branches
included) on each render. `StreamView` (an anywidget, front end in stream.js) keeps what it
has sent of each lane and sends only what changed, in custom messages: at most `rate` a
second (default 10, fewer while each would carry only a token or two; the renders come at
up to 30 a second, what they change in between is merged), the last one at once when the
run ends:

    {"root": program, "l": [[lane, at, [item, ...]], ...],
     "n": {node: [kind, name, status]}, "s": {changed counts}, "x": header extra}

A lane's items from index `at` replace what the front end has from there (almost always
`at` is what it has: new tokens appended; less when a finished Gen's stop string is cut or
a cache hit recolours the prompt before it). An item is a piece
`[text, origin, node, p, token]` (a token; its title is derived), `[text, origin, node]` or
`[text, origin, node, None, None, title]`, origin one of p(rompt) c(ached) g(enerated)
f(orced) t(emplate); or a marker `{"k": role|var|mark|fork|err|perr, "t": text, "n": node}`
(a fork's `"b"` lists its branches' lanes, in branch order). A view that opens while the
program runs says "hello" and gets the whole state at once ("t": "f"). A click on a token
asks {"type": "why", "node", "index"} (its place among its Node's tokens); `on_why` (the
ProgramWidget's) answers, and the answer goes back as one message with "type": "why".
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
from dataclasses import dataclass

import anywidget
from traitlets import Dict, Float, Int, Unicode

from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.runtime.events import CacheHit
from sgl_nb.runtime.status import Status
from sgl_nb.tracing.timeline import NodeView, Timeline

ORIGINS = ("prompt", "cached", "generated", "forced", "drafted")
CODES = {"prompt": "p", "cached": "c", "generated": "g", "forced": "f", "drafted": "d",
         "template": "t"}
ORIGIN_OF = {v: k for k, v in CODES.items()}
# The status words (the `status` trait) of a run that has ended.
ENDED = frozenset(s.value for s in Status if s.ended)
# The kinds, as the wire names them ("n"), whose Node binds a variable.
_BINDING = (NodeKind.GEN.value, NodeKind.SELECT.value)
_ROLE_KINDS = (NodeKind.ROLE_BEGIN, NodeKind.ROLE_END)


def _inline_attr(origin: str) -> str:
    return f' style="{_INLINE[origin]}"' if origin in _INLINE else ""


_CSS = """
.sgl-stream{white-space:pre-wrap;font-family:monospace;font-size:12px;line-height:1.5;
 max-height:360px;overflow:auto;border:1px solid #ddd;padding:6px}
.sgl-prompt{color:#333}.sgl-cached{background:#dbeafe}.sgl-generated{background:#dcfce7}
.sgl-forced{background:#fef3c7}.sgl-drafted{background:#cffafe}.sgl-role{background:#ede9fe;color:#5b21b6;border-radius:3px;
 padding:0 3px;font-size:10px;margin-right:2px}.sgl-template{color:#888}
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
# The static copy's origin colours, inline as well: JupyterLab's sanitizer drops a <style>
# block in an output it does not trust (a saved notebook opened without its kernel).
_INLINE = {"cached": "background:#dbeafe", "generated": "background:#dcfce7",
           "forced": "background:#fef3c7", "drafted": "background:#cffafe",
           "template": "color:#888"}
_LEGEND = ('<div class="sgl-legend">' + "".join(
    f'<span class="sgl-{o}"{_inline_attr(o)}>{o}</span>' for o in ORIGINS) + "</div>")


@dataclass
class Piece:
    """A run of characters of one origin; `start` is its offset in the program's text. A
    token's piece has `token` (its id) and `p` (its probability, None if unknown)."""

    start: int
    text: str
    origin: str  # prompt | cached | generated | forced | drafted | template (role markers)
    title: str = ""
    token: int | None = None
    p: float | None = None
    is_token: bool = False


class StreamModel:
    """What the view shows of one program: built from the Timeline alone on each render.
    `cached_chars(prompt, n)` says how many characters the first n tokens of prompt span
    (None: no tokenizer at hand, nothing is shown as cached)."""

    def __init__(self, tl: Timeline, program: int,
                 cached_chars: Callable[[str, int], int] | None = None,
                 forks: dict[int, list[int]] | None = None):
        self.tl, self.program = tl, program
        self.forks = forks  # fork Node id -> its branches' program ids, kept by the caller
        self._built: tuple[dict[int, list], str] | None = None
        self.cached_chars = cached_chars

    def lanes(self) -> dict[int, list]:
        """Program id -> its items (the wire form above), the program first, then its
        branches in the order their Forks show them."""
        return self._whole()[0]

    def text(self) -> str:
        return self._whole()[1]

    def nodes(self) -> dict[int, list]:
        """Node id -> [kind, name, status] of every Node the lanes show (the wire form)."""
        out = {}
        for pid in self.lanes():
            for n in _shown(self.tl, pid):
                out[n.id] = [n.kind.value if n.kind else None, n.name, n.status.value]
        return out

    def html(self) -> str:
        return render_html(self.program, self.lanes(), self.nodes())

    def _whole(self) -> tuple[dict[int, list], str]:
        # A model lives for one render: build the program's lanes and text once.
        if self._built is None:
            lanes: dict[int, list] = {}
            text = self._program_items(self.program, "", lanes)
            self._built = (lanes, text)
        return self._built

    def _program_items(self, pid: int, prefix: str, lanes: dict[int, list]) -> str:
        """Fill lanes[pid] (and its branches' lanes) with the items of program `pid`, whose
        text starts after `prefix` (a fork branch starts with its parent's text); return
        its own text."""
        items: list = []
        lanes[pid] = items  # before the branches: a lane's parent comes first
        p = self.tl.programs.get(pid)
        if p is None:
            return ""
        text, requests = prefix, []
        pending: list[tuple[NodeView, list[Piece]]] = []
        for n in _shown(self.tl, pid):
            if n.kind in (NodeKind.GEN, NodeKind.SELECT):
                requests.append((len(text), self._cached_tokens(n)))
            pieces = self._pieces(n, len(text))
            text += "".join(pc.text for pc in pieces)
            pending.append((n, pieces))
        for n, pieces in pending:
            if n.kind is NodeKind.FORK:
                children = self._fork_children(n, p.children)
                items.append({"k": "fork", "t": f"[{n.label or n.kind.value}]", "n": n.id,
                              "b": list(children)})
                for cid in children:
                    self._program_items(cid, prefix + self._text_at(pending, n), lanes)
                continue
            items.extend(self._node_items(n, self._split_cached(pieces, requests, text)))
        if p.error:
            items.append({"k": "perr", "t": p.error})
        return text[len(prefix):]

    def _fork_children(self, fork: NodeView, children: list[int]) -> list[int]:
        """The branches this Fork made (a program may fork more than once)."""
        if self.forks is None:
            self.forks = self.tl.fork_children()
        return self.forks.get(fork.id, children)

    def _text_at(self, pending: list, fork: NodeView) -> str:
        text = ""
        for n, pieces in pending:
            if n is fork:
                break
            text += "".join(pc.text for pc in pieces)
        return text

    def _cached_tokens(self, n: NodeView) -> int:
        hits = [e.cached_tokens for e in self.tl.cache_events
                if isinstance(e, CacheHit) and e.node == n.id]
        return max(hits, default=0)

    def _pieces(self, n: NodeView, start: int) -> list[Piece]:
        if n.tokens and n.kind is not NodeKind.SELECT:
            return self._token_pieces(n, start)
        text = n.text
        if not text:
            return []
        if n.kind is NodeKind.SELECT:
            return [Piece(start, text, "generated", "chosen by select")]
        if n.kind is NodeKind.GEN:  # its text without token events (a backend that sends none)
            return [Piece(start, text, "generated")]
        origin = "template" if n.kind in _ROLE_KINDS else "prompt"
        return [Piece(start, text, origin)]

    def _token_pieces(self, n: NodeView, start: int) -> list[Piece]:
        """One piece per generated token. Once the Node has finished, its text is what the
        program kept: a matched stop string is cut, so the tokens are clipped to it."""
        pieces, pos = [], start
        for t in n.tokens:
            p = math.exp(t.logprob) if t.logprob is not None else None
            p = round(p, 3) if p is not None else None
            origin = "forced" if t.forced else "drafted" if t.drafted else "generated"
            pieces.append(Piece(pos, t.text, origin, token_title(p, t.token, t.forced,
                                                                 t.drafted), t.token, p, True))
            pos += len(t.text)
        if n.text is None:
            return pieces
        joined = "".join(pc.text for pc in pieces)
        if not joined.startswith(n.text):  # tokens that decode apart differently: the text
            return [Piece(start, n.text, "generated")] if n.text else []
        out, left = [], len(n.text)
        for pc in pieces:
            if left <= 0:
                break
            out.append(Piece(pc.start, pc.text[:left], pc.origin, pc.title, pc.token, pc.p,
                             True))
            left -= len(pc.text)
        return out

    def last_request(self) -> tuple[str, list[int]]:
        """The prompt text of the program's last Gen and the token ids it generated: the
        engine's own token sequence (for the cache tree's path), or ("", [])."""
        p = self.tl.programs.get(self.program)
        text, last = "", ("", [])
        for n in _shown(self.tl, self.program) if p else []:
            if n.kind is NodeKind.GEN:
                last = (text, [t.token for t in n.tokens if t.token is not None])
            text += "".join(pc.text for pc in self._pieces(n, len(text)))
        return last

    def _split_cached(self, pieces: list[Piece], requests: list[tuple[int, int]],
                      text: str) -> list[Piece]:
        """Prompt characters that the next request read from the radix cache are cached."""
        out = []
        for pc in pieces:
            if pc.origin not in ("prompt", "template"):
                out.append(pc)
                continue
            end = pc.start + len(pc.text)
            req = next(((at, c) for at, c in requests if at >= end), None)
            if req is None or req[1] == 0 or self.cached_chars is None:
                out.append(pc)
                continue
            limit = self.cached_chars(text[:req[0]], req[1])
            cut = max(0, min(len(pc.text), limit - pc.start))
            if cut:
                out.append(Piece(pc.start, pc.text[:cut], "cached", f"{pc.origin}, cached"))
            if cut < len(pc.text):
                out.append(Piece(pc.start + cut, pc.text[cut:], pc.origin, pc.title))
        return out

    def _node_items(self, n: NodeView, pieces: list[Piece]) -> list:
        items: list = [_wire(pc, n.id) for pc in pieces]
        if n.kind is NodeKind.ROLE_BEGIN:
            role = (n.label or "").split(" ")[-1] or "role"
            return [{"k": "role", "t": role, "n": n.id}, *items]
        if n.kind in (NodeKind.GEN, NodeKind.SELECT) and n.name and n.status.ended:
            items.append({"k": "var", "t": n.name, "n": n.id})  # its name, once it ended
        elif n.kind is NodeKind.JOIN:
            return [{"k": "mark", "t": f"[{n.label or n.kind.value}]", "n": n.id}]
        if n.error:
            items.append({"k": "err", "t": f" {n.error}", "n": n.id})
        return items


def token_title(p: float | None, token: int | None, forced: bool,
                drafted: bool = False) -> str:
    title = (f"p={p:.3f}" if p is not None else "p=?") + f" token {token}"
    if forced:
        return title + " (forced by the grammar)"
    return title + " (drafted by prompt lookup)" if drafted else title


def _wire(pc: Piece, node: int) -> list:
    code = CODES[pc.origin]
    if pc.is_token:
        return [pc.text, code, node, pc.p, pc.token]
    if pc.title:
        return [pc.text, code, node, None, None, pc.title]
    return [pc.text, code, node]


def _title(item: list) -> str:
    if len(item) >= 6 and item[5]:
        return item[5]
    if len(item) >= 5:
        return token_title(item[3], item[4], item[1] == "f", item[1] == "d")
    return ""


def render_html(root: int | None, lanes: dict, nodes: dict) -> str:
    """The lanes as the front end draws them, in HTML: each Gen or Select Node's pieces in
    one `sgl-var` span, each branch a block under its Fork."""
    def lane(pid) -> str:
        out, var_node = [], None
        for it in lanes.get(pid, []):
            node = it[2] if isinstance(it, list) else it.get("n")
            if var_node is not None and node != var_node:
                out.append("</span>")
                var_node = None
            if isinstance(it, list):
                kind, name, _status = nodes.get(node, (None, None, None))
                if var_node is None and name and kind in _BINDING:
                    esc = html.escape(name)
                    out.append(f'<span class="sgl-var" title="variable {esc}" '
                               f'data-var="{esc}">')
                    var_node = node
                out.append(_span(it))
                continue
            k, t = it["k"], html.escape(it.get("t", ""))
            if k == "var":
                out.append(f'<span class="sgl-varname">{t}</span>')
            elif k == "role":
                out.append(f'<span class="sgl-role">{t}</span>')
            elif k == "mark":
                out.append(f'<span class="sgl-mark">{t}</span>')
            elif k == "err":
                out.append(f'<span class="sgl-error">{t}</span>')
            elif k == "perr":
                out.append(f'<div class="sgl-error">{t}</div>')
            elif k == "fork":
                out.append(f'<span class="sgl-mark">{t}</span>')
                for i, cid in enumerate(it.get("b", [])):
                    out.append(f'<span class="sgl-branch"><span class="sgl-mark">branch {i}'
                               f'</span> {lane(cid)}</span>')
        if var_node is not None:
            out.append("</span>")
        return "".join(out)

    return lane(root) if root is not None else ""


def _span(item: list) -> str:
    origin = ORIGIN_OF.get(item[1], "prompt")
    cls = "sgl-template sgl-prompt" if origin == "template" else f"sgl-{origin}"
    title = _title(item)
    title = f' title="{html.escape(title)}"' if title else ""
    return (f'<span class="{cls}"{_inline_attr(origin)}{title} data-node="{item[2]}">'
            f'{html.escape(item[0])}</span>')


def stream_stats(tl: Timeline, program: int, now_ns: int | None = None) -> dict:
    """Token counts of a program and its branches, and generated tokens per second."""
    pids = tl.family(program)
    nodes = [tl.nodes[i] for pid in pids for i in tl.programs[pid].nodes]
    node_ids = {n.id for n in nodes}
    hits = [e for e in tl.cache_events if isinstance(e, CacheHit) and e.node in node_ids]
    generated = sum(len(n.tokens) for n in nodes)
    forced = sum(t.forced for n in nodes for t in n.tokens)
    now = now_ns if now_ns is not None else time.monotonic_ns()
    spans = [((n.end_ns or now) - n.start_ns) for n in nodes
             if n.kind is NodeKind.GEN and n.start_ns is not None]
    seconds = sum(spans) / 1e9
    return {
        "prompt_tokens": sum(e.prompt_tokens for e in hits),
        "cached_tokens": sum(e.cached_tokens for e in hits),
        "generated_tokens": generated,
        "forced_tokens": forced,
        "tok_per_s": generated / seconds if seconds > 0 else 0.0,
    }


def _shown(tl: Timeline, program: int) -> list[NodeView]:
    """The program's Nodes that have started (a queued one has nothing to show yet)."""
    nodes = (tl.nodes[nid] for nid in tl.programs[program].nodes)
    return [n for n in nodes if n.status not in (Status.PENDING, Status.SKIPPED)]




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
            at = _common_prefix(sent, items)
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


def _common_prefix(a: list, b: list) -> int:
    """How many items a and b share from the start."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
