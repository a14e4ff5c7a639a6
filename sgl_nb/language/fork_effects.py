"""What a Fork and a Join do to their program: ForkEffects makes the branches (child
states that start from the parent's text, variables and open turn, as SGLang forks) and
gathers them back (their Nodes spliced into the parent's graph, their variables gathered
or their text appended).

It is one part of the program's ProgramEffects (effects.py), on the executor's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_nb.language.errors import ProgramCancelled
from sgl_nb.language.program_run import ProgramRun
from sgl_nb.runtime.compiler.instructions import Fork, Join
from sgl_nb.runtime.compiler.ir import Node
from sgl_nb.runtime.events import Forked, Joined, ProgramStarted

if TYPE_CHECKING:
    from sgl_nb.language.effects import ProgramEffects


class ForkEffects:
    def __init__(self, host: ProgramEffects):
        self.host, self.run = host, host.run

    def fork_branches(self, node: Node, ins: Fork) -> None:
        host, run = self.host, self.run
        children = [host.state.branch(run.strategy.branch(node, i)) for i in range(ins.n)]
        run.children.extend(children)
        run.forked[node.id] = children
        host.emit(Forked, node=node.id, n=ins.n, children=tuple(c.id for c in children))
        for i, c in enumerate(children):
            c.emit(ProgramStarted, node=node.id, function=f"branch {i}",
                   priority=host.priority, parent=host.id, model=host.model_name())

    def join_branches(self, node: Node, ins: Join) -> None:
        host, run = self.host, self.run
        states = [c for c in run.children if c.id in ins.branches]
        runs = [s.run for s in states]
        with run.lock:  # the branches' Nodes belong to the parent's graph, before the Join
            at = run.nodes.index(node)
            run.nodes[at:at] = [n for r in runs for n in r.nodes]
        for s in states:
            s.recorder.effects.emit_finished()
        branches = tuple(s.id for s in states)
        failed = next((r for r in runs if r.error is not None), None)
        if run.cancelled:  # the branches' variables are kept; the program goes no further
            self._gather(runs)
            host.emit(Joined, node=node.id, mode=ins.mode, children=branches)
            raise ProgramCancelled(f"program {host.id} was cancelled")
        if failed is not None:
            run.set_error(failed.error)
            run.error_line = failed.error_line
            host.emit(Joined, node=node.id, mode=ins.mode, children=branches)
            raise failed.error
        if ins.mode == "concate_and_append":
            run.append("".join(r.text[r.fork_point:] for r in runs))
        else:
            self._gather(runs)
        host.emit(Joined, node=node.id, mode=ins.mode, children=branches)

    def _gather(self, runs: list[ProgramRun]) -> None:
        """SGLang's gather_variable: a name the parent does not have becomes a list of the
        values of the branches that have it, in branch order. A name the parent has
        (inherited at the fork, or bound since) is not gathered, even if a branch re-bound
        it."""
        gathered: dict[str, list] = {}
        for r in runs:
            for k, v in r.vars.items():
                if k not in self.run.vars:
                    gathered.setdefault(k, []).append(v)
        for k, values in gathered.items():
            self.run.bind(k, values)
