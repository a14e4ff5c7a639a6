"""The radix cache: its tree as the events built it (the Timeline's cache_tree, live and
in a replay alike) or, from a trace recorded before the tree's own events existed, the
changes it recorded (hits, inserts, evictions)."""

from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from sgl_nb.runtime.events import CacheEvict, CacheHit, CacheInsert
from sgl_nb.tracing.timeline import Timeline
from sgl_nb.tui.rows import NodeRow

MAX_CHANGES = 200


class CachePane(VerticalScroll):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.plain = ""

    def compose(self):
        yield Static(id="cache-text")

    def on_mount(self) -> None:
        self.border_title = "Radix cache"

    def show(self, tl: Timeline, rows: list[NodeRow], tree: str | None) -> None:
        c = tl.cache
        t = Text(f"this run: {c['cached_tokens']}/{c['prompt_tokens']} prompt tokens cached, "
                 f"+{c['inserted']} -{c['evicted']}\n", style="bold")
        if tree is not None:
            t.append(tree)
        else:
            t.append_text(_changes(tl, rows))
        self.plain = t.plain
        self.query_one("#cache-text", Static).update(t)


def _changes(tl: Timeline, rows: list[NodeRow]) -> Text:
    numbers = {r.id: r.number for r in rows}
    t = Text()
    if not tl.cache_events:
        t.append("no cache changes yet", style="dim")
    for e in tl.cache_events[-MAX_CHANGES:]:
        where = f"  #{numbers[e.node]}" if e.node in numbers else ""
        if isinstance(e, CacheHit):
            t.append(f"hit     {e.cached_tokens}/{e.prompt_tokens} tokens{where}\n",
                     style="green" if e.cached_tokens else "")
        elif isinstance(e, CacheInsert):
            t.append(f"insert  +{e.tokens} tokens{where}\n", style="cyan")
        elif isinstance(e, CacheEvict):
            t.append(f"evict   -{e.tokens} tokens\n", style="yellow")
    return t
