"""What each Instruction does to its program: ProgramEffects is the program's host for the
executor (runtime/compiler/executor.py), which calls it on its own thread, in order, so a
program's text and variables (its ProgramRun) change in one thread. Whether a Node is
computed or taken from a record is the run's strategy's to say (rerun_strategy.py).

Extend appends text (a role marker's comes from the chat template, a decided select's is its
choice); Decode and Score submit engine work that carries the Instruction and come back
through callbacks; Fork makes the branches; Join gathers them; Return ends the program.
"""

from __future__ import annotations

import json
import time

from sgl_nb.language import speculation
from sgl_nb.language.errors import ProgramCancelled
from sgl_nb.language.logprob_meta import ChunkMeta, logprob_meta
from sgl_nb.language.program_run import ProgramRun
from sgl_nb.language.reasoning import split_reasoning
from sgl_nb.language.rerun_strategy import Output
from sgl_nb.language.select_scoring import choose
from sgl_nb.runtime.compiler.executor import Done, Executor
from sgl_nb.runtime.compiler.instructions import Cancelled, Fork, Instruction, Join, Op
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
from sgl_nb.runtime.events import (
    Event,
    Failed,
    Forked,
    Joined,
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

    @property
    def debug(self):
        """The step controller the executor asks before each step (None: not stepped);
        ProgramHost's name for it."""
        return self.run.stepper

    @property
    def call_stack(self) -> list[dict]:
        return self.state.call_stack

    # ---- the executor's host interface ------------------------------------------------

    def emit(self, cls: type[Event], **fields) -> None:
        self.state.emit(cls, **fields)

    def node_started(self, node: Node) -> bool:
        if isinstance(node, InitNode):  # its Instruction runs even for a program cancelled at once
            node.status = Status.RUNNING
            self.emit(ProgramStarted, function=node.function, priority=self.priority,
                      model=self._model_name(), **node.call)
            return True
        if isinstance(node, ReturnNode):
            return True  # a cancelled or failed program still ends
        if isinstance(node, JoinNode):  # it gathers what the branches produced, cancelled or not
            node.status = Status.RUNNING
            branches = [c._run.strategy for c in self.run.children if c.id in node.branches]
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
            return self._decode(node, ins, done)
        if ins.op is Op.EXTEND and ins.shared:
            return self._prefill(ins, done)
        if ins.op is Op.EXTEND:
            self._extend(node, ins)
        elif ins.op is Op.FORK:
            self._fork_branches(node, ins)
        elif ins.op is Op.JOIN:
            self._join_branches(node, ins)
        done(None)
        return None

    def node_finished(self, node: Node, error: BaseException | None) -> None:
        if isinstance(node, InitNode):
            node.status = Status.DONE if error is None else Status.ERROR
        elif isinstance(node, ReturnNode):
            self._end_program(node)
        elif node.status is Status.RUNNING:
            if error is None and isinstance(node, SelectNode) and node.decided is None:
                error = self._choose(node)
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
        self._hold(handle)
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

    # ---- Decode -----------------------------------------------------------------------

    def _decode(self, node: Node, ins, done: Done) -> int | None:
        g, prompt = self.run.payloads[node.id], self.run.text
        out = self.run.strategy.output(node)
        if out is not None:  # a re-run: its recorded or edited value, no decoding
            self._gen_output(node, g, out, done)
            return None
        ins.params = self.run.strategy.params(node, ins.params)
        if self.state.spec_tokens and speculation.speculable(ins.params):
            return self._speculate(node, ins, g, done)
        self.run.speculated = ""
        gate = None
        stepper = self.run.stepper
        if stepper is not None:
            gate = stepper.may_decode
            stepper.add_waker(self.backend.wake)
        post = self.executor.post
        counted = ChunkMeta(g.logprob_options(self.defaults).get("return_text_in_logprobs"),
                            self.backend)

        def on_chunk(delta: str) -> None:
            post(lambda: self.run.append(delta, g.name, counted.next()))

        def on_done(handle) -> None:
            post(lambda: self._decoded(handle, g, prompt, done))

        handle = self.backend.submit(prompt, stream=True, gate=gate, priority=self.priority,
                                     program=self.id, node=node.id, instruction=ins,
                                     on_chunk=on_chunk, on_done=on_done, **ins.params)
        counted.handle = handle
        self._hold(handle)
        return handle.rid

    def _speculate(self, node: Node, ins, g, done: Done) -> int | None:
        """A gen read off the speculated answer; if there is none, one request for it and
        the rest (no stop string, spec_tokens long)."""
        stop = list(ins.params["stop"]) if not isinstance(ins.params["stop"], str) \
            else [ins.params["stop"]]
        if self.run.speculated:
            value, self.run.speculated = speculation.take(self.run.speculated, stop)
            self.run.append(value, g.name)
            done(self._bind_gen(g, value, {"speculated": True}),
                 {"speculated": True, "output_tokens": 0})
            return None
        params = {**ins.params, "stop": [],
                  "max_tokens": max(ins.params.get("max_tokens", 0), self.state.spec_tokens)}

        def on_done(handle) -> None:
            self.executor.post(lambda: self._speculated_answer(handle, g, stop, done))

        handle = self.backend.submit(self.run.text, priority=self.priority, program=self.id,
                                     node=node.id, instruction=ins, on_done=on_done, **params)
        self._hold(handle)
        return handle.rid

    def _speculated_answer(self, handle, g, stop: list[str], done: Done) -> None:
        result = self._outcome(handle, done)
        if result is None:
            return
        value, self.run.speculated = speculation.take(result.text, stop)
        self.run.append(value, g.name)
        error = self._bind_gen(g, value, dict(result.meta))
        if result.meta.get("finish_reason") == "abort":
            error = ProgramCancelled(f"gen {g.name!r} was aborted")
        done(error, handle.usage())

    def _decoded(self, handle, g, prompt: str, done: Done) -> None:
        result = self._outcome(handle, done)
        if result is None:
            return
        self._keep_tokens(handle, result)  # an aborted gen's tokens so far too
        aborted = result.meta.get("finish_reason") == "abort"
        self.run.kv_len = len(self.run.text)  # the prompt and what was generated are cached
        if g.name is not None:
            options = {} if aborted else g.logprob_options(self.defaults)
            try:
                extra = logprob_meta(result, options, self.backend, prompt)
            except BaseException as e:  # noqa: BLE001 - e.g. the prompt logprobs' request
                done(e, handle.usage())
                return
            # A cut-off value stays text.
            error = self._bind_gen(g, result.text, {**result.meta, **extra}, convert=not aborted)
            if error is not None:
                done(error, handle.usage())
                return
        error = ProgramCancelled(f"gen {g.name!r} was aborted") if aborted else None
        done(error, handle.usage())

    def _gen_output(self, node: Node, g, out: Output, done: Done) -> None:
        """A re-run's Gen: its recorded (with its tokens) or edited value."""
        self.run.append(out.text, g.name)
        if out.tokens is not None:
            self.run.tokens[node.id] = list(out.tokens)
        error = self._bind_gen(g, out.text, dict(out.meta))
        done(error, {out.flag: True} if error else {out.flag: True, "output_tokens": 0})

    def _bind_gen(self, g, text: str, meta: dict, convert: bool = True) -> BaseException | None:
        """A gen's value bound to its name (with its meta, its reasoning split off, converted
        as gen_int and friends ask); the error a conversion raised, if any."""
        if g.name is None:
            return None
        self.run.meta[g.name] = meta
        if g.reasoning is not None:
            reasoning, text = split_reasoning(text, g.reasoning)
            self.run.bind(g.name + "_reasoning_content", reasoning)
        try:
            self.run.bind(g.name, g.convert(text) if convert else text)
        except (TypeError, ValueError) as e:
            return e
        return None

    def _keep_tokens(self, handle, result) -> None:
        """A finished Gen's TokenChoices, by its Node's id (token_info reads them). The
        engine's requests carry them; a server's (RuntimeEndpoint) do not."""
        tokens = getattr(result, "tokens", None)
        node = getattr(getattr(handle, "req", None), "node", None)
        if tokens is not None and node is not None:
            self.run.tokens[node] = list(tokens)

    # ---- Score ------------------------------------------------------------------------

    def start_scores(self, group: list, dones: list[Done]) -> list[int]:
        node = self.run.nodes_by_id[group[0].node]
        self.run.speculated = ""  # its choice is not read off a speculated answer
        out = self.run.strategy.output(node)
        if out is not None:  # a re-run's: its choice is bound when the Node ends
            for done in dones:
                done(None, {out.flag: True})
            return [None] * len(dones)
        tok = self.backend.tokenizer
        prefix = (tok.bos_token or "\n") if group[0].unconditional else self.run.text
        post = self.executor.post

        def on_done_for(ins, done: Done):
            return lambda handle: post(lambda: self._scored(node, ins, handle, done))

        handles = self.backend.submit_scores(
            prefix, [ins.choice for ins in group], priority=self.priority, program=self.id,
            node=node.id, instructions=group,
            on_done=[on_done_for(ins, done) for ins, done in zip(group, dones)])
        for h in handles:
            self._hold(h)
        return [h.rid for h in handles]

    def _scored(self, node: Node, ins, handle, done: Done) -> None:
        out = self._outcome(handle, done)
        if out is None:
            return
        if self.run.cancelled or out.meta.get("finish_reason") == "abort":
            done(ProgramCancelled(f"select {ins.name!r} was aborted"), handle.usage())
            return
        self.run.scores.setdefault(node.id, {})[(ins.unconditional, ins.choice_index)] = \
            out.input_logprobs
        if not ins.unconditional:
            self.run.kv_len = len(self.run.text)  # the prefix scored
        done(None, handle.usage())

    def _choose(self, node: SelectNode) -> BaseException | None:
        """All of a Select's Scores are in: pick, append, bind."""
        sel, got = self.run.payloads[node.id], self.run.scores.pop(node.id, {})
        out = self.run.strategy.output(node)
        if out is not None:
            self._bind_choice(sel, out.text, {"choices": list(sel.choices), out.flag: True})
            return None
        scored = node.scored()  # in choice order
        scores = [got[(False, i)] for i in scored]
        uncond = [got[(True, i)] for i in scored] if any(u for u, _ in got) else None
        try:
            j, meta = choose(sel.method, scores, uncond)
        except Exception as e:  # noqa: BLE001 - the node fails with it
            return e
        # The scores are those of the choices scored.
        self._bind_choice(sel, sel.choices[scored[j]],
                          {"choices": [sel.choices[i] for i in scored], **meta})
        return None

    def _bind_choice(self, sel, choice: str, meta: dict) -> None:
        self.run.append(choice, sel.name)
        if sel.name is not None:
            self.run.meta[sel.name] = meta
            self.run.bind(sel.name, choice)

    # ---- Fork / Join --------------------------------------------------------------------

    def _fork_branches(self, node: Node, ins: Fork) -> None:
        children = [self.state.branch(self.run.strategy.branch(node, i))
                    for i in range(ins.n)]
        self.run.children.extend(children)
        self.run.forked[node.id] = children
        self.emit(Forked, node=node.id, n=ins.n, children=tuple(c.id for c in children))
        for i, c in enumerate(children):
            c.emit(ProgramStarted, node=node.id, function=f"branch {i}",
                   priority=self.priority, parent=self.id, model=self._model_name())

    def _join_branches(self, node: Node, ins: Join) -> None:
        states = [c for c in self.run.children if c.id in ins.branches]
        runs = [s._run for s in states]
        with self.run.lock:  # the branches' Nodes belong to the parent's graph, before the Join
            at = self.run.nodes.index(node)
            self.run.nodes[at:at] = [n for r in runs for n in r.nodes]
        for s in states:
            s._recorder.effects.emit_finished()
        branches = tuple(s.id for s in states)
        failed = next((r for r in runs if r.error is not None), None)
        if self.run.cancelled:  # the branches' variables are kept; the program goes no further
            self._gather(runs)
            self.emit(Joined, node=node.id, mode=ins.mode, children=branches)
            raise ProgramCancelled(f"program {self.id} was cancelled")
        if failed is not None:
            self.run.set_error(failed.error)
            self.run.error_line = failed.error_line
            self.emit(Joined, node=node.id, mode=ins.mode, children=branches)
            raise failed.error
        if ins.mode == "concate_and_append":
            self.run.append("".join(r.text[r.fork_point:] for r in runs))
        else:
            self._gather(runs)
        self.emit(Joined, node=node.id, mode=ins.mode, children=branches)

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

    # ---- helpers ----------------------------------------------------------------------

    def _model_name(self) -> str | None:
        """For the events and spans only: never lets a backend's attribute error out."""
        try:
            return self.backend.model_name
        except Exception:  # noqa: BLE001 - a name for a trace is not worth failing a program
            return None

    def _outcome(self, handle, done: Done):
        """A finished request's output; None, with `done` told the error, if it failed (the
        Instruction fails, not the executor)."""
        self.run.inflight.discard(handle)
        try:
            return handle.result(0)
        except BaseException as e:  # noqa: BLE001
            done(e, handle.usage())
            return None

    def _hold(self, handle) -> None:
        """Keep a request in flight where cancel() finds it; a cancel that came first
        aborts it at once."""
        with self.run.cond:
            self.run.inflight.add(handle)
            cancelled = self.run.cancelled
        if cancelled:
            handle.cancel()
