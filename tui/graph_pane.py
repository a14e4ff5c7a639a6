"""The Node graph (one row per Node, fork branches indented, preds shown where they are
not simply the row above) and the Instructions of the selected Node. A Fork's branches
follow it one after the other, branch 0 first, each row tagged `b<i>`
(`rows.ordered_rows`)."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from sgl_nb.runtime.compiler.step_controller import Breakpoint
from sgl_nb.tui.rows import NodeRow, Position, Where

GLYPH = {"pending": "○", "running": "◐", "done": "✓", "error": "✗", "skipped": "–",
         "cancelled": "⊘"}
STATUS_STYLE = {"pending": "dim", "running": "yellow", "done": "green", "error": "bold red",
                "skipped": "dim strike", "cancelled": "magenta"}


class GraphPane(Vertical):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._rows: list[NodeRow] = []
        self._prompts: list[str] = []
        self._position: Position | None = None
        self._width = 0
        self.plain = ""

    def compose(self):
        yield OptionList(id="nodes")
        yield Static(id="instructions")

    def on_mount(self) -> None:
        self.border_title = "Nodes · Instructions"

    @property
    def nodes(self) -> OptionList:
        return self.query_one("#nodes", OptionList)

    @property
    def rows(self) -> list[NodeRow]:
        """The rows shown, in order (the list's highlighted index is one of them)."""
        return list(self._rows)

    def selected_row(self) -> NodeRow | None:
        i = self.nodes.highlighted
        return self._rows[i] if i is not None and i < len(self._rows) else None

    def show(self, rows: list[NodeRow], position: Position, bps: set[Breakpoint]) -> None:
        old_ids = [r.id for r in self._rows]
        keep = self.selected_row()
        self._rows = rows
        by_id = {r.id: r for r in rows}
        width = self.nodes.scrollable_content_region.width or 40
        prompts = [_prompt(r, rows[i - 1] if i else None, position, bps, by_id, width)
                   for i, r in enumerate(rows)]
        plain = [p.plain for p in prompts]
        if [r.id for r in rows] != old_ids or width != self._width:
            self._width = width
            self.nodes.set_options(Option(p) for p in prompts)
        else:
            for i, (p, old) in enumerate(zip(prompts, self._prompts)):
                if p.plain != old:
                    self.nodes.replace_option_prompt_at_index(i, p)
        self._prompts = plain
        ids = [r.id for r in rows]
        if position != self._position and position.node in ids:
            self.nodes.highlighted = ids.index(position.node)  # follow the program
        elif keep is not None and keep.id in ids:
            self.nodes.highlighted = ids.index(keep.id)
        elif rows and self.nodes.highlighted is None:
            self.nodes.highlighted = 0
        self._position = position
        self._show_instructions(position)
        self.plain = "\n".join(plain)

    def _show_instructions(self, position: Position) -> None:
        row = self.selected_row()
        text = Text()
        if row is not None:
            text.append(f"#{row.number} {row.label}\n", style="bold")
            for ins in row.instructions:
                text.append(f"  {ins}\n", style=_ins_style(ins))
            if row.id == position.node and position.where is Where.DECODE:
                text.append(f"  ▶ next: token {row.tokens + 1}\n", style="bold yellow")
            if row.tokens:
                text.append(f"  {row.tokens} tokens\n", style="dim")
        self.query_one("#instructions", Static).update(text)

    def on_option_list_option_highlighted(self, _event: OptionList.OptionHighlighted) -> None:
        if self._position is not None:
            self._show_instructions(self._position)


def _ins_style(ins: str) -> str:
    status = ins.split(" ", 2)[1] if " " in ins else ""
    return STATUS_STYLE.get(status, "")


def _prompt(r: NodeRow, prev: NodeRow | None, position: Position, bps: set[Breakpoint],
            by_id: dict[int, NodeRow], width: int) -> Text:
    current = r.id == position.node
    preds = [by_id[p].number for p in r.preds if p in by_id]
    preds_text = ""
    if preds and (prev is None or preds != [prev.number]):
        preds_text = " ← " + ",".join(f"#{n}" for n in preds)
    where = f" L{r.line}" if r.line else ""
    where += f" b{r.branch}" if r.branch is not None else ""  # which branch of its Fork
    room = max(8, width - 1 - (8 + 2 * r.depth + len(where) + len(preds_text)))
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("●" if any(bp.hits(r) for bp in bps) else " ", style="bold red")
    t.append("▶" if current else " ", style="bold yellow")
    t.append("  " * r.depth + f"#{r.number:<3}", style="bold" if current else "")
    t.append(f"{GLYPH.get(r.status, '?')} ", style=STATUS_STYLE.get(r.status, ""))
    label = r.label if len(r.label) <= room else r.label[: room - 1] + "…"
    t.append(label, style="reverse" if current else "")
    t.append(where, style="dim")
    t.append(preds_text, style="cyan")
    return t
