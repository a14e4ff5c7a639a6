"""The token stream: each generated token boxed in alternating shades (forced tokens, the
only ones a grammar allowed, in italics), the text around them dim, the current Node bold."""

from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from sgl_nb.tracing.timeline import Timeline
from sgl_nb.tui.rows import NodeRow, Position

SHADES = ("on #2a2f3a", "on #3b3450")


class TokensPane(VerticalScroll):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.plain = ""

    def compose(self):
        yield Static(id="tokens-text")

    def show(self, tl: Timeline, rows: list[NodeRow], position: Position) -> None:
        numbers = {r.id: r.number for r in rows}
        text, count = Text(), 0
        for n in tl.nodes.values():
            current = n.id == position.node
            if n.tokens:
                if text and not text.plain.endswith("\n"):
                    text.append("\n")  # each Gen on a line of its own
                text.append(f"⟨#{numbers.get(n.id, '?')} {n.name or n.kind}⟩",
                            style="bold cyan" if current else "cyan")
                for k, tok in enumerate(n.tokens):
                    style = SHADES[k % 2] + (" italic" if tok.forced else "")
                    style += " bold underline" if current else ""
                    text.append(_visible(tok.text), style=style)
                count += len(n.tokens)
            elif n.text:
                text.append(_visible(n.text), style="dim")
        if position.where == "decode":
            text.append("▮", style="bold yellow")  # where the next token goes
        self.border_title = f"Tokens · {count} generated"
        self.plain = text.plain
        self.query_one("#tokens-text", Static).update(text)
        self.call_after_refresh(self.scroll_end, animate=False)


def _visible(s: str) -> str:
    """Newlines stay line breaks but show; other control characters show as escapes."""
    out = s.replace("\n", "⏎\n")
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in out)
