"""What each Instruction does to its program: the executor (runtime/compiler/executor.py)
calls these on its own thread, in order, so a program's text and variables change in one
thread.

Extend appends text (a role marker's comes from the chat template, a decided select's is its
choice); Decode and Score submit engine work that carries the Instruction and come back
through callbacks; Fork makes the branches; Join gathers them; Return ends the program.
"""

from __future__ import annotations

import json
import time

from sgl_nb.language import speculation
from sgl_nb.language.logprob_meta import ChunkMeta, logprob_meta
from sgl_nb.language.reasoning import split_reasoning
from sgl_nb.language.replay_effects import ReplayEffects
from sgl_nb.language.select_scoring import choose
from sgl_nb.runtime.compiler.executor import Done
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
    ProgramStarted,
    meta_json,
    stack_args,
)
from sgl_nb.runtime.status import Status

# A fork's shared Extend runs only when at least this much of the branches' common text is
# not computed yet (less is not worth a request of its own).
SHARE_MIN_CHARS = 32


class ProgramEffects(ReplayEffects):
    """The executor's side of ProgramState (a mixin: the state holds the data)."""

    # ---- the executor's host interface ------------------------------------------------

    def emit(self, cls: type[Event], **fields) -> None:
        if self.events is not None:
            self.events.emit(cls, program=self.id, **fields)

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
            self._replay_step(node)
            self._node_started_event(node)
            self._node_start[node.id] = len(self._text)
            return True
        if self._cancelled:
            node.status = Status.CANCELLED
            self._node_started_event(node)
            return False
        if self._error is not None:
            node.status = Status.SKIPPED  # the program failed before it
            return False
        node.status = Status.RUNNING
        self._replay_step(node)  # first: an edit's sampling arguments are the Node's now
        self._node_started_event(node)
        self._node_start[node.id] = len(self._text)
        if isinstance(node, VarScopeNode):  # no Instruction: it marks where its text starts, ends
            self._scope(self._payloads[node.id])
        return True

    def start(self, ins: Instruction, done: Done) -> int | None:
        node = self._nodes_by_id.get(ins.node) if ins.node is not None else None
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
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

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
            if self._error is None:
                self._set_error(error, node.file)
                self._error_line = node.line
            self.emit(Failed, node=node.id, error=repr(error), line=node.line)
        else:
            node.status = Status.DONE
        node.output = self._text[self._node_start.pop(node.id, 0):]
        node.end_ns = time.monotonic_ns()
        value = meta = None
        if node.name is not None and node.name in self._vars:
            value = repr(self._vars[node.name])
            meta = meta_json(self._meta.get(node.name))
        self.emit(NodeFinished, node=node.id, status=node.status, text=node.output, value=value,
                  meta=meta)

    def _end_program(self, node: Node) -> None:
        body_error, file = self._payloads.get(node.id) or (None, None)
        with self._cond:
            if body_error is not None and self._error is None:
                self._set_error(body_error, file)
        node.status = self._end_status()
        self._emit_finished()
        with self._cond:
            self._finished = True
            self._cond.notify_all()
        self._ended.set()

    # ---- Extend -----------------------------------------------------------------------

    def _extend(self, node: Node, ins) -> None:
        start = len(self._text)
        if isinstance(node, TextNode | SelectNode):  # a re-run's edit of it
            ins.text = self._edited_text(node, ins.text)
        self._extend_text(node, ins)
        if self.speculated:
            self.speculated = speculation.fill(self.speculated, self._text[start:])

    def _extend_text(self, node: Node, ins) -> None:
        if isinstance(node, RoleNode):
            self._role_marker(node, self._payloads[node.id])
            ins.text = node.text
        elif isinstance(node, SelectNode):  # decided by a pass: no Score ran
            self._append(ins.text, ins.name)
            if ins.name is not None:
                self._meta[ins.name] = {"choices": node.choices,
                                        "resolved": node.resolved or "static"}
                self[ins.name] = ins.text
        else:
            self._append(ins.text)

    def _role_marker(self, node: RoleNode, mark) -> None:
        roles = self.backend.chat_roles
        start = len(self._text)
        if mark.begin:
            if not self._messages and mark.role != "system" and self._text == "":
                self._append(roles.default_system)
            self._append(roles.prefix[mark.role])
            self._role_start = len(self._text)
        else:
            content = self._text[self._role_start:]
            self._messages.append({"role": mark.role, "content": content})
            self._append(roles.suffix[mark.role])
        node.text = self._text[start:]  # the default system prompt included

    def _scope(self, mark) -> None:
        if mark.begin:
            self._scopes[mark.name] = len(self._text)
        else:
            self[mark.name] = self._text[self._scopes.pop(mark.name):]

    def _prefill(self, ins, done: Done) -> int | None:
        """A shared Extend: one prefill of the prefix others will start from. Computing it
        is an optimisation, so a failure is reported on the Instruction, not raised: the
        requests after it fail with their own error if the prefix is the problem."""
        if not ins.text:  # a fork's: the text so far, unless its requests computed it
            if len(self._text) - self._kv_len < SHARE_MIN_CHARS:
                done(None, {"cached": True})
                return None
            ins.text = self._text

        def on_done(handle) -> None:
            self._executor.post(lambda: self._prefilled(handle, ins, done))

        handle = self.backend.prefill(ins.text, priority=self.priority, program=self.id,
                                      node=ins.node, instruction=ins, on_done=on_done)
        self._hold(handle)
        return handle.rid

    def _prefilled(self, handle, ins, done: Done) -> None:
        self._inflight.discard(handle)
        try:
            out = handle.result(0)
        except BaseException as e:  # noqa: BLE001 - see _prefill
            done(None, {**handle.usage(), "prefill_error": repr(e)})
            return
        aborted = out.meta.get("finish_reason") == "abort"
        if not aborted and self._text.startswith(ins.text):
            self._kv_len = max(self._kv_len, len(ins.text))
        done(self._cancel_error("the shared prefix was aborted") if aborted else None,
             handle.usage())

    # ---- Decode -----------------------------------------------------------------------

    def _decode(self, node: Node, ins, done: Done) -> int | None:
        g, prompt = self._payloads[node.id], self._text
        stepped = self._stepped(node)
        if stepped is not None:  # a re-run: its recorded or edited value, no decoding
            self._replay_gen(node, g, stepped, done)
            return None
        ins.params = self._edited_params(node, ins.params)
        if self.spec_tokens and speculation.speculable(ins.params):
            return self._speculate(node, ins, g, done)
        self.speculated = ""
        gate = None
        if self.debug is not None:
            gate = self.debug.may_decode
            self.debug.add_waker(self.backend.wake)
        post = self._executor.post
        counted = ChunkMeta(g.logprob_options(self.defaults).get("return_text_in_logprobs"),
                            self.backend)

        def on_chunk(delta: str) -> None:
            post(lambda: self._append(delta, g.name, counted.next()))

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
        if self.speculated:
            value, self.speculated = speculation.take(self.speculated, stop)
            self._speculated_value(g, value, {"speculated": True})
            done(None, {"speculated": True, "output_tokens": 0})
            return None
        params = {**ins.params, "stop": [],
                  "max_tokens": max(ins.params.get("max_tokens", 0), self.spec_tokens)}

        def on_done(handle) -> None:
            self._executor.post(lambda: self._speculated_answer(handle, g, stop, done))

        handle = self.backend.submit(self._text, priority=self.priority, program=self.id,
                                     node=node.id, instruction=ins, on_done=on_done, **params)
        self._hold(handle)
        return handle.rid

    def _speculated_answer(self, handle, g, stop: list[str], done: Done) -> None:
        result = self._outcome(handle, done)
        if result is None:
            return
        value, self.speculated = speculation.take(result.text, stop)
        self._speculated_value(g, value, result.meta)
        aborted = result.meta.get("finish_reason") == "abort"
        done(self._cancel_error(f"gen {g.name!r} was aborted") if aborted else None,
             handle.usage())

    def _speculated_value(self, g, value: str, meta: dict) -> None:
        self._append(value, g.name)
        if g.name is not None:
            self._meta[g.name] = dict(meta)
            self[g.name] = g.convert(value)

    def _decoded(self, handle, g, prompt: str, done: Done) -> None:
        result = self._outcome(handle, done)
        if result is None:
            return
        self._keep_tokens(handle, result)  # an aborted gen's tokens so far too
        aborted = result.meta.get("finish_reason") == "abort"
        self._kv_len = len(self._text)  # the prompt and what was generated are cached
        if g.name is not None:
            options = {} if aborted else g.logprob_options(self.defaults)
            try:
                extra = logprob_meta(result, options, self.backend, prompt)
            except BaseException as e:  # noqa: BLE001 - e.g. the prompt logprobs' request
                done(e, handle.usage())
                return
            self._meta[g.name] = {**result.meta, **extra}
            out = result.text
            if g.reasoning is not None:
                reasoning, out = split_reasoning(out, g.reasoning)
                self[g.name + "_reasoning_content"] = reasoning
            try:
                self[g.name] = out if aborted else g.convert(out)  # a cut-off value stays text
            except (TypeError, ValueError) as e:
                done(e, handle.usage())
                return
        error = self._cancel_error(f"gen {g.name!r} was aborted") if aborted else None
        done(error, handle.usage())

    def _keep_tokens(self, handle, result) -> None:
        """A finished Gen's TokenChoices, by its Node's id (token_info reads them). The
        engine's requests carry them; a server's (RuntimeEndpoint) do not."""
        tokens = getattr(result, "tokens", None)
        node = getattr(getattr(handle, "req", None), "node", None)
        if tokens is not None and node is not None:
            self._tokens[node] = list(tokens)

    # ---- Score ------------------------------------------------------------------------

    def start_scores(self, group: list, dones: list[Done]) -> list[int]:
        node = self._nodes_by_id[group[0].node]
        self.speculated = ""  # its choice is not read off a speculated answer
        stepped = self._stepped(node)
        if stepped is not None:
            return self._replay_scores(node, stepped, dones)
        tok = self.backend.tokenizer
        prefix = (tok.bos_token or "\n") if group[0].unconditional else self._text
        post = self._executor.post

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
        if self._cancelled or out.meta.get("finish_reason") == "abort":
            done(self._cancel_error(f"select {ins.name!r} was aborted"), handle.usage())
            return
        self._scores.setdefault(node.id, {})[(ins.unconditional, ins.choice_index)] = \
            out.input_logprobs
        if not ins.unconditional:
            self._kv_len = len(self._text)  # the prefix scored
        done(None, handle.usage())

    def _choose(self, node: SelectNode) -> BaseException | None:
        """All of a Select's Scores are in: pick, append, bind."""
        sel, got = self._payloads[node.id], self._scores.pop(node.id, {})
        if self._replay_choice(node, sel):
            return None
        scored = node.scored()  # in choice order
        scores = [got[(False, i)] for i in scored]
        uncond = [got[(True, i)] for i in scored] if any(u for u, _ in got) else None
        try:
            j, meta = choose(sel.method, scores, uncond)
        except Exception as e:  # noqa: BLE001 - the node fails with it
            return e
        choice = sel.choices[scored[j]]
        self._append(choice, sel.name)
        if sel.name is not None:  # the scores are those of the choices scored
            self._meta[sel.name] = {"choices": [sel.choices[i] for i in scored], **meta}
            self[sel.name] = choice
        return None

    # ---- Fork / Join --------------------------------------------------------------------

    def _fork_branches(self, node: Node, ins: Fork) -> None:
        children = [type(self)(self.backend, self.defaults, self._text, parent=self,
                               debug=self.debug, passes=self.passes, priority=self.priority)
                    for _ in range(ins.n)]
        for i, c in enumerate(children):
            c._kv_len = self._kv_len
            # As SGLang forks: the variables so far, and the turn the parent has open.
            c._vars = dict(self._vars)
            c._open_role, c._role_start = self._open_role, self._role_start
            if self.replay is not None:
                c.replay = self.replay.branch(self._steps[node.id].index, i)
        self._children.extend(children)
        self._forked[node.id] = children
        self.emit(Forked, node=node.id, n=ins.n, children=tuple(c.id for c in children))
        for i, c in enumerate(children):
            c.emit(ProgramStarted, node=node.id, function=f"branch {i}",
                   priority=self.priority, parent=self.id, model=self._model_name())

    def _join_branches(self, node: Node, ins: Join) -> None:
        states = [c for c in self._children if c.id in ins.branches]
        with self._lock:  # the branches' Nodes belong to the parent's graph, before the Join
            at = self.nodes.index(node)
            self.nodes[at:at] = [n for s in states for n in s.nodes]
        for s in states:
            s._emit_finished()
        branches = tuple(s.id for s in states)
        failed = next((s for s in states if s._error is not None), None)
        if self._cancelled:  # the branches' variables are kept; the program goes no further
            self._gather(states)
            self.emit(Joined, node=node.id, mode=ins.mode, children=branches)
            raise self._cancel_error(f"program {self.id} was cancelled")
        if failed is not None:
            self._set_error(failed._error)
            self._error_line = failed._error_line
            self.emit(Joined, node=node.id, mode=ins.mode, children=branches)
            raise failed._error
        if ins.mode == "concate_and_append":
            self._append("".join(s._text[s._fork_point:] for s in states))
        else:
            self._gather(states)
        self.emit(Joined, node=node.id, mode=ins.mode, children=branches)

    def _gather(self, states) -> None:
        """SGLang's gather_variable: a name the parent does not have becomes a list of the
        values of the branches that have it, in branch order. A name the parent has
        (inherited at the fork, or bound since) is not gathered, even if a branch re-bound
        it."""
        gathered: dict[str, list] = {}
        for s in states:
            for k, v in s._vars.items():
                if k not in self._vars:
                    gathered.setdefault(k, []).append(v)
        for k, values in gathered.items():
            self[k] = values

    # ---- helpers ----------------------------------------------------------------------

    def _outcome(self, handle, done: Done):
        """A finished request's output; None, with `done` told the error, if it failed (the
        Instruction fails, not the executor)."""
        self._inflight.discard(handle)
        try:
            return handle.result(0)
        except BaseException as e:  # noqa: BLE001
            done(e, handle.usage())
            return None

    def _hold(self, handle) -> None:
        """Keep a request in flight where cancel() finds it; a cancel that came first
        aborts it at once."""
        with self._cond:
            self._inflight.add(handle)
            cancelled = self._cancelled
        if cancelled:
            handle.cancel()
