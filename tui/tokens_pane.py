"""The token stream: each generated token boxed in alternating shades (forced tokens, the
only ones a grammar allowed, in italics; drafted ones, prompt-lookup drafts the model
agreed with, in DRAFTED's colour), the text around them dim, the current Node bold.

A Fork's branches run side by side, so their tokens arrive interleaved; the pane shows
each branch in a lane of its own under the fork point (a box titled "branch i", branch 0
first), holding only that branch's text and tokens, and the parent's text after the Join
below the lanes; the current Node's lane is titled `▶ branch i` and kept in view. `plain`
is the same outline as text: a lane is `╭─ branch i`, its lines each behind `│ `, then
`╰─`."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text
from textual.containers import VerticalScroll
from textual.geometry import Region
from textual.widgets import Static

from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.tracing.timeline import NodeView, Timeline
from sgl_nb.tui.rows import NodeRow, Position, Where

SHADES = ("on #2a2f3a", "on #3b3450")
DRAFTED = "#67e8f9"  # prompt lookup's accepted drafts (runtime/prompt_lookup.py)
LANE_STYLE = "cyan"
CURRENT = "▶"  # before the title of the current Node's lane


@dataclass
class Lane:
    """One fork branch's part of the stream: text runs and its own branches' lanes."""

    label: str
    blocks: list[Text | Lane] = field(default_factory=list)
    current: bool = False  # the current Node is its branch's (not of a lane inside it)
    ended: bool = False  # its program has finished


class TokensPane(VerticalScroll):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.plain = ""
        self.blocks: list[Text | Lane] = []  # what is shown, for tests to read lane by lane
        self._follow_lane = False  # the current Node is in a fork branch

    def compose(self):
        yield Static(id="tokens-text")

    def show(self, tl: Timeline, rows: list[NodeRow], position: Position) -> None:
        program = next((r.program for r in rows if r.id == position.node), None)
        stream = _Stream(tl, {r.id: r.number for r in rows}, position, program)
        self.blocks = stream.blocks()
        self.border_title = f"Tokens · {stream.count} generated"
        self.plain = "\n".join(_plain(b) for b in self.blocks)
        self.query_one("#tokens-text", Static).update(_renderable(self.blocks))
        self._follow_lane = stream.in_lane
        self.call_after_refresh(self._follow)

    def _follow(self) -> None:
        """Keep where the program stands in view: the end of the stream, or, while it is
        in a fork branch, that branch's ▮ (or its lane's title), which may be above the
        other lanes."""
        static = self.query_one("#tokens-text", Static)
        width, height = static.size
        if not self._follow_lane or not width or not height:
            self.scroll_end(animate=False)
            return
        lines = [strip.text for strip in static.render_lines(Region(0, 0, width, height))]
        y = next((k for k, line in enumerate(lines) if "▮" in line), None)
        if y is None:
            y = next((k for k, line in enumerate(lines) if f"─ {CURRENT} " in line), None)
        if y is None:
            self.scroll_end(animate=False)
        else:  # the line a third of the way down
            self.scroll_to(y=max(0, y - self.scrollable_content_region.height // 3),
                           animate=False)


class _Stream:
    """The blocks of the stream: the root programs' text runs, a Lane per fork branch
    right after its Fork (in the fork event's order), and last any program no Fork of
    this timeline names (not expected), in a lane of its own."""

    def __init__(self, tl: Timeline, numbers: dict[int, int], position: Position,
                 program: int | None):
        self.tl, self.numbers, self.position = tl, numbers, position
        self.program = program  # the current Node's program: its lane is highlighted
        self.forks = tl.fork_children()
        self.count = 0
        self._walked: set[int] = set()
        self._cursor = False  # the ▮ of a decode stop is placed
        self.in_lane = False  # the current Node's program is a fork branch shown here

    def blocks(self) -> list[Text | Lane]:
        branches = {cid for children in self.forks.values() for cid in children}
        out: list[Text | Lane] = []
        for pid in self.tl.programs:
            if pid not in branches and pid not in self._walked:
                out += self._program(pid)
        for pid, p in self.tl.programs.items():
            if pid not in self._walked and p.nodes:
                out.append(self._lane(pid, p.function or f"program {pid}"))
        if self.position.where is Where.DECODE and not self._cursor:
            out.append(Text("▮", style="bold yellow"))  # its Node is not in the events yet
        return _tidy(out)

    def _program(self, pid: int) -> list[Text | Lane]:
        self._walked.add(pid)
        out: list[Text | Lane] = []
        text = Text()
        for nid in self.tl.programs[pid].nodes:
            n = self.tl.nodes[nid]
            self._node(text, n)
            children = self.forks.get(nid, []) if n.kind is NodeKind.FORK else []
            if children:
                out.append(text)
                out += [self._lane(cid, f"branch {i}") for i, cid in enumerate(children)
                        if cid not in self._walked]
                text = Text()
        out.append(text)
        return out

    def _lane(self, pid: int, label: str) -> Lane:
        current = pid == self.program
        self.in_lane = self.in_lane or current
        if pid not in self.tl.programs:  # named by its fork, no event of its own yet
            self._walked.add(pid)
            return Lane(label, current=current)
        ended = self.tl.programs[pid].status.ended
        return Lane(label, _tidy(self._program(pid)), current=current, ended=ended)

    def _node(self, text: Text, n: NodeView) -> None:
        current = n.id == self.position.node
        if n.tokens:
            if text and not text.plain.endswith("\n"):
                text.append("\n")  # each Gen on a line of its own
            text.append(f"⟨#{self.numbers.get(n.id, '?')} {n.name or n.kind}⟩",
                        style="bold cyan" if current else "cyan")
            for k, tok in enumerate(n.tokens):
                style = SHADES[k % 2] + (" italic" if tok.forced else "")
                style += f" {DRAFTED}" if tok.drafted else ""
                style += " bold underline" if current else ""
                text.append(_visible(tok.text), style=style)
            self.count += len(n.tokens)
        elif n.text:
            text.append(_visible(n.text), style="dim")
        if current and self.position.where is Where.DECODE:
            text.append("▮", style="bold yellow")  # where the next token goes
            self._cursor = True


def _tidy(blocks: list[Text | Lane]) -> list[Text | Lane]:
    """Without empty text runs; a run before a lane without its last line break (the lane
    starts a line anyway, and the break shows as ⏎)."""
    out = [b for b in blocks if not isinstance(b, Text) or b.plain]
    for b, after in zip(out, out[1:]):
        if isinstance(b, Text) and isinstance(after, Lane) and b.plain.endswith("\n"):
            b.right_crop(1)
    return out


def _renderable(blocks: list[Text | Lane]) -> RenderableType:
    if len(blocks) == 1 and isinstance(blocks[0], Text):
        return blocks[0]
    if not blocks:
        return Text()
    return Group(*(b if isinstance(b, Text) else _panel(b) for b in blocks))


def _panel(lane: Lane) -> Panel:
    empty = Text("(no text)" if lane.ended else "(nothing yet)", style="dim")
    body = _renderable(lane.blocks) if lane.blocks else empty
    title = (Text(f"{CURRENT} {lane.label}", style=f"bold {LANE_STYLE}") if lane.current
             else Text(lane.label, style=LANE_STYLE))
    return Panel(body, title=title, title_align="left", box=box.ROUNDED,
                 border_style=f"bold {LANE_STYLE}" if lane.current else f"dim {LANE_STYLE}",
                 padding=(0, 1))


def _plain(block: Text | Lane) -> str:
    if isinstance(block, Text):
        return block.plain
    inner = "\n".join(_plain(b) for b in block.blocks)
    body = "".join(f"│ {line}\n" for line in inner.split("\n")) if inner else ""
    return f"╭─ {block.label}\n{body}╰─"


def _visible(s: str) -> str:
    """Newlines stay line breaks but show; other control characters show as escapes."""
    out = s.replace("\n", "⏎\n")
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in out)
