"""The stepper: a program's Node graph with the current Node and Instruction highlighted,
the buttons Step node / Step instruction / Continue / Pause, and breakpoints on Nodes.
Each Node's row shows its timing (queue, prefill, decode, cached tokens: timing.py) and is
sent only when it changed (keyed.py); a selected Node shows its line in the cell.

The buttons call the program's StepController (`state.debug`), the same object code uses
headless. A click only grants a step and returns: the kernel must stay free to deliver
the next click, so nothing here waits for the program.
"""

from __future__ import annotations

import html
import linecache
from dataclasses import dataclass, field

import ipywidgets as W
from traitlets import Int, List, Unicode

from sgl_nb.notebook.widgets.keyed import Item, KeyedView
from sgl_nb.notebook.widgets.timing import Timings
from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.runtime.compiler.step_controller import Breakpoint, Hold, StepController
from sgl_nb.runtime.status import Status
from sgl_nb.tracing.timeline import NodeView, Timeline

_CSS = """
.sgl-graph{font-family:monospace;font-size:12px;max-height:320px;overflow:auto;
 border:1px solid #ddd;padding:4px}
.sgl-node{padding:1px 4px;white-space:pre}.sgl-node.sgl-current{background:#fde68a;
 font-weight:bold}.sgl-node[data-selected]{outline:2px solid #2563eb}
.sgl-ins{padding-left:28px;color:#555;white-space:pre}
.sgl-ins.sgl-current{background:#fcd34d;color:#000}.sgl-bp{color:#dc2626}
.sgl-timing{padding-left:28px;color:#6b7280;white-space:pre;font-size:11px}
.sgl-st-done{color:#15803d}.sgl-st-running{color:#2563eb}.sgl-st-pending{color:#888}
.sgl-st-error{color:#b91c1c}.sgl-st-skipped{color:#888}.sgl-st-cancelled{color:#a21caf}
"""

NODE_ONLY = "stepping by Node only: Instructions run on the server"


@dataclass
class Row:
    """One Node of the graph, whether it ran or is still queued (both from the Timeline)."""

    id: int
    kind: NodeKind | None
    name: str | None
    label: str
    line: int | None
    status: Status
    preds: list[int] = field(default_factory=list)
    instructions: list[str] = field(default_factory=list)
    tokens: int = 0
    timing: str = ""  # queue / prefill / decode and cached tokens (timing.py)
    file: str | None = None  # where the program said it (a cell's linecache name)


def graph_rows(tl: Timeline, programs: list[int], timings: Timings | None = None) -> list[Row]:
    """The Nodes of these programs (fork branches included) in the order they started,
    then the ones still queued (or skipped), in the order they were queued."""
    nodes = [tl.nodes[nid] for pid in programs if pid in tl.programs
             for nid in tl.programs[pid].nodes]
    started = sorted((n for n in nodes if n.start_ns is not None),
                     key=lambda n: (n.start_ns, n.id))
    rows = []
    for n in started:
        ins = [f"{i.kind.value} [{i.status.value}]" for i in n.instructions]
        timing = timings.node(n.id).summary() if timings is not None else ""
        rows.append(Row(n.id, n.kind, n.name, _label(n), n.line, n.status,
                        list(n.preds), ins, len(n.tokens), timing, n.file))
    for n in nodes:
        if n.start_ns is None:
            rows.append(Row(n.id, n.kind, n.name, _label(n), n.line, n.status, list(n.preds),
                            [f"{op.value} [pending]" for op in n.ops], file=n.file))
    return rows


def _label(n: NodeView) -> str:
    return n.label or (n.kind.value if n.kind is not None else "?")


def source_line(file: str | None, line: int | None) -> str:
    """A program line as written (a cell's source is in linecache), or ""."""
    return linecache.getline(file, line).strip() if file and line else ""


def parse_breakpoint(spec: str) -> Breakpoint:
    """'answer' (a variable name), 'name=answer', 'kind=Gen', 'line=3', or several of them
    separated by spaces."""
    fields: dict = {}
    for part in spec.split():
        key, sep, value = part.partition("=")
        if not sep:
            key, value = "name", part
        if key not in ("name", "kind", "line"):
            raise ValueError(f"a breakpoint is name=, kind= or line=, got {part!r}")
        if key == "line":
            if not value.isdigit():
                raise ValueError(f"line= takes a number, got {value!r}")
            value = int(value)
        fields[key] = value
    if not fields:
        raise ValueError("an empty breakpoint: give a name, kind= or line=")
    return Breakpoint(**fields)


def describe(bp: Breakpoint) -> str:
    kind = bp.kind.value if bp.kind is not None else None
    return " ".join(f"{k}={v}" for k, v in (("name", bp.name), ("kind", kind),
                                              ("line", bp.line)) if v is not None)


class StepperGraph(KeyedView):
    """The Node list: one row per Node (its Instructions and timing under it); a Node whose
    status, Instruction or timing changed is the only row sent."""

    _css = _CSS

    def __init__(self, **kwargs):
        super().__init__(root_class="sgl-graph", **kwargs)


class StepperView(W.VBox):
    # Not synced: the page shows them in status_html, the graph and source_html already,
    # and each change synced would be one more message (one a step, two as a program ends).
    current_node = Int(None, allow_none=True)
    current_instruction = Unicode("")
    waiting_at = Unicode("")  # "node" | "decode" | "" (not held)
    breakpoints = List(Unicode())
    message = Unicode("")
    selected_source = Unicode("")  # the chosen Node's line: "3: s += ..."

    def __init__(self, **kwargs):
        self.controller: StepController | None = None
        self._node_only = False
        self._rows: dict[int, Row] = {}
        self.on_command = None  # called after each button, so the owner re-renders soon
        self.on_select = None  # called with a Node's id after a click selected it
        # The step buttons' row is shown while a program is bound and running, hidden before
        # and after: one message (this layout's, shared with the ProgramWidget's Stop) where
        # disabling each button would send one a button.
        self.controls = W.Layout(width="auto", display="none")
        auto = {"layout": W.Layout(width="auto")}
        self.step_node = W.Button(description="Step node", icon="step-forward", **auto)
        self.step_instruction = W.Button(description="Step instruction", icon="forward", **auto)
        self.continue_button = W.Button(description="Continue", icon="play", **auto)
        self.pause_button = W.Button(description="Pause", icon="pause", **auto)
        self.node_choice = W.Dropdown(options=[], description="Node",
                                      layout=W.Layout(width="420px"))
        self.toggle_bp = W.Button(description="Toggle breakpoint", icon="circle", **auto)
        self.bp_spec = W.Text(placeholder="answer | kind=Gen | line=3",
                              description="Break on", layout=W.Layout(width="420px"))
        self.add_bp = W.Button(description="Add breakpoint", **auto)
        # Classes given at construction go with the widget's opening, not as an update.
        self.graph = StepperGraph(_dom_classes=["sgl-stepper-graph"])
        self.status_html = W.HTML("")
        self.buttons = [self.step_node, self.step_instruction, self.continue_button,
                        self.pause_button]
        for b, fn in zip(self.buttons, ("step", "step_instruction", "continue_", "pause")):
            b.on_click(lambda _b, fn=fn: self._command(fn))
        self._drawn: tuple = ([], None, set())  # what the graph shows: rows, current, bps
        self.source_html = W.HTML("", _dom_classes=["sgl-node-source"])
        self.node_choice.observe(lambda _c: self._redraw(), names="value")
        self.graph.observe(self._row_clicked, names="clicked")  # a click on a Node's row
        self.toggle_bp.on_click(lambda _b: self._toggle_breakpoint())
        self.add_bp.on_click(lambda _b: self._add_breakpoint())
        super().__init__(children=[
            W.HBox(self.buttons, layout=self.controls), self.status_html, self.graph,
            W.HBox([self.node_choice, self.toggle_bp]), self.source_html,
            W.HBox([self.bp_spec, self.add_bp]),
        ], **kwargs)

    def bind(self, controller: StepController | None, node_only: bool = False) -> None:
        """Show the buttons for this controller (None: a program that cannot be stepped;
        its buttons are disabled). node_only: a remote backend, whose Instructions run on
        the server."""
        self.controller, self._node_only = controller, node_only
        self.controls.display = None
        for b in [*self.buttons, self.toggle_bp, self.add_bp]:
            b.disabled = controller is None
        if node_only:
            self.step_instruction.disabled = True
            self.step_instruction.tooltip = NODE_ONLY
            self.message = NODE_ONLY

    # ---- the controls --------------------------------------------------------------------

    def _command(self, name: str) -> None:
        if self.controller is None:
            return
        getattr(self.controller, name)()
        self.message = {"step": "stepping one Node", "step_instruction": "stepping one "
                        "Instruction", "continue_": "running", "pause": "pausing"}[name]
        if self.on_command is not None:
            self.on_command()

    def _toggle_breakpoint(self) -> None:
        row = self._rows.get(self.node_choice.value) if self.node_choice.value else None
        if self.controller is None or row is None:
            return
        bp = Breakpoint(name=row.name, kind=row.kind, line=row.line)
        if bp in self.controller.breakpoints:
            self.controller.clear_breakpoint(bp)
        else:
            self.controller.breakpoints.add(bp)
        self._after_breakpoints()

    def _add_breakpoint(self) -> None:
        if self.controller is None:
            return
        try:
            bp = parse_breakpoint(self.bp_spec.value)
        except ValueError as e:
            self.message = str(e)
        else:
            self.controller.breakpoints.add(bp)
            self.bp_spec.value = ""
            self.message = f"breakpoint {describe(bp)}"
        self._after_breakpoints()

    def _after_breakpoints(self) -> None:
        if self.controller is not None:
            self.breakpoints = sorted(describe(b) for b in self.controller.breakpoints)
        if self.on_command is not None:
            self.on_command()

    # ---- rendering -------------------------------------------------------------------------

    def update(self, rows: list[Row], finished: bool, held: Hold | None = None,
               held_node: int | None = None) -> None:
        """Set every trait from the rows, where the program is held (its events say) and
        the controller's own settings (paused, breakpoints); call inside hold_sync."""
        c = self.controller
        current = held_node if held else None
        if current is None:
            running = [r for r in rows if r.status is Status.RUNNING]
            current = running[-1].id if running else None
        self._rows = {r.id: r for r in rows}
        self.waiting_at = held.value if held else ""
        self.current_node = current
        self.current_instruction = self._current_instruction(self._rows.get(current), held)
        bps = c.breakpoints if c is not None else set()
        self.breakpoints = sorted(describe(b) for b in bps)
        self._drawn = (rows, current, set(bps))
        options = [(f"#{r.id} {r.label}", r.id) for r in rows]
        if [o[1] for o in self.node_choice.options] != [o[1] for o in options]:
            chosen = self.node_choice.value
            self.node_choice.options = options
            ids = [o[1] for o in options]
            # Keep the user's choice; else offer the current Node (what one breaks on next).
            self.node_choice.value = (chosen if chosen in ids else current if current in ids
                                      else ids[0] if ids else None)
        if finished:
            self.graph.freeze()  # the final list in the widget state (saved notebooks)
        self.graph.show(self._graph_items(rows, current, bps))
        state = ("finished" if finished else f"held at a {held}" if held
                 else "paused" if c is not None and c.paused else "running")
        if finished:
            self.controls.display = "none"  # nothing left to step (or to stop)
        self.status_html.value = (
            f"<b>{state}</b> · current: {html.escape(self._label(current))}"
            f"{' · ' + html.escape(self.current_instruction) if self.current_instruction else ''}"
            f"{' · ' + html.escape(self.message) if self.message else ''}")

    def _label(self, nid: int | None) -> str:
        row = self._rows.get(nid) if nid is not None else None
        return f"#{row.id} {row.label}" if row else "-"

    def _current_instruction(self, row: Row | None, held: Hold | None) -> str:
        if row is None:
            return ""
        if held is Hold.DECODE:
            return f"Decode (token {row.tokens + 1})"
        if held is Hold.NODE:
            first = row.instructions[0].split(" ")[0] if row.instructions else "—"
            return f"{first} (next)"
        running = [i for i in row.instructions if i.endswith("[running]")]
        return running[-1].split(" ")[0] if running else ""

    def _graph_items(self, rows: list[Row], current: int | None, bps: set) -> list[Item]:
        """Per Node a row, with its Instructions and its timing as rows under it: each is
        sent only when it changed (a running Decode's token count, its timing)."""
        selected = self.node_choice.value
        out = []
        for r in rows:
            key = f"n{r.id}"
            out.append(Item(key, self._node_html(r, current, bps, selected)))
            for i, ins in enumerate(r.instructions):
                icur = " sgl-current" if r.id == current and i == self._ins_index(r) else ""
                extra = f" {r.tokens} tokens" if ins.startswith("Decode") and r.tokens else ""
                out.append(Item(f"{key}.{i}", f'<div class="sgl-ins{icur}">'
                                              f'{html.escape(ins)}{extra}</div>', key))
            if r.timing:
                out.append(Item(f"{key}.t", f'<div class="sgl-timing">{html.escape(r.timing)}'
                                            "</div>", key))
        return out

    def _node_html(self, r: Row, current: int | None, bps: set, selected) -> str:
        cur = " sgl-current" if r.id == current else ""
        sel = ' data-selected="1"' if r.id == selected else ""
        mark = '<span class="sgl-bp">●</span>' if any(b.hits(r) for b in bps) else " "
        line = f"line {r.line}" if r.line else ""
        preds = f" ← {', '.join(f'#{p}' for p in r.preds)}" if len(r.preds) > 1 else ""
        return (f'<div class="sgl-node{cur}" data-node="{r.id}"{sel}>{mark} #{r.id:<4} '
                f'{html.escape(f"{r.label:<40}")} {line:<8} '
                f'<span class="sgl-st-{r.status.value}">[{r.status.value}]</span>{preds}</div>')

    def _redraw(self) -> None:
        """The selection moved: re-send the rows it marks (two at most)."""
        rows, current, bps = self._drawn
        self.graph.show(self._graph_items(rows, current, bps))
        row = self._rows.get(self.node_choice.value) if self.node_choice.value else None
        source = source_line(row.file, row.line) if row is not None else ""
        self.selected_source = f"{row.line}: {source}" if row is not None and row.line else ""
        self.source_html.value = (
            f'<div style="font-family:monospace;font-size:12px">#{row.id} {html.escape(row.label)}'
            f' · cell line {row.line}: <code>{html.escape(source)}</code></div>'
            if self.selected_source else "")

    def _row_clicked(self, change) -> None:
        key = change.get("new") or ""
        node = key.split(".")[0]  # a Node's row, or one of its Instructions' rows
        if node.startswith("n") and node[1:].isdigit():
            self.select(int(node[1:]))

    def select(self, node_id: int) -> bool:
        """Select a Node in the list (a token click): True if it is listed."""
        if node_id not in self._rows:
            return False
        self.node_choice.value = node_id
        if self.on_select is not None:  # also when it was selected already
            self.on_select(node_id)
        return True

    @property
    def rows(self) -> list[Row]:
        return list(self._rows.values())

    def _ins_index(self, r: Row) -> int:
        running = [i for i, s in enumerate(r.instructions) if s.endswith("[running]")]
        return running[-1] if running else 0

    def widgets(self) -> list:
        return [self, self.graph, self.status_html, self.node_choice, self.source_html,
                *self.buttons]
