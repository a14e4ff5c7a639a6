"""The program's state: where it stands, its variables and messages, the meta figures
(tokens, cached tokens, timings) and its error with the line it came from."""

from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.runtime.status import Status
from sgl_nb.tracing.timeline import NodeView, Timeline
from sgl_nb.tui.rows import NodeRow, Position


class StatePane(VerticalScroll):
    def __init__(self, show_timings: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.show_timings = show_timings
        self.plain = ""

    def compose(self):
        yield Static(id="state-text")

    def on_mount(self) -> None:
        self.border_title = "State"

    def show(self, tl: Timeline, root: int | None, rows: list[NodeRow], position: Position,
             where: str, error_line: int | None) -> None:
        t = Text()
        p = tl.programs.get(root) if root is not None else None
        t.append(f"{p.function if p and p.function else 'program'}", style="bold")
        t.append(f"  {p.status if p else 'starting'}", style=_status_style(p and p.status))
        t.append(f" ({p.reason})\n" if p is not None and p.reason else "\n")
        t.append(f"  {where}\n")
        _section(t, "Variables", _variables(tl, root))
        _section(t, "Messages", _messages(tl, root))
        _section(t, "Meta", self._meta(tl, p, rows, position))
        errors = _errors(tl, error_line)
        if errors:
            t.append("Error\n", style="bold red")
            for line in errors:
                t.append(f"  {line}\n", style="red")
        self.plain = t.plain
        self.query_one("#state-text", Static).update(t)

    def _meta(self, tl: Timeline, p, rows: list[NodeRow], position: Position) -> list[str]:
        c = tl.cache
        tokens = sum(len(n.tokens) for n in tl.nodes.values())
        out = [f"tokens   {tokens} generated",
               f"cached   {c['cached_tokens']}/{c['prompt_tokens']} prompt tokens "
               f"({c['hits']} hits)",
               f"radix    +{c['inserted']} inserted, -{c['evicted']} evicted"]
        if self.show_timings and p is not None and p.start_ns is not None:
            end = p.end_ns or (tl.events[-1].ts if tl.events else p.start_ns)
            out.append(f"time     program {(end - p.start_ns) / 1e9:.3f} s")
            node = tl.nodes.get(position.node) if position.node is not None else None
            if node is not None and node.start_ns is not None:
                number = next((r.number for r in rows if r.id == node.id), "?")
                node_end = node.end_ns or end
                out.append(f"         #{number} {(node_end - node.start_ns) / 1e9:.3f} s")
        return out


def _status_style(status: str | None) -> str:
    return {"done": "green", "error": "bold red", "suspended": "yellow",
            "cancelled": "magenta"}.get(status or "", "")


def _section(t: Text, title: str, lines: list[str]) -> None:
    t.append(f"{title}\n", style="bold underline")
    for line in lines or ["(none yet)"]:
        t.append(f"  {line}\n", style="" if lines else "dim")


def _node_text(n: NodeView) -> str | None:
    if n.text is not None:
        return n.text
    return "".join(t.text for t in n.tokens) if n.tokens else None


def _programs(tl: Timeline, root: int | None) -> list[int]:
    """The root program and its fork branches, depth first."""
    out, todo = [], [root] if root is not None else []
    while todo:
        pid = todo.pop(0)
        if pid in tl.programs and pid not in out:
            out.append(pid)
            todo[:0] = tl.programs[pid].children
    return out


def _variables(tl: Timeline, root: int | None) -> list[str]:
    out = []
    for pid in _programs(tl, root):
        where = "" if pid == root else f" (branch {_branch(tl, pid)})"
        for nid in tl.programs[pid].nodes:
            n = tl.nodes[nid]
            if not n.name or n.kind not in (NodeKind.GEN, NodeKind.SELECT) or n.start_ns is None:
                continue  # not a variable, or not started (queued)
            value = _node_text(n)
            shown = "?" if value is None else repr(value)  # a choice the events did not carry
            done = "" if n.status is Status.DONE else " …"
            out.append(f"{n.name} = {shown}{done}{where}")
    return out


def _branch(tl: Timeline, pid: int) -> str:
    """A fork branch's place among its Fork's branches ("0 of 2", counted from 0 as the
    Tokens pane's lanes and the Nodes pane's b<i> are): program ids are process-wide."""
    siblings = next((c for c in tl.fork_children().values() if pid in c), None)
    if siblings is None:  # no fork event names it: its parent's children
        p = tl.programs[pid]
        siblings = tl.programs[p.parent].children if p.parent in tl.programs else []
    return f"{siblings.index(pid)} of {len(siblings)}" if pid in siblings else "?"


def _messages(tl: Timeline, root: int | None) -> list[str]:
    """Role blocks, from the RoleBegin/RoleEnd Nodes and the text between them."""
    out, role, parts = [], None, []
    p = tl.programs.get(root) if root is not None else None
    for nid in p.nodes if p else []:
        n = tl.nodes[nid]
        if n.start_ns is None:
            continue  # queued: it has added nothing yet
        if n.kind is NodeKind.ROLE_BEGIN:
            role, parts = (n.label or "RoleBegin ?").split()[-1], []
        elif n.kind is NodeKind.ROLE_END and role is not None:
            out.append(f"{role}: {''.join(parts)!r}")
            role = None
        elif role is not None:
            text = _node_text(n)
            parts.append(text if text is not None else f"<{n.label or n.kind or '?'}>")
    if role is not None:
        out.append(f"{role}: {''.join(parts)!r} …")
    return out


def _errors(tl: Timeline, line: int | None) -> list[str]:
    where = f" at line {line}" if line is not None else ""
    errors = [f"{p.error}{where}" for p in tl.programs.values() if p.error]
    errors += [f"node {n.label or n.kind}: {n.error}" for n in tl.nodes.values()
               if n.error and all(n.error not in e for e in errors)]
    return errors
