"""The Call stack panel: the frames of nested calls (`outer` calling `inner(s)`), outermost
first, as pudb and the JupyterLab debugger show them, with the current frame marked: the
innermost frame of the Node the program is at (held by the stepper, or running).

A Node records the function names of the stack it was added under (`node.stack`); the
program's body keeps its live frames with their arguments (`state.call_stack`). The body
runs ahead of the executor (it records Nodes until it reads a generated value), so the
frames shown are the current Node's, with the arguments of the live frame of the same
depth and function where there is one.
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


def frames_of(node_stack, live_frames: list[dict], line: int | None = None,
              source: str = "") -> list[Frame]:
    """The frames of a Node's stack, outermost first; the innermost is the current one."""
    live = list(live_frames)
    out = []
    names = list(node_stack)
    for depth, name in enumerate(names):
        frame = live[depth] if depth < len(live) else None
        args = ""
        if frame is not None and frame.get("function") == name:
            args = ", ".join(f"{k}={v!r}" for k, v in (frame.get("args") or {}).items())
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
