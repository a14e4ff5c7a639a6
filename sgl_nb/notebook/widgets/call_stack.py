"""The Call stack panel: the frames of nested calls (`outer` calling `inner(s)`), outermost
first, as pudb and the JupyterLab debugger show them, with the current frame marked: the
innermost frame of the Node the program is at (held by the stepper, or running).

A Node's events name the function names of the stack it was added under (`stack`) and
each frame's arguments (`stack_args`, taken from the body's live frames as the Node was
queued), so the panel reads the Timeline alone: a replay shows the same frames.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from sgl_nb.notebook.widgets.keyed import Item, KeyedView

_CSS = """
.sgl-stack{font-family:monospace;font-size:12px;max-height:240px;overflow:auto;
 border:1px solid #ddd;padding:4px;min-width:220px}
.sgl-frame{white-space:pre;padding:1px 4px}.sgl-frame.sgl-current{background:#fde68a;
 font-weight:bold}.sgl-frame-src{color:#555;padding-left:24px;white-space:pre}
"""


@dataclass(frozen=True)
class Frame:
    function: str
    args: str = ""  # the call's arguments, when the live frame is known
    line: int | None = None  # the current Node's line (innermost frame only)
    source: str = ""  # that line as written
    current: bool = False


def frames_of(node_stack, stack_args, line: int | None = None,
              source: str = "") -> list[Frame]:
    """The frames of a Node's stack, outermost first; the innermost is the current one.
    stack_args: each frame's arguments as text, as its events carry them ("": unknown)."""
    out = []
    names, given = list(node_stack), list(stack_args)
    for depth, name in enumerate(names):
        args = given[depth] if depth < len(given) else ""
        innermost = depth == len(names) - 1
        out.append(Frame(name, args, line if innermost else None,
                         source if innermost else "", innermost))
    return out


class CallStackPanel(KeyedView):
    """`frames`: what the panel shows now, outermost first (not synced: the rows are)."""

    _css = _CSS

    def __init__(self, **kwargs):
        super().__init__(root_class="sgl-stack", items=[_empty("not started")], **kwargs)
        self.frames: list[Frame] = []
        self.node: int | None = None  # the Node whose stack this is

    def update(self, frames: list[Frame], node: int | None, idle: str = "") -> None:
        self.frames, self.node = frames, node
        self.show([_row(i, f, node) for i, f in enumerate(frames)] or [_empty(idle)])

    @property
    def current(self) -> Frame | None:
        return next((f for f in self.frames if f.current), None)

    def names(self) -> list[str]:
        return [f.function for f in self.frames]


def _empty(why: str) -> Item:
    return Item("none", f'<i class="sgl-frame">{html.escape(why or "no frames")}</i>')


def _row(depth: int, f: Frame, node: int | None) -> Item:
    cur = " sgl-current" if f.current else ""
    where = f" line {f.line}" if f.line else ""
    at = f' data-node="{node}"' if f.current and node is not None else ""
    src = (f'<div class="sgl-frame-src">{html.escape(f.source)}</div>'
           if f.current and f.source else "")
    return Item(f"f{depth}:{f.function}",
                f'<div class="sgl-frame{cur}"{at}>{"▶" if f.current else " "} '
                f'{html.escape(f.function)}({html.escape(f.args)}){where}</div>{src}')
