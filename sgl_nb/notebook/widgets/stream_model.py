"""The stream view's model: what it shows of a program, built from the Timeline alone
(pure Python: no widget, no kernel), so a live run and a replay show the same.

Each piece is coloured by where its tokens came from: prompt (computed by a prefill),
cached (read from the radix cache instead), generated (sampled), grammar-forced (the
grammar allowed one token only), or drafted (a prompt-lookup draft the model agreed with,
runtime/prompt_lookup.py). A generated token shows its probability on hover (the
title). Roles and variables are marked; each fork branch has its own lane under its Fork.

`StreamModel` turns the Timeline into lanes of items (one lane a program, fork branches
included) on each render; `stream_stats` counts its tokens; `render_html` draws lanes as
HTML (the static copy). An item is a piece `[text, origin, node, p, token]` (a token; its
title is derived), `[text, origin, node]` or `[text, origin, node, None, None, title]`,
origin one of p(rompt) c(ached) g(enerated) f(orced) d(rafted) t(emplate); or a marker
`{"k": role|var|mark|fork|err|perr, "t": text, "n": node}` (a fork's `"b"` lists its
branches' lanes, in branch order). The view (stream.py) sends them.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

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
# The origins' colours, inline in the static copy as well: JupyterLab's sanitizer drops a
# <style> block in an output it does not trust (a saved notebook opened without its kernel).
INLINE = {"cached": "background:#dbeafe", "generated": "background:#dcfce7",
          "forced": "background:#fef3c7", "drafted": "background:#cffafe",
          "template": "color:#888"}


def inline_attr(origin: str) -> str:
    return f' style="{INLINE[origin]}"' if origin in INLINE else ""


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
    return (f'<span class="{cls}"{inline_attr(origin)}{title} data-node="{item[2]}">'
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
