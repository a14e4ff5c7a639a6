"""What each Instruction does to its program: ProgramEffects is the program's host for the
executor (runtime/compiler/executor.py), which calls it on its own thread, in order, so a
program's text and variables (its ProgramRun) change in one thread. Whether a Node is
computed or taken from a record is the run's strategy's to say (rerun_strategy.py).

ProgramEffects answers the executor (ProgramHost): whether a Node runs, its events, its
end, and Return's end of the program. Extend it runs itself: it appends text (a role
marker's comes from the chat template, a decided select's is its choice), and a shared
Extend prefills a prefix. The rest it hands to its parts, one per kind of Instruction:
Decode to GenEffects (gen_effects.py), Score to SelectEffects (select_effects.py), Fork and
Join to ForkEffects (fork_effects.py). Engine work carries its Instruction and comes back
through callbacks that post to the executor.
"""

from __future__ import annotations

import json
import time

from sgl_nb.language import speculation
from sgl_nb.language.errors import ProgramCancelled
from sgl_nb.language.fork_effects import ForkEffects
from sgl_nb.language.gen_effects import GenEffects
from sgl_nb.language.program_run import ProgramRun
from sgl_nb.language.select_effects import SelectEffects
from sgl_nb.runtime.compiler.executor import Done, Executor
from sgl_nb.runtime.compiler.instructions import Cancelled, Instruction, Op
from sgl_nb.runtime.compiler.ir import (
    InitNode,
    JoinNode,
    Node,
    NodeKind,
    ReturnNode,
    RoleNode,
    SelectNode,
    TextNode,
    VarScopeNode,
)
from sgl_nb.runtime.compiler.step_controller import StepController
from sgl_nb.runtime.events import (
    Event,
    Failed,
    NodeFinished,
    NodeStarted,
    ProgramFinished,
    ProgramStarted,
    meta_json,
    stack_args,
)
from sgl_nb.runtime.status import Status

# A fork's shared Extend runs only when at least this much of the branches' common text is
# not computed yet (less is not worth a request of its own).
SHARE_MIN_CHARS = 32


class ProgramEffects:
    """The executor's side of a program (its ProgramHost). The façade (state.py) records
    Nodes; this runs their Instructions against the ProgramRun both share."""

    def __init__(self, state, run: ProgramRun, executor: Executor):
        self.state, self.run, self.executor = state, run, executor
        self.id, self.backend = run.id, state.backend
        self.defaults, self.priority = state.defaults, state.priority
        self.gens = GenEffects(self)  # Decode
        self.selects = SelectEffects(self)  # Score, and a Select's choice
        self.forks = ForkEffects(self)  # Fork, Join

    @property
    def stepper(self) -> StepController | None:
        """The step controller the executor asks before each step (None: not stepped)."""
        return self.run.stepper

    @property
    def call_stack(self) -> list[dict]:
        return self.state.call_stack

    # ---- the executor's host interface ------------------------------------------------

    def emit(self, cls: type[Event], **fields) -> None:
        self.state.emit(cls, **fields)

    def listening(self) -> bool:
        events = self.state.events
        return events is not None and events.active

    def program_queued(self, init: InitNode) -> None:
        """program_started, said as the Init Node is queued: before the Nodes its body
        queues (node_queued, on the body's thread), which may come long before Init runs
        (a program waiting for a shared prefix)."""
        self.emit(ProgramStarted, function=init.function, priority=self.priority,
                  model=self.model_name(), **init.call)

    def node_started(self, node: Node) -> bool:
        if isinstance(node, InitNode):  # its Instruction runs even for a program cancelled at once
            node.status = Status.RUNNING
            return True
        if isinstance(node, ReturnNode):
            return True  # a cancelled or failed program still ends
        if isinstance(node, JoinNode):  # it gathers what the branches produced, cancelled or not
            node.status = Status.RUNNING
            branches = [c.run.strategy for c in self.run.children if c.id in node.branches]
            self.run.strategy.node_started(node, branches)
            self._node_started_event(node)
            self.run.node_start[node.id] = len(self.run.text)
            return True
        if self.run.cancelled:
            node.status = Status.CANCELLED
            self._node_started_event(node)
            return False
        if self.run.error is not None:
            node.status = Status.SKIPPED  # the program failed before it
            return False
        node.status = Status.RUNNING
        self.run.strategy.node_started(node, [])  # first: an edit's sampling is the Node's now
        self._node_started_event(node)
        self.run.node_start[node.id] = len(self.run.text)
        if isinstance(node, VarScopeNode):  # no Instruction: it marks where its text starts, ends
            self._scope(self.run.payloads[node.id])
        return True

    def start(self, ins: Instruction, done: Done) -> int | None:
        node = self.run.nodes_by_id.get(ins.node) if ins.node is not None else None
        if ins.op is Op.DECODE:
            return self.gens.decode(node, ins, done)
        if ins.op is Op.EXTEND and ins.shared:
            return self._prefill(ins, done)
        if ins.op is Op.EXTEND:
            self._extend(node, ins)
        elif ins.op is Op.FORK:
            self.forks.fork_branches(node, ins)
        elif ins.op is Op.JOIN:
            self.forks.join_branches(node, ins)
        done(None)
        return None

    def start_scores(self, group: list, dones: list[Done]) -> list[int | None]:
        return self.selects.start_scores(group, dones)

    def node_finished(self, node: Node, error: BaseException | None) -> None:
        if isinstance(node, InitNode):
            node.status = Status.DONE if error is None else Status.ERROR
        elif isinstance(node, ReturnNode):
            self._end_program(node)
        elif node.status is Status.RUNNING:
            if error is None and isinstance(node, SelectNode) and node.decided is None:
                error = self.selects.choose(node)
            self._node_end(node, error)
        elif node.status is Status.CANCELLED:
            node.output, node.end_ns = "", time.monotonic_ns()
            self.emit(NodeFinished, node=node.id, status=Status.CANCELLED, text="")
        with self.run.cond:
            self.run.pending -= 1
            self.run.cond.notify_all()

    # ---- nodes ------------------------------------------------------------------------

    def _node_started_event(self, node: Node) -> None:
        node.start_ns = time.monotonic_ns()
        params = None
        if node.kind in (NodeKind.GEN, NodeKind.SELECT):  # what a re-run or a diff compares it by
            params = json.dumps(node.params(), default=repr, sort_keys=True)
        self.emit(NodeStarted, node=node.id, node_kind=node.kind, name=node.name,
                  line=node.line, file=node.file, label=node.label(), preds=tuple(node.preds),
                  stack=tuple(node.stack), params=params,
                  stack_args=stack_args(node.stack, list(self.call_stack)))

    def _node_end(self, node: Node, error: BaseException | None) -> None:
        if isinstance(error, Cancelled):
            node.status = Status.CANCELLED  # aborted mid-way: what it produced is kept
        elif error is not None:
            node.status = Status.ERROR
            if self.run.error is None:
                self.run.set_error(error, node.file)
                self.run.error_line = node.line
            self.emit(Failed, node=node.id, error=repr(error), line=node.line)
        else:
            node.status = Status.DONE
        node.output = self.run.text[self.run.node_start.pop(node.id, 0):]
        node.end_ns = time.monotonic_ns()
        value = meta = None
        if node.name is not None and node.name in self.run.vars:
            value = repr(self.run.vars[node.name])
            meta = meta_json(self.run.meta.get(node.name))
        self.emit(NodeFinished, node=node.id, status=node.status, text=node.output, value=value,
                  meta=meta)

    def _end_program(self, node: Node) -> None:
        body_error, file = self.run.payloads.get(node.id) or (None, None)
        with self.run.cond:
            if body_error is not None and self.run.error is None:
                self.run.set_error(body_error, file)
        node.status = self.run.end_status()
        self.emit_finished()
        self.run.end()

    def emit_finished(self) -> None:
        run = self.run
        self.emit(ProgramFinished, status=run.end_status(), line=run.error_line,
                  error=repr(run.error) if run.error else None)

    # ---- Extend -----------------------------------------------------------------------

    def _extend(self, node: Node, ins) -> None:
        start = len(self.run.text)
        if isinstance(node, TextNode | SelectNode):  # a re-run's edit of it
            ins.text = self.run.strategy.text(node, ins.text)
        self._extend_text(node, ins)
        if self.run.speculated:
            self.run.speculated = speculation.fill(self.run.speculated, self.run.text[start:])

    def _extend_text(self, node: Node, ins) -> None:
        if isinstance(node, RoleNode):
            self._role_marker(node, self.run.payloads[node.id])
            ins.text = node.text
        elif isinstance(node, SelectNode):  # decided by a pass: no Score ran
            self.run.append(ins.text, ins.name)
            if ins.name is not None:
                self.run.meta[ins.name] = {"choices": node.choices,
                                           "resolved": node.resolved or "static"}
                self.run.bind(ins.name, ins.text)
        else:
            self.run.append(ins.text)

    def _role_marker(self, node: RoleNode, mark) -> None:
        roles = self.backend.chat_roles
        start = len(self.run.text)
        if mark.begin:
            if not self.run.messages and mark.role != "system" and self.run.text == "":
                self.run.append(roles.default_system)
            self.run.append(roles.prefix[mark.role])
            self.run.role_start = len(self.run.text)
        else:
            content = self.run.text[self.run.role_start:]
            self.run.messages.append({"role": mark.role, "content": content})
            self.run.append(roles.suffix[mark.role])
        node.text = self.run.text[start:]  # the default system prompt included

    def _scope(self, mark) -> None:
        if mark.begin:
            self.run.scopes[mark.name] = len(self.run.text)
        else:
            self.run.bind(mark.name, self.run.text[self.run.scopes.pop(mark.name):])

    def _prefill(self, ins, done: Done) -> int | None:
        """A shared Extend: one prefill of the prefix others will start from. Computing it
        is an optimisation, so a failure is reported on the Instruction, not raised: the
        requests after it fail with their own error if the prefix is the problem."""
        if not ins.text:  # a fork's: the text so far, unless its requests computed it
            if len(self.run.text) - self.run.kv_len < SHARE_MIN_CHARS:
                done(None, {"cached": True})
                return None
            ins.text = self.run.text

        def on_done(handle) -> None:
            self.executor.post(lambda: self._prefilled(handle, ins, done))

        handle = self.backend.prefill(ins.text, priority=self.priority, program=self.id,
                                      node=ins.node, instruction=ins, on_done=on_done)
        self.hold(handle)
        return handle.rid

    def _prefilled(self, handle, ins, done: Done) -> None:
        self.run.inflight.discard(handle)
        try:
            out = handle.result(0)
        except BaseException as e:  # noqa: BLE001 - see _prefill
            done(None, {**handle.usage(), "prefill_error": repr(e)})
            return
        aborted = out.meta.get("finish_reason") == "abort"
        if not aborted and self.run.text.startswith(ins.text):
            self.run.kv_len = max(self.run.kv_len, len(ins.text))
        done(ProgramCancelled("the shared prefix was aborted") if aborted else None,
             handle.usage())

    # ---- helpers ----------------------------------------------------------------------

    def model_name(self) -> str | None:
        """For the events and spans only: never lets a backend's attribute error out."""
        try:
            return self.backend.model_name
        except Exception:  # noqa: BLE001 - a name for a trace is not worth failing a program
            return None

    def outcome(self, handle, done: Done):
        """A finished request's output; None, with `done` told the error, if it failed (the
        Instruction fails, not the executor)."""
        self.run.inflight.discard(handle)
        try:
            return handle.result(0)
        except BaseException as e:  # noqa: BLE001
            done(e, handle.usage())
            return None

    def hold(self, handle) -> None:
        """Keep a request in flight where cancel() finds it; a cancel that came first
        aborts it at once."""
        with self.run.cond:
            self.run.inflight.add(handle)
            cancelled = self.run.cancelled
        if cancelled:
            handle.cancel()
