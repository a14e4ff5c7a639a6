"""The program's source, with the current line, breakpoints and the failing line marked."""

from __future__ import annotations

from pathlib import Path

from rich.syntax import Syntax
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

CURRENT = "on #264f78"
FAILED = "on #6e1b1b"


class SourcePane(VerticalScroll):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._file: str | None = None
        self._lines: list[Text] = []
        self.plain = ""  # what the pane shows, as plain text (tests read it)

    def compose(self):
        yield Static(id="source-text")

    def show(self, file: str | None, current: int | None, breakpoint_lines: set[int],
             error_line: int | None) -> None:
        if file != self._file:
            self._file, self._lines = file, _load(file)
        self.border_title = f"Source · {Path(file).name}" if file else "Source"
        if not self._lines:
            text = Text(f"source not available{': ' + file if file else ''}", style="dim")
        else:
            text = Text("\n").join(self._line(i, line, current, breakpoint_lines, error_line)
                                   for i, line in enumerate(self._lines, 1))
        self.plain = text.plain
        self.query_one("#source-text", Static).update(text)
        target = error_line or current
        if target:
            self.call_after_refresh(self.scroll_to, y=max(0, target - 1 - self.size.height // 3),
                                    animate=False)

    @staticmethod
    def _line(i: int, code: Text, current: int | None, bps: set[int],
              error_line: int | None) -> Text:
        mark = "▶" if i == current else " "
        dot = Text("●", style="bold red") if i in bps else Text(" ")
        line = Text.assemble(dot, Text(f"{mark}{i:>4} ", style="dim" if i != current else "bold"),
                             code)
        if i == error_line:
            line.stylize(FAILED)
        elif i == current:
            line.stylize(CURRENT)
        return line


def _load(file: str | None) -> list[Text]:
    if not file:
        return []
    try:
        code = Path(file).read_text()
    except OSError:
        return []
    highlighted = Syntax(code, "python", theme="monokai").highlight(code)
    return highlighted.split("\n", allow_blank=True)[: code.count("\n") + 1]
