"""Two dialogs over the debugger: "re-run from here" (an edit of the selected Node: its new
value, or new sampling arguments) and "why this token" (a Gen's tokens one at a time, each
with the alternatives the model had and what the grammar masked)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from sgl_nb.language.token_info import choice_table
from sgl_nb.notebook.cell_program import parse_edit
from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.tracing.timeline import TokenView
from sgl_nb.tui.rows import NodeRow

DIALOG_CSS = """
RerunScreen, TokenScreen { align: center middle; }
#dialog { width: 80%; height: auto; max-height: 90%; padding: 1 2;
          border: round $accent; background: $panel; }
#dialog Input { margin-bottom: 1; }
#error { color: $error; }
"""


class RerunScreen(ModalScreen):
    """Dismissed with (value, sampling) to re-run, or None (escape)."""

    BINDINGS = [Binding("escape", "dismiss_none", "Cancel")]

    def __init__(self, row: NodeRow, current: str):
        super().__init__()
        self.row, self.current = row, current

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(Text(f"Re-run from #{self.row.number} {self.row.label}"))
            yield Label("New value (leave as it is to keep it; empty: generate again):")
            yield Input(self.current, id="value")
            if self.row.kind is NodeKind.GEN:
                yield Label("Sampling arguments, e.g. temperature=0.8 max_tokens=40 seed=2:")
                yield Input(id="sampling")
            yield Static(id="error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        try:
            self.dismiss(self.edit())
        except ValueError as e:
            self.query_one("#error", Static).update(Text(str(e)))

    def edit(self) -> tuple[object, dict]:
        sampling = self.query("#sampling")
        return parse_edit(self.row.kind, self.query_one("#value", Input).value,
                          sampling.first(Input).value if sampling else "")

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


class TokenScreen(ModalScreen):
    """One token of a Gen at a time: left / right move, escape closes."""

    BINDINGS = [Binding("escape,q", "dismiss", "Close"), Binding("left", "move(-1)", "Prev"),
                Binding("right", "move(1)", "Next")]

    def __init__(self, row: NodeRow, tokens: list[TokenView], index: int = -1):
        super().__init__()
        self.row, self.tokens = row, tokens
        self.index = index % len(tokens)
        self.plain = ""

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(id="token")

    def on_mount(self) -> None:
        self._show()

    def action_move(self, step: int) -> None:
        self.index = max(0, min(len(self.tokens) - 1, self.index + step))
        self._show()

    def _show(self) -> None:
        t = self.tokens[self.index]
        choice = t.choice()
        grammar = f"grammar allowed {t.allowed}" if t.allowed >= 0 else "no grammar"
        head = (f"#{self.row.number} {self.row.label} · token {self.index + 1} of "
                f"{len(self.tokens)}: {t.text!r} ({'forced' if t.forced else 'sampled'}; "
                f"{grammar})")
        self.plain = "\n".join([head, *choice_table(choice), "", "← → other tokens · esc"])
        self.query_one("#token", Static).update(Text(self.plain))
