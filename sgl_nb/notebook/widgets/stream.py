"""The stream view: a program's text as it is generated, from the Timeline.

Each piece is coloured by where its tokens came from: prompt (computed by a prefill),
cached (read from the radix cache instead), generated (sampled), or grammar-forced (the
grammar allowed one token only). A generated token shows its probability on hover (the
HTML title). Roles and variables are marked; fork branches follow their Fork.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import ipywidgets as W
from traitlets import Float, Int, Unicode

from sgl_nb.tracing.timeline import NodeView, Timeline

ORIGINS = ("prompt", "cached", "generated", "forced")
_STYLE = """<style>
.sgl-stream{white-space:pre-wrap;font-family:monospace;font-size:12px;line-height:1.5;
 max-height:360px;overflow:auto;border:1px solid #ddd;padding:6px}
.sgl-prompt{color:#333}.sgl-cached{background:#dbeafe}.sgl-generated{background:#dcfce7}
.sgl-forced{background:#fef3c7}.sgl-role{background:#ede9fe;color:#5b21b6;border-radius:3px;
 padding:0 3px;font-size:10px;margin-right:2px}.sgl-template{color:#888}
.sgl-var{border-bottom:2px solid #16a34a}.sgl-varname{font-size:9px;color:#15803d;
 vertical-align:super;margin-left:1px}.sgl-branch{display:block;border-left:3px solid #a78bfa;
 margin:2px 0 2px 8px;padding-left:6px}.sgl-mark{color:#7c3aed;font-size:10px}
.sgl-error{color:#b91c1c;font-weight:bold}.sgl-legend span{padding:0 4px;margin-right:4px}
</style>"""
_LEGEND = ('<div class="sgl-legend">' + "".join(
    f'<span class="sgl-{o}">{o}</span>' for o in ORIGINS) + "</div>")


@dataclass
class Piece:
    """A run of characters of one origin; `start` is its offset in the program's text."""

    start: int
    text: str
    origin: str  # prompt | cached | generated | forced | template (role markers)
    title: str = ""


class StreamModel:
    """What the view shows of one program: built from the Timeline on each render.
    `node_text(view)` supplies a text Node's text when the events did not carry it;
    `cached_chars(prompt, n)` says how many characters the first n tokens of prompt span."""

    def __init__(self, tl: Timeline, program: int, node_text: Callable[[NodeView], str | None],
                 cached_chars: Callable[[str, int], int],
                 forks: dict[int, list[int]] | None = None):
        self.tl, self.program = tl, program
        self.forks = forks  # fork Node id -> its branches' program ids, kept by the caller
        self._built: tuple[str, str] | None = None
        self.node_text, self.cached_chars = node_text, cached_chars

    def html(self) -> str:
        body, _ = self._whole()
        return f'{_STYLE}{_LEGEND}<div class="sgl-stream">{body}</div>'

    def text(self) -> str:
        return self._whole()[1]

    def _whole(self) -> tuple[str, str]:
        # A model lives for one render: build the program's HTML and text once.
        if self._built is None:
            self._built = self._program_html(self.program, "")
        return self._built

    def _program_html(self, pid: int, prefix: str) -> tuple[str, str]:
        """(HTML, text) of program `pid`, whose text starts after `prefix` (a fork branch
        starts with its parent's text)."""
        p = self.tl.programs.get(pid)
        if p is None:
            return "", ""
        out, text, requests = [], prefix, []
        pending: list[tuple[NodeView, list[Piece]]] = []
        for nid in p.nodes:
            n = self.tl.nodes[nid]
            if n.kind in ("Gen", "Select"):
                requests.append((len(text), self._cached_tokens(n)))
            pieces = self._pieces(n, len(text))
            text += "".join(pc.text for pc in pieces)
            pending.append((n, pieces))
        for n, pieces in pending:
            out.append(self._node_html(n, self._split_cached(pieces, requests, text)))
            if n.kind == "Fork":
                out.extend(self._branches(self._fork_children(n, p.children),
                                          prefix + self._text_at(pending, n)))
        if p.error:
            out.append(f'<div class="sgl-error">{html.escape(p.error)}</div>')
        return "".join(out), text[len(prefix):]

    def _fork_children(self, fork: NodeView, children: list[int]) -> list[int]:
        """The branches this Fork made (a program may fork more than once)."""
        if self.forks is None:
            self.forks = fork_children(self.tl.events)
        return self.forks.get(fork.id, children)

    def _text_at(self, pending: list, fork: NodeView) -> str:
        text = ""
        for n, pieces in pending:
            if n is fork:
                break
            text += "".join(pc.text for pc in pieces)
        return text

    def _branches(self, children: list[int], text_at_fork: str) -> list[str]:
        out = []
        for i, cid in enumerate(children):
            body, _ = self._program_html(cid, text_at_fork)
            out.append(f'<span class="sgl-branch"><span class="sgl-mark">branch {i}</span> '
                       f'{body}</span>')
        return out

    def _cached_tokens(self, n: NodeView) -> int:
        hits = [e.data.get("cached_tokens") or 0 for e in self.tl.cache_events
                if e.kind == "cache_hit" and e.node == n.id]
        return max(hits, default=0)

    def _pieces(self, n: NodeView, start: int) -> list[Piece]:
        if n.tokens and n.kind != "Select":
            return self._token_pieces(n, start)
        text = n.text if n.text is not None else self.node_text(n)
        if not text:
            return []
        if n.kind == "Select":
            return [Piece(start, text, "generated", "chosen by select")]
        if n.kind == "Gen":  # its text without token events (a backend that sends none)
            return [Piece(start, text, "generated")]
        origin = "template" if n.kind in ("RoleBegin", "RoleEnd") else "prompt"
        return [Piece(start, text, origin)]

    def _token_pieces(self, n: NodeView, start: int) -> list[Piece]:
        """One piece per generated token. Once the Node has finished, its text is what the
        program kept: a matched stop string is cut, so the tokens are clipped to it."""
        pieces, pos = [], start
        for t in n.tokens:
            p = math.exp(t.logprob) if t.logprob is not None else None
            title = (f"p={p:.3f}" if p is not None else "p=?") + f" token {t.token}"
            if t.forced:
                title += " (forced by the grammar)"
            pieces.append(Piece(pos, t.text, "forced" if t.forced else "generated", title))
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
            out.append(Piece(pc.start, pc.text[:left], pc.origin, pc.title))
            left -= len(pc.text)
        return out

    def last_request(self) -> tuple[str, list[int]]:
        """The prompt text of the program's last Gen and the token ids it generated: the
        engine's own token sequence (for the cache tree's path), or ("", [])."""
        p = self.tl.programs.get(self.program)
        text, last = "", ("", [])
        for nid in p.nodes if p else []:
            n = self.tl.nodes[nid]
            if n.kind == "Gen":
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
            if req is None or req[1] == 0:
                out.append(pc)
                continue
            limit = self.cached_chars(text[:req[0]], req[1])
            cut = max(0, min(len(pc.text), limit - pc.start))
            if cut:
                out.append(Piece(pc.start, pc.text[:cut], "cached", f"{pc.origin}, cached"))
            if cut < len(pc.text):
                out.append(Piece(pc.start + cut, pc.text[cut:], pc.origin, pc.title))
        return out

    def _node_html(self, n: NodeView, pieces: list[Piece]) -> str:
        spans = "".join(_span(pc) for pc in pieces)
        if n.kind == "RoleBegin":
            role = (n.label or "").split(" ")[-1] or "role"
            return f'<span class="sgl-role">{html.escape(role)}</span>{spans}'
        if n.kind in ("Gen", "Select") and n.name:
            name = html.escape(n.name)
            return (f'<span class="sgl-var" title="variable {name}" data-var="{name}">{spans}'
                    f'<span class="sgl-varname">{name}</span></span>')
        if n.kind in ("Fork", "Join"):
            return f'<span class="sgl-mark">[{html.escape(n.label or n.kind)}]</span>'
        if n.error:
            return f'{spans}<span class="sgl-error"> {html.escape(n.error)}</span>'
        return spans


def fork_children(events) -> dict[int, list[int]]:
    """Fork Node id -> the program ids of its branches, from the fork events."""
    return {e.node: list(e.data["children"]) for e in events
            if e.kind == "fork" and e.data.get("children")}


def _span(pc: Piece) -> str:
    cls = "sgl-template sgl-prompt" if pc.origin == "template" else f"sgl-{pc.origin}"
    title = f' title="{html.escape(pc.title)}"' if pc.title else ""
    return f'<span class="{cls}"{title}>{html.escape(pc.text)}</span>'


def stream_stats(tl: Timeline, program: int, now_ns: int | None = None) -> dict:
    """Token counts of a program and its branches, and generated tokens per second."""
    pids = _family(tl, program)
    nodes = [tl.nodes[i] for pid in pids for i in tl.programs[pid].nodes]
    node_ids = {n.id for n in nodes}
    hits = [e for e in tl.cache_events if e.kind == "cache_hit" and e.node in node_ids]
    generated = sum(len(n.tokens) for n in nodes)
    forced = sum(t.forced for n in nodes for t in n.tokens)
    now = now_ns if now_ns is not None else time.monotonic_ns()
    spans = [((n.end_ns or now) - n.start_ns) for n in nodes
             if n.kind == "Gen" and n.start_ns is not None]
    seconds = sum(spans) / 1e9
    return {
        "prompt_tokens": sum(e.data.get("prompt_tokens") or 0 for e in hits),
        "cached_tokens": sum(e.data.get("cached_tokens") or 0 for e in hits),
        "generated_tokens": generated,
        "forced_tokens": forced,
        "tok_per_s": generated / seconds if seconds > 0 else 0.0,
    }


def _family(tl: Timeline, program: int) -> list[int]:
    out, todo = [], [program]
    while todo:
        pid = todo.pop()
        if pid in tl.programs and pid not in out:
            out.append(pid)
            todo.extend(tl.programs[pid].children)
    return out


class StreamView(W.VBox):
    """The text so far (`text`), the coloured HTML (`html_view.value`) and the counts."""

    text = Unicode("").tag(sync=True)
    status = Unicode("waiting").tag(sync=True)
    prompt_tokens = Int(0).tag(sync=True)
    cached_tokens = Int(0).tag(sync=True)
    generated_tokens = Int(0).tag(sync=True)
    forced_tokens = Int(0).tag(sync=True)
    tok_per_s = Float(0.0).tag(sync=True)

    def __init__(self, **kwargs):
        self.header = W.HTML("")
        self.html_view = W.HTML("")
        self.html_view.add_class("sgl-stream-view")
        super().__init__(children=[self.header, self.html_view], **kwargs)

    def update(self, model: StreamModel, status: str) -> None:
        """Set every trait from the model; call inside hold_sync (one message)."""
        stats = stream_stats(model.tl, model.program)
        self.text = model.text()
        self.html_view.value = model.html()
        self.status = status
        for k in ("prompt_tokens", "cached_tokens", "generated_tokens", "forced_tokens"):
            setattr(self, k, stats[k])
        self.tok_per_s = round(stats["tok_per_s"], 2)
        self.header.value = (
            f"<b>{html.escape(status)}</b> · prompt {self.prompt_tokens} tokens "
            f"({self.cached_tokens} cached) · generated {self.generated_tokens}"
            f"{f' ({self.forced_tokens} forced)' if self.forced_tokens else ''} · "
            f"{self.tok_per_s:.1f} tok/s")

    def widgets(self) -> list:
        return [self, self.header, self.html_view]
