"""The radix cache: its tree (live, read from the engine at most a few times a second) or,
in a replay, the changes the trace recorded (hits, inserts, evictions)."""

from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

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
        if e.kind == "cache_hit":
            cached, prompt = e.data.get("cached_tokens", 0), e.data.get("prompt_tokens", "?")
            t.append(f"hit     {cached}/{prompt} tokens{where}\n",
                     style="green" if cached else "")
        elif e.kind == "cache_insert":
            t.append(f"insert  +{e.data.get('tokens', 0)} tokens{where}\n", style="cyan")
        else:
            t.append(f"evict   -{e.data.get('tokens', 0)} tokens\n", style="yellow")
    return t
