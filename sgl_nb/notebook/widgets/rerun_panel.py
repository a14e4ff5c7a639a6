"""Time travel in the program widget: "why this token" and "re-run from here".

Why this token: a click on a generated token in the stream view sends
{"type": "why", "node", "index"}; `why_reply` answers with that token's alternatives (rank,
text, probability, masked by the grammar, the one taken), whether it was forced, how many
tokens the grammar allowed, and its Node, source line, Instruction and cache hit. It is sent
back to that view alone, on demand: nothing of it travels with the tokens.

Re-run from here: `RerunPanel` edits the Node selected in the stepper (a Gen, a Select or a
Text): its output, prefilled, and for a Gen its sampling arguments. The button starts
`state.rerun(at=node, ..., stream=True)` and shows the new run's ProgramWidget under the
panel, its diff against the original (`sgl.diff`) under it once the re-run ends. The panel
is built on the first selection a user makes, so a program nobody re-runs sends none of it.

Clicks are handled on the kernel's shell thread after the cell has finished: nothing here
waits for a program (a running one is not re-run; its widget's pump reports the end).
"""

from __future__ import annotations

import html
import math

import ipywidgets as W

from sgl_nb.language.rerun import EDITABLE, check_edit, resolve_at
from sgl_nb.language.run_record import record_of_state
from sgl_nb.notebook.cell_program import SAMPLING_HINT, parse_edit
from sgl_nb.notebook.widgets.stepper import source_line
from sgl_nb.runtime.compiler.instructions import Op
from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.runtime.events import CacheHit
from sgl_nb.runtime.token_choice import TokenChoice
from sgl_nb.tracing.timeline import NodeView, Timeline

# What a bad edit raises at call time (sgl_nb/language/rerun.py), shown in the panel.
EDIT_ERRORS = (TypeError, ValueError, KeyError, ImportError)


# ---- why this token -----------------------------------------------------------------------

def why_reply(tl: Timeline, node_id, index) -> dict:
    """The answer to a click on token `index` of Node `node_id`, from its token event (what
    the engine chose among, as state.token_info says it): a dict for the front end (its
    "error" says why there is none)."""
    base = {"type": "why", "node": node_id, "index": index}
    view = tl.nodes.get(node_id) if isinstance(node_id, int) else None
    if view is None or not isinstance(index, int) or not 0 <= index < len(view.tokens):
        return {**base, "error": f"no generated token {index} of Node {node_id} here"}
    choice = view.tokens[index].choice()
    return {**base, **_choice_fields(choice), **_where(tl, view)}


def _choice_fields(c: TokenChoice) -> dict:
    rows = [[rank, a.text, _prob(a.logprob), a.masked, a.token == c.token]
            for rank, a in enumerate(c.top, 1)]
    if c.rank is None and c.logprob is not None:  # taken from outside the top k
        rows.append([None, c.text, _prob(c.logprob), False, True])
    return {"token": c.token, "text": c.text, "p": _prob(c.logprob), "forced": c.forced,
            "allowed": c.allowed, "top": rows}


def _prob(logprob: float | None) -> float | None:
    return None if logprob is None else round(math.exp(logprob), 5)


def _where(tl: Timeline, view: NodeView) -> dict:
    hits = [e for e in tl.cache_events if isinstance(e, CacheHit) and e.node == view.id]
    ins = next((i for i in view.instructions if i.kind is Op.DECODE),
               view.instructions[-1] if view.instructions else None)
    kind = view.kind.value if view.kind is not None else None
    return {"label": view.label or kind or "?", "kind": kind, "name": view.name,
            "line": view.line, "source": source_line(view.file, view.line),
            "instruction": (f"{ins.kind.value} #{ins.index} (request {ins.request})"
                            if ins is not None else None),
            "cached": hits[-1].cached_tokens if hits else None,
            "prompt": hits[-1].prompt_tokens if hits else None}


# ---- re-run from here ---------------------------------------------------------------------


class RerunPanel(W.VBox):
    """The edit of one Node and its re-runs, each a ProgramWidget with its diff under it."""

    def __init__(self, owner, **kwargs):
        self.owner = owner  # the ProgramWidget of the run re-run from
        self.node: NodeView | None = None  # the Node the boxes edit, as its events say
        self.runs_started: list = []  # the re-runs' states, in order
        self.heading = W.HTML("")
        self.value = W.Textarea(description="Value", layout=W.Layout(width="98%"),
                                _dom_classes=["sgl-rerun-value"])
        self.sampling = W.Text(placeholder=SAMPLING_HINT, description="Sampling",
                               layout=W.Layout(width="98%"), _dom_classes=["sgl-rerun-sampling"])
        self.button = W.Button(description="Re-run from here", icon="history",
                               button_style="primary", layout=W.Layout(width="auto"),
                               tooltip="run the program again from this Node, with the edit")
        self.button.on_click(lambda _b: self.rerun())
        self.message = W.HTML("", _dom_classes=["sgl-rerun-message"])
        self.runs = W.VBox([], _dom_classes=["sgl-reruns"])
        super().__init__(children=[self.heading, self.value, self.sampling,
                                   W.HBox([self.button, self.message]), self.runs],
                         _dom_classes=["sgl-rerun"], **kwargs)

    def show_node(self, node_id: int) -> bool:
        """Edit this Node (False if the program has no such Node)."""
        node = self.owner.timeline.nodes.get(node_id)
        if node is None:
            return False
        if self.node is not None and self.node.id == node_id:
            return True  # the same Node again: keep what the user typed
        self.node = node
        editable = node.kind in EDITABLE
        line = f" · line {node.line}" if node.line is not None else ""
        self.heading.value = (f"<b>Re-run from #{node.id} {html.escape(_label(node))}</b>"
                              f"{line}")
        self.value.value = (node.text or "") if editable else ""
        self.sampling.value = ""
        self.value.layout.display = None if editable else "none"
        self.sampling.layout.display = None if node.kind is NodeKind.GEN else "none"
        self.button.layout.display = None if editable else "none"
        self.message.value = ("" if editable else
                              "<i>a re-run starts at a Gen, a Select or a Text Node</i>")
        return True

    def rerun(self):
        """The button: start the re-run and show its widget (returns its state), or show why
        it cannot start (returns None). Returns at once."""
        try:
            value, sampling = self._checked_edit()
        except EDIT_ERRORS as e:
            self._error(e)
            return None
        owner, node = self.owner, self.node
        title = f"re-run of {owner.title_text} from #{node.id} {_label(node)}"
        widget = owner.rerun_view(title)  # subscribed before it starts
        try:
            new = owner.state.rerun(at=node.id, value=value, stream=True, debug=True,
                                    **sampling)
        except EDIT_ERRORS as e:
            widget.discard()
            self._error(e)
            return None
        diff = W.HTML("", _dom_classes=["sgl-rerun-diff"])
        widget.on_final.append(lambda w: self._show_diff(w.state, diff))
        widget.attach(new)
        self.runs_started.append(new)
        self.runs.children = (*self.runs.children, W.VBox([widget, diff]))
        self.message.value = f"started program {new.id}"
        return new

    def _checked_edit(self) -> tuple[object, dict]:
        """The edit, checked as rerun checks it, before any widget of the re-run exists."""
        node, state = self.node, self.owner.state
        if node is None or node.kind not in EDITABLE:
            raise ValueError("select a Gen, a Select or a Text Node in the stepper first")
        if not (state.finished or state.held):
            # rerun waits for the program to end: on the shell thread that would hang the
            # kernel's widget messages, this click included.
            raise ValueError("the program is still running: re-run it once it has ended, "
                             "or pause it")
        value, sampling = parse_edit(node.kind, self.value.value, self.sampling.value)
        _, _, rec = resolve_at(record_of_state(_top(state)), node.id)
        check_edit(rec, value, sampling)
        return value, sampling

    def _error(self, e: BaseException) -> None:
        text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        self.message.value = f'<span style="color:#b91c1c">{html.escape(str(text))}</span>'

    def _show_diff(self, new, out: W.HTML) -> None:
        """On the re-run widget's pump thread, after its final render."""
        from sgl_nb.language.diff import diff

        try:
            out.value = diff(new)._repr_html_()
        except Exception as e:  # noqa: BLE001 - shown, not raised on the pump thread
            out.value = f'<span style="color:#b91c1c">no diff: {html.escape(str(e))}</span>'


def _label(node: NodeView) -> str:
    return node.label or (node.kind.value if node.kind is not None else "?")


def _top(state):
    while state.parent is not None:
        state = state.parent
    return state
