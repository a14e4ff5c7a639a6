"""`sgl-nb diff A.jsonl B.jsonl` in a terminal: the two runs' Nodes side by side, aligned
(a Node only one run has leaves the other side empty), the first divergent Node
highlighted and selected, and below, for the selected Node, both outputs, where they part
and the token alternatives there (sgl_nb/language/diff.py computes it all)."""

from __future__ import annotations

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Footer, Header, Static

from sgl_nb.language.diff import (
    MARKS,
    NodePair,
    PairOp,
    RunDiff,
    divergence_lines,
    fit,
    settings_lines,
    summary,
)

ROW_STYLE = {PairOp.CHANGED: "yellow", PairOp.REMOVED: "red", PairOp.ADDED: "green"}
LABEL_WIDTH = 34  # characters of a Node's label; the detail pane shows all of it


class DiffApp(App):
    TITLE = "sgl-nb diff"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #status { height: 1; padding: 0 1; background: $boost; }
    #nodes { height: 3fr; border: round $primary-darken-1; }
    #detail { height: 2fr; border: round $primary-darken-1; padding: 0 1; }
    #nodes:focus { border: round $accent; }
    """
    BINDINGS = [
        Binding("n", "next_diff", "Next difference"),
        Binding("N", "previous_diff", "Previous difference"),
        Binding("p", "previous_diff", "Previous difference", show=False),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, d: RunDiff):
        super().__init__()
        self.diff = d
        self.status_text = ""  # plain text of the status line and the detail pane (tests)
        self.detail_text = ""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="status")
        yield DataTable(id="nodes", cursor_type="row", zebra_stripes=False)
        with VerticalScroll(id="detail"):
            yield Static(id="detail-text")
        yield Footer()

    def on_mount(self) -> None:
        a, b = self.diff.names
        self.sub_title = f"{a} | {b}"
        table = self.query_one(DataTable)
        table.border_title = "Nodes"
        table.add_columns("", "Node", a, b, "tokens", "cached", "seconds")
        # The two outputs share what the Node label and the figures leave of the width.
        width = max(12, (self.size.width - LABEL_WIDTH - 50) // 2)
        for i, p in enumerate(self.diff.pairs):
            table.add_row(*_cells(p, p is self.diff.first, width), key=str(i))
        self.query_one("#detail").border_title = "Selected Node"
        table.focus()
        first = self.diff.differing
        self._select(first[0] if first else 0, "")

    # ---- moving ------------------------------------------------------------------------

    @property
    def selected(self) -> int:
        return self.query_one(DataTable).cursor_row

    def _select(self, row: int, message: str) -> None:
        self.query_one(DataTable).move_cursor(row=row)
        self._show(row, message)

    def action_next_diff(self) -> None:
        later = [i for i in self.diff.differing if i > self.selected]
        if later:
            self._select(later[0], "")
        else:
            self._show(self.selected, "no later difference")

    def action_previous_diff(self) -> None:
        earlier = [i for i in self.diff.differing if i < self.selected]
        if earlier:
            self._select(earlier[-1], "")
        else:
            self._show(self.selected, "no earlier difference")

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show(event.cursor_row, "")

    # ---- drawing -----------------------------------------------------------------------

    def _show(self, row: int, message: str) -> None:
        d = self.diff
        place = ""
        if d.pairs and 0 <= row < len(d.pairs):
            n = d.differing.index(row) + 1 if row in d.differing else None
            place = f"  ·  Node {row + 1}/{len(d.pairs)}" + (
                f", difference {n}/{len(d.differing)}" if n else "")
        self.status_text = summary(d) + place + (f"  ·  {message}" if message else "")
        self.query_one("#status", Static).update(Text(self.status_text))
        text = _detail(d, d.pairs[row]) if 0 <= row < len(d.pairs) else Text("no Nodes")
        self.detail_text = text.plain
        self.query_one("#detail-text", Static).update(text)


def _cells(p: NodePair, first: bool, width: int) -> list[Text]:
    style = ROW_STYLE.get(p.op, "")
    if first:
        style = "bold reverse " + style  # the first divergence stands out
    indent = "  " * len(p.branch) + (f"[{p.branch[-1][1]}] " if p.branch else "")
    same = p.op is PairOp.SAME
    return [Text(MARKS[p.op], style=style), Text(fit(indent + p.label, LABEL_WIDTH), style),
            Text(_output(p.a, width), style), Text("=" if same else _output(p.b, width), style),
            Text(_pair_figure(p, "output_tokens"), style=style),
            Text(_pair_figure(p, "cached_tokens"), style=style),
            Text(_pair_seconds(p), style=style)]


def _output(n, width: int) -> str:
    return "" if n is None else fit(repr(n.text), width)


def _pair_figure(p: NodePair, key: str) -> str:
    a = "" if p.a is None else str(p.a.usage.get(key, ""))
    b = "" if p.b is None else str(p.b.usage.get(key, ""))
    return f"{a}|{b}" if a or b else ""


def _pair_seconds(p: NodePair) -> str:
    def s(n) -> str:
        return "" if n is None or n.seconds is None else f"{n.seconds:.2f}"

    return f"{s(p.a)}|{s(p.b)}"


def _detail(d: RunDiff, p: NodePair) -> Text:
    a, b = d.names
    t = Text()
    words = {PairOp.SAME: "the same in both runs", PairOp.CHANGED: "differs",
             PairOp.REMOVED: f"only in {a}", PairOp.ADDED: f"only in {b}"}
    t.append(f"{p.place}: {words[p.op]}\n", style="bold " + ROW_STYLE.get(p.op, ""))
    for name, n in ((a, p.a), (b, p.b)):
        if n is not None:
            t.append(f"{name} ({n.status}): ", style="bold")
            t.append(f"{n.text!r}\n")
    if p.divergence is not None:
        t.append("\n".join(divergence_lines(p.divergence, d.names)) + "\n")
    if p.params:
        t.append("parameters differ: " + "; ".join(str(c) for c in p.params) + "\n",
                 style="cyan")
    settings = settings_lines(d)
    if settings:
        t.append("\nThe runs\n", style="bold")
        t.append("\n".join(settings) + "\n")
    return t
