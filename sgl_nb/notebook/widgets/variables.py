"""The Variables panel: every variable the program has bound, its value, and the meta of
the gen or select that bound it (finish reason, prompt / output / cached tokens, the
select's scores), as the JupyterLab debugger's Variables pane shows a frame's locals.

Read from the Timeline (ProgramView.variables): a Node that bound a variable says its value
and meta as it finishes (NodeFinished.value, .meta), the program's code says what it set
(VariableSet), a Join's gathering follows from its branches'; so a replay shows the same
panel. One row per variable; only a row whose value or meta changed is sent.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from sgl_nb.notebook.widgets.keyed import Item, KeyedView
from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.tracing.timeline import Timeline

_CSS = """
.sgl-vars{font-family:monospace;font-size:12px;max-height:240px;overflow:auto;
 border:1px solid #ddd;padding:4px;min-width:280px}
.sgl-var-row{white-space:pre-wrap;padding:1px 2px}.sgl-var-name{color:#1d4ed8;font-weight:bold}
.sgl-var-meta{color:#6b7280;font-size:11px;padding-left:16px;white-space:pre-wrap}
.sgl-var-kind{color:#7c3aed;font-size:10px}
"""
VALUE_CHARS = 200


@dataclass(frozen=True)
class Variable:
    """One variable: its name, the kind of Node that bound it (Gen, Select, or None when
    set by code), its value's repr, and its meta in short (key -> value)."""

    name: str
    kind: NodeKind | None
    value: str
    meta: tuple[tuple[str, str], ...] = ()

    def meta_dict(self) -> dict[str, str]:
        return dict(self.meta)


def _short(s: str) -> str:
    return s if len(s) <= VALUE_CHARS else s[: VALUE_CHARS - 1] + "…"


def meta_summary(meta: dict) -> list[tuple[str, str]]:
    """The parts of a gen's or select's meta a debugger shows."""
    out = []
    for key in ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "matched_stop", "resolved"):
        if meta.get(key) is not None:
            out.append((key, str(meta[key])))
    if "choices" in meta and "scores" in meta:
        scores = meta.get("normalized_prompt_logprobs") or meta["scores"]
        out.append(("scores", ", ".join(f"{c!r}: {s:.3f}" for c, s in
                                        zip(meta["choices"], scores))))
    elif "choices" in meta:
        out.append(("choices", ", ".join(repr(c) for c in meta["choices"])))
    return out


def variables_of(tl: Timeline, program: int) -> list[Variable]:
    """Every variable the program has bound so far, in the order they were first bound:
    its value and, for one a Gen or Select bound, that Node's kind and meta (a variable a
    Join gathered takes the kind of the branches' Nodes of its name)."""
    p = tl.programs.get(program)
    if p is None:
        return []
    kinds = {n.name: n.kind for pid in tl.family(program) for n in _nodes(tl, pid)
             if n.name and n.kind in (NodeKind.GEN, NodeKind.SELECT)}
    out = []
    for name, bound in list(p.variables.items()):
        node = tl.nodes.get(bound.node) if bound.node is not None else None
        meta = meta_summary(node.meta) if node is not None else []
        out.append(Variable(name, kinds.get(name), _short(bound.value), tuple(meta)))
    return out


def _nodes(tl: Timeline, program: int) -> list:
    return [tl.nodes[nid] for nid in tl.programs[program].nodes]


class VariablesPanel(KeyedView):
    """`variables`: what the panel shows now (not synced: the rows are)."""

    _css = _CSS

    def __init__(self, **kwargs):
        super().__init__(root_class="sgl-vars", items=[_empty()], **kwargs)
        self.variables: list[Variable] = []

    def update(self, variables: list[Variable]) -> None:
        self.variables = variables
        self.show([_row(v) for v in self.variables] or [_empty()])

    def get(self, name: str) -> Variable:
        for v in self.variables:
            if v.name == name:
                return v
        raise KeyError(f"no variable {name!r} in the panel; it has "
                       f"{[v.name for v in self.variables]}")


def _empty() -> Item:
    return Item("none", '<i class="sgl-var-meta">no variables yet</i>')


def _row(v: Variable) -> Item:
    kind = f' <span class="sgl-var-kind">{v.kind.value}</span>' if v.kind else ""
    meta = " · ".join(f"{k}={val}" for k, val in v.meta)
    meta_html = f'<div class="sgl-var-meta">{html.escape(meta)}</div>' if meta else ""
    return Item(f"v:{v.name}",
                f'<div class="sgl-var-row" data-var="{html.escape(v.name)}">'
                f'<span class="sgl-var-name">{html.escape(v.name)}</span>{kind} = '
                f'{html.escape(v.value)}</div>{meta_html}')
