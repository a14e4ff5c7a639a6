"""Where the Nodes a program records go, and what a read of its results means.

A ProgramState (the façade, state.py) records what `s += ...` says through a recorder. The
LiveRecorder here runs it: the Nodes recorded since the last point that depends on them go
through the passes (runtime/compiler/passes.py), are lowered (runtime/compiler/lowering.py)
and handed to the executor with the program's ProgramEffects; a read waits for the run.
The StaticRecorder (static_graph.py) only keeps the Nodes, for a program's static graph.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sgl_nb.language.effects import ProgramEffects
from sgl_nb.language.errors import ProgramCancelled, ProgramError
from sgl_nb.language.program_run import ProgramRun
from sgl_nb.runtime.compiler.executor import get_executor
from sgl_nb.runtime.compiler.ir import ForkNode, InitNode, JoinNode, Node, TextNode
from sgl_nb.runtime.compiler.lowering import lower
from sgl_nb.runtime.compiler.passes import run_passes
from sgl_nb.runtime.status import Status


class LiveRecorder:
    def __init__(self, state, run: ProgramRun):
        self.state, self.run = state, run
        self.executor = get_executor()
        self.effects = ProgramEffects(state, run, self.executor)
        self.buffer: list[Node] = []  # recorded, not yet through the passes
        self.body_thread: threading.Thread | None = None  # the thread running the program
        self.has_body = False  # a body runs (or will): a fork branch has none
        if run.stepper is not None:
            run.stepper.add_waker(self.executor.wake)

    # ---- recording -------------------------------------------------------------------

    def check_open(self) -> None:
        """The program's Python stops at its next `s += ...` once it is cancelled."""
        if self.run.cancelled:
            raise ProgramCancelled(f"program {self.run.id} was cancelled")

    def record(self, node: Node, payload=None) -> None:
        with self.run.lock:
            if isinstance(node, InitNode):
                self.effects.program_queued(node)
            self.buffer.append(node)
            self.run.payloads[node.id] = payload
            if not isinstance(node, TextNode):  # text may still fuse with what follows
                self.flush()

    def preds(self) -> list[int]:
        nodes = self.run.nodes
        last = self.buffer[-1] if self.buffer else nodes[-1] if nodes else None
        return [last.id] if last is not None and not isinstance(last, InitNode) else []

    def flush(self) -> None:
        """The Nodes recorded since the last flush: passes, lowering, the executor."""
        with self.run.lock:
            if not self.buffer:
                return
            nodes, reports = run_passes(self.buffer, self.state.passes)
            self.buffer = []
            counts = self.state.pass_counts
            for r in reports:
                if r.changed:
                    counts[r.name] = counts.get(r.name, 0) + r.changed
            for n in nodes:
                n.instructions = lower(n)
                self.run.nodes_by_id[n.id] = n
            self.run.nodes.extend(nodes)
            with self.run.cond:
                self.run.pending += len(nodes)
            self.executor.add(self.effects, nodes)

    def fork(self, n: int, caller) -> tuple[ForkNode, list]:
        """A Fork of n branches; returns once it ran: the branches start from the text the
        parent has then."""
        node = ForkNode(program=self.run.id, preds=self.preds(), n=n,
                        file=caller.f_code.co_filename, line=caller.f_lineno)
        self.record(node)
        self.wait_node(node)
        return node, self.run.forked[node.id]

    def join(self, branches: list, fork: ForkNode, mode: str, caller) -> None:
        for b in branches:
            b.recorder.flush()  # every branch Node is queued before the Join that waits for them
        preds = [b.nodes[-1].id for b in branches if b.nodes] or [fork.id]
        node = JoinNode(program=self.run.id, preds=preds, mode=mode,
                        branches=tuple(b.id for b in branches),
                        file=caller.f_code.co_filename, line=caller.f_lineno)
        self.record(node)
        try:
            self.wait_node(node)
        except ProgramError as e:
            if isinstance(e, ProgramCancelled):
                raise
            raise self.run.error from None  # a branch's own error, at its line

    # ---- waiting -----------------------------------------------------------------------

    def wait_node(self, node: Node) -> None:
        """Until the executor has run `node`; raises if it did not run to its end."""
        run = self.run
        with run.cond:
            self.state.interruptible(lambda: run.cond.wait_for(lambda: node.status.ended))
        if node.status is Status.CANCELLED or run.cancelled:
            raise ProgramCancelled(f"program {run.id} was cancelled")
        if node.status is not Status.DONE:
            raise ProgramError(f"{node.kind.value} did not run: {run.error}")

    def before_read(self, what: str) -> None:
        """A read of the program's results (`what`) sees everything queued before it."""
        self.state.sync()

    def sync(self) -> None:
        self.flush()
        if self.outside():
            self.wait_outside(lambda: False)
            return
        with self.run.cond:
            self.run.cond.wait_for(lambda: self.run.pending == 0)

    def outside(self) -> bool:
        """Called from a thread that is not the program's own body? (Its body may not have
        queued the Nodes yet, so "nothing pending" does not mean "done".)"""
        return self.has_body and threading.current_thread() is not self.body_thread

    def wait_outside(self, ready: Callable[[], bool]) -> None:
        """Until ready(), the program ends, or a step controller holds it (what exists then
        is all there is until someone steps: waiting longer would hang a notebook cell)."""
        with self.run.cond:
            while not (ready() or self.run.finished or self.state.held):
                self.run.cond.wait(0.05)

    def read(self, name: str):
        """s[name]: waits until the variable is bound, or nothing more can bind it."""
        run = self.run
        self.flush()
        if self.outside():
            self.wait_outside(lambda: name in run.vars)
            if name in run.vars:
                return run.vars[name]
            if not run.finished:
                raise ProgramError(f"variable {name!r} is not produced yet: the program is "
                                   "held by its step controller; step or continue it first")
        with run.cond:
            run.cond.wait_for(lambda: name in run.vars or run.pending == 0)
            if name in run.vars:
                return run.vars[name]
        if run.cancelled:
            raise ProgramCancelled(f"variable {name!r} was not produced: program {run.id} "
                                   "was cancelled")
        if run.error is not None:
            raise ProgramError(f"variable {name!r} was not produced: {run.error}")
        raise KeyError(f"unknown variable {name!r}; this program has {sorted(run.vars)}")
