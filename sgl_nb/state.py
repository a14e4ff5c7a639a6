"""ProgramState: the `s` of a program. `s += expr` records a Node and queues it; a worker
thread per state runs the queue in order on the backend, so the program's Python goes on
at once and fork branches run side by side. Reading `s["x"]` waits for x."""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from sgl_nb.expressions import Concat, Gen, Role, RoleBlock, Select
from sgl_nb.logprob_meta import logprob_meta
from sgl_nb.reasoning import split_reasoning
from sgl_nb.runtime.ir import Node, dot, listing, lower
from sgl_nb.runtime.passes import is_static_select
from sgl_nb.runtime.step_controller import StepController
from sgl_nb.select_scoring import choose

_state_ids = itertools.count(1)


class _ScopeMark:
    """Where `with s.var_scope(name):` starts or ends."""

    def __init__(self, name: str, begin: bool):
        self.name, self.begin = name, begin


class ProgramError(RuntimeError):
    """An exception inside a program, with the program line it came from."""


class ProgramCancelled(ProgramError):
    """The program was cancelled (`state.cancel()`, `fut.cancel()`, an interrupt while
    waiting on it). What it produced until then is kept on the state."""


class ProgramState:
    def __init__(self, backend, defaults: dict, text: str = "", parent: ProgramState | None = None,
                 debug: StepController | None = None, passes: frozenset[str] = frozenset(),
                 priority: str = "normal"):
        self.id = next(_state_ids)
        self.priority = priority  # the scheduler's level for this program's requests
        self.passes = passes
        self.pass_counts: dict[str, int] = {}
        self._held_text: Node | None = None  # a Text node not queued yet (fuse_text)
        self._submit_lock = threading.RLock()  # the program and a reader may both flush
        self.backend, self.defaults, self.parent = backend, defaults, parent
        self.debug = debug  # the step controller, when the program runs under the debugger
        self.events = getattr(backend, "events", None)
        self._text = text
        self._fork_point = len(text)
        self._vars: dict = {}
        self._meta: dict = {}
        self._messages: list[dict] = [] if parent is None else [dict(m) for m in parent._messages]
        self._role_start: int | None = None
        self._open_role: str | None = None  # the role a turn has open (not yet ended)
        self._scopes: dict[str, int] = {}
        self._error: BaseException | None = None
        self._error_line: int | None = None
        self._cancelled = False
        self._inflight: set = set()  # backend handles of the Gen running now
        self._children: list[ProgramState] = []  # fork branches, cancelled with it
        self.nodes: list[Node] = []
        self._cond = threading.Condition()
        self._pending = 0
        self._stream: list[tuple[str | None, str]] = []  # (variable, text) as it is produced
        self._finished = False  # set when the program body has returned and the queue drained
        # Nested calls `f(s, ...)`: one frame per level, outermost first (a debugger shows it).
        self.call_stack: list[dict] = [] if parent is None else list(parent.call_stack)
        self._body_thread: threading.Thread | None = None  # the thread running the program
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, name=f"sgl-state-{self.id}", daemon=True).start()

    # ---- the program side ----------------------------------------------------------------

    def __iadd__(self, expr) -> ProgramState:
        self._submit(expr, sys._getframe(1))
        return self

    def _submit(self, expr, frame=None) -> None:
        if self._cancelled:  # the program's Python stops at its next `s += ...`
            raise ProgramCancelled(f"program {self.id} was cancelled")
        line, file = (frame.f_lineno, frame.f_code.co_filename) if frame else (None, None)
        for kind, name, detail, payload in self._to_nodes(expr):
            with self._submit_lock:
                if kind == "Text" and self._fuse_text(detail["text"]):
                    continue
                node = Node(kind, self.id, [self.nodes[-1].id] if self.nodes else [], name,
                            detail, file, line,
                            stack=tuple(f["function"] for f in self.call_stack))
                self.nodes.append(node)
                self._flush_text()
                if kind == "Text" and "fuse_text" in self.passes:
                    self._held_text = node  # more text may join it before it is queued
                    continue
                self._enqueue(node, payload)

    def _fuse_text(self, text: str) -> bool:
        """The fuse_text pass, as the program runs: text added right after text becomes one
        Text node (one Extend instead of several)."""
        held = self._held_text
        if held is None:
            return False
        held.detail["text"] += text
        held.detail["fused"] = held.detail.get("fused", 1) + 1
        self.pass_counts["fuse_text"] = self.pass_counts.get("fuse_text", 0) + 1
        return True

    def _flush_text(self) -> None:
        with self._submit_lock:
            held, self._held_text = self._held_text, None
            if held is not None:
                self._enqueue(held, held.detail["text"])

    def _enqueue(self, node: Node, payload) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put((node, payload))

    def _to_nodes(self, expr):
        if isinstance(expr, str):
            return [("Text", None, {"text": expr}, expr)]
        if isinstance(expr, Concat):
            return [n for part in expr.parts for n in self._to_nodes(part)]
        if isinstance(expr, _ScopeMark):
            return [("VarScope", expr.name, {"begin": expr.begin}, expr)]
        if isinstance(expr, Gen):
            params = expr.sampling(self.defaults)
            if self.backend is not None and ("regex" in params or "json_schema" in params):
                # Compiled here, in the program's thread: a bad pattern fails at its line,
                # before any token is generated.
                self.backend.check_grammar(params.get("regex"), params.get("json_schema"))
            return [("Gen", expr.name, params, expr)]
        if isinstance(expr, Select):
            return [("Select", expr.name, {"choices": expr.choices, "method": expr.method}, expr)]
        if isinstance(expr, RoleBlock):
            out = self._to_nodes(Role(expr.role, True))
            try:
                for part in expr.content:
                    out.extend(self._to_nodes(part))
            except Exception:
                self._open_role = None  # nothing of the turn was added
                raise
            return [*out, *self._to_nodes(Role(expr.role, False))]
        if isinstance(expr, Role):
            self._track_role(expr)
            return [("RoleBegin" if expr.begin else "RoleEnd", None, {"role": expr.role}, expr)]
        raise TypeError(f"cannot add {type(expr).__name__} to a program state: {expr!r}")

    def _track_role(self, mark: Role) -> None:
        """Turns do not nest, and each ends the role it began."""
        if mark.begin and self._open_role is not None:
            raise ValueError(f"nested roles: {mark.role} inside an open {self._open_role}")
        if not mark.begin and self._open_role != mark.role:
            raise ValueError(f"{mark.role}_end without {mark.role}_begin (the open role is "
                             f"{self._open_role})")
        self._open_role = mark.role if mark.begin else None

    @contextmanager
    def _role_block(self, role: str):
        self._submit(Role(role, True), sys._getframe(2))
        try:
            yield self
        finally:
            self._submit(Role(role, False), sys._getframe(2))

    def system(self):
        return self._role_block("system")

    def user(self):
        return self._role_block("user")

    def assistant(self):
        return self._role_block("assistant")

    @contextmanager
    def var_scope(self, name: str):
        self._submit(_ScopeMark(name, True))
        try:
            yield self
        finally:
            self._submit(_ScopeMark(name, False))

    def fork(self, n: int = 1) -> ForkGroup:
        return self._fork(n, sys._getframe(1))

    def copy(self) -> ProgramState:
        """A branch that goes on from this state's text (SGLang's copy: a fork of one)."""
        return self._fork(1, sys._getframe(1)).states[0]

    def _fork(self, n: int, caller) -> ForkGroup:
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        self.sync()
        node = Node("Fork", self.id, [self.nodes[-1].id] if self.nodes else [], None, {"n": n},
                    caller.f_code.co_filename, caller.f_lineno)
        node.status = "done"
        self.nodes.append(node)
        children = [ProgramState(self.backend, self.defaults, self._text, parent=self,
                                 debug=self.debug, passes=self.passes, priority=self.priority)
                    for _ in range(n)]
        self._children.extend(children)
        self._emit_instant(node, "fork", {"n": n, "children": [c.id for c in children]})
        for i, c in enumerate(children):
            c._emit("program_started", node=node.id, data={
                "function": f"branch {i}", "priority": self.priority, "parent": self.id,
                "model": self._model_name()})
        return ForkGroup(self, children, node)

    def _emit_instant(self, node: Node, kind: str, data: dict) -> None:
        """Fork and Join run in the program's own thread, at once: their Node, their one
        Instruction and the fork/join event, in that order."""
        self._emit("node_started", node=node.id, data={
            "kind": node.kind, "name": None, "line": node.line, "file": node.file,
            "label": node.label(), "preds": list(node.preds)})
        self._emit("instruction_started", node=node.id, data={"kind": node.kind, "index": 0})
        self._emit(kind, node=node.id, data=data)
        self._emit("instruction_finished", node=node.id, data={"kind": node.kind, "index": 0})
        self._emit("node_finished", node=node.id, data={"status": node.status})

    def _model_name(self) -> str | None:
        """For the events and spans only: never lets a backend's attribute error out."""
        try:
            path = getattr(self.backend, "model_path", None)
            return getattr(path, "name", None) or getattr(self.backend, "model", None)
        except Exception:  # noqa: BLE001 - a name for a trace is not worth failing a program
            return None

    # ---- cancelling ----------------------------------------------------------------------

    def cancel(self) -> bool:
        """Stop the program: its running Gen or Select is aborted, its pending Nodes become
        `cancelled`, its fork branches are cancelled too, and its Python stops at its next
        `s += ...` or read. The text and variables produced so far are kept; `error()` is a
        ProgramCancelled. Returns at once; False if the program had already ended."""
        with self._cond:
            if self._finished or self._cancelled:
                return False
            self._cancelled = True
            if self._error is None:
                self._error = ProgramCancelled(f"program {self.id} was cancelled")
            handles = list(self._inflight)
            self._cond.notify_all()
        for child in self._children:
            child.cancel()
        for handle in handles:
            handle.cancel()
        self.backend.cancel_program(self.id)  # its Score requests, and any not seen yet
        if self.debug is not None:
            self.debug.continue_()  # a held program must not stay held: it has to end
        return True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def _interruptible(self, wait):
        """Run a blocking read; an interrupt (Ctrl-C, a Jupyter interrupt) while it waits
        cancels the program before it propagates, so nothing is left running for it."""
        try:
            return wait()
        except KeyboardInterrupt:
            self.cancel()
            raise

    def wait(self, timeout: float | None = None) -> ProgramState:
        """Block until the program has ended (its body returned and everything it queued
        ran, or it was cancelled); returns the state. TimeoutError after `timeout` s."""
        def ended() -> bool:
            with self._cond:
                return self._cond.wait_for(lambda: self._finished, timeout)

        if not self._interruptible(ended):
            raise TimeoutError(f"program {self.id} still running after {timeout} s")
        return self

    # ---- reading results ---------------------------------------------------------------

    def sync(self) -> None:
        """Wait until everything queued so far has run; from outside the program (a
        notebook cell reading a streamed run), until the program has finished."""
        self._interruptible(self._sync)

    def _sync(self) -> None:
        self._flush_text()
        if self._outside():
            self._wait_outside(lambda: False)
            return
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    def _outside(self) -> bool:
        """Called from a thread that is not the program's own body? (Its body may not have
        queued the Nodes yet, so "nothing pending" does not mean "done".)"""
        return self._body_thread is not None and threading.current_thread() is not \
            self._body_thread

    def _held(self) -> bool:
        return self.debug is not None and self.debug.waiting_at is not None

    def _wait_outside(self, ready) -> None:
        """Until ready(), the program ends, or a step controller holds it (what exists then
        is all there is until someone steps: waiting longer would hang a notebook cell)."""
        with self._cond:
            while not (ready() or self._finished or self._held()):
                self._cond.wait(0.05)

    def __getitem__(self, name: str):
        return self._interruptible(lambda: self._get(name))

    def _get(self, name: str):
        self._flush_text()
        if self._outside():
            self._wait_outside(lambda: name in self._vars)
            if name in self._vars:
                return self._vars[name]
            if not self._finished:
                raise ProgramError(f"variable {name!r} is not produced yet: the program is "
                                   "held by its step controller; step or continue it first")
        with self._cond:
            self._cond.wait_for(lambda: name in self._vars or self._pending == 0)
            if name in self._vars:
                return self._vars[name]
        if self._cancelled:
            raise ProgramCancelled(f"variable {name!r} was not produced: program {self.id} "
                                   "was cancelled")
        if self._error is not None:
            raise ProgramError(f"variable {name!r} was not produced: {self._error}")
        raise KeyError(f"unknown variable {name!r}; this program has {sorted(self._vars)}")

    def __setitem__(self, name: str, value) -> None:
        with self._cond:
            self._vars[name] = value
            self._cond.notify_all()

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def get_var(self, name: str):
        """SGLang's spelling of s[name]."""
        return self[name]

    def set_var(self, name: str, value) -> None:
        """SGLang's spelling of s[name] = value."""
        self[name] = value

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict]:
        self.sync()
        return [dict(m) for m in self._messages]

    def variables(self) -> dict:
        self.sync()
        return dict(self._vars)

    def get_meta_info(self, name: str) -> dict:
        self.sync()
        return self._meta.get(name, {})

    def error(self) -> BaseException | None:
        self.sync()
        return self._error

    def graph(self) -> str:
        """The Nodes this program ran, each with its Instructions (Init ... Return)."""
        self.sync()
        return listing(self.nodes, program=self.id)

    def dot(self) -> str:
        """The graph this program ran, as Graphviz DOT."""
        self.sync()
        return dot(f"program {self.id}", self.nodes)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is produced (only variable `var_name`'s, if given), until the end.
        An interrupt while it waits cancels the program."""
        i = 0
        while True:
            with self._cond:
                self._interruptible(lambda i=i: self._cond.wait_for(
                    lambda: len(self._stream) > i or self._finished))
                items, done = self._stream[i:], self._finished and len(self._stream) <= i
            if done:
                return
            i += len(items)
            for var, chunk in items:
                if var_name is None or var == var_name:
                    yield chunk

    async def text_async_iter(self, var_name: str | None = None):
        import asyncio

        it = self.text_iter(var_name)
        while True:
            chunk = await asyncio.to_thread(next, it, None)
            if chunk is None:
                return
            yield chunk

    def _finish(self, error: BaseException | None = None, frame_file: str | None = None):
        self.sync()  # what the program queued before it failed still runs: nothing is lost
        if error is not None and self._error is None:
            self._set_error(error, frame_file)
        if self.parent is None:
            preds = [self.nodes[-1].id] if self.nodes else []
            status = "cancelled" if self._cancelled else "done" if self._error is None \
                else "error"
            self.nodes.append(Node("Return", self.id, preds, status=status))
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def _set_error(self, error: BaseException, file: str | None = None) -> None:
        tb = traceback.extract_tb(error.__traceback__)
        lines = [f.lineno for f in tb if file is None or f.filename == file]
        self._error_line = lines[-1] if lines else None
        self._error = error

    @property
    def error_line(self) -> int | None:
        return self._error_line

    def _end_data(self) -> dict:
        """The program_finished event's data."""
        status = "cancelled" if self._cancelled else "error" if self._error else "done"
        return {"error": repr(self._error) if self._error else None, "line": self._error_line,
                "status": status}

    def __repr__(self) -> str:
        return f"ProgramState(id={self.id}, text={self._text[-60:]!r})"

    # ---- the worker ----------------------------------------------------------------------

    def _emit(self, kind: str, **fields) -> None:
        if self.events is not None:
            self.events.emit(kind, program=self.id, **fields)

    def _work(self) -> None:
        while True:
            node, payload = self._queue.get()
            if self._cancelled:
                self._cancel_pending(node)
            elif self._error is not None:
                node.status = "skipped"
            else:
                if self.debug is not None:
                    self.debug.before_node(node)
                if self._cancelled:  # cancelled while held before it
                    self._cancel_pending(node)
                else:
                    self._run_node(node, payload)
                    if self.debug is not None:
                        self.debug.after_node(node)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _node_started(self, node: Node) -> None:
        self._emit("node_started", node=node.id, data={
            "kind": node.kind, "name": node.name, "line": node.line, "file": node.file,
            "label": node.label(), "preds": list(node.preds), "stack": list(node.stack)})

    def _cancel_pending(self, node: Node) -> None:
        """A Node queued before the program was cancelled: it never runs, and says so."""
        node.status = "cancelled"
        self._node_started(node)
        self._emit("node_finished", node=node.id, data={"status": "cancelled", "text": ""})

    def _run_node(self, node: Node, payload) -> None:
        node.status = "running"
        self._node_started(node)
        # Decode and Score run on the engine, which reports them itself.
        local = [i for i in lower(node) if i.kind not in ("Decode", "Score")]
        for i, ins in enumerate(local):
            self._emit("instruction_started", node=node.id, data={"kind": ins.kind, "index": i})
        start = len(self._text)
        try:
            self._execute(node, payload)
            node.status = "done"
            for i, ins in enumerate(local):
                self._emit("instruction_finished", node=node.id,
                           data={"kind": ins.kind, "index": i})
        except ProgramCancelled:  # aborted mid-way: what it produced is kept
            node.status = "cancelled"
        except Exception as e:  # the program fails; the engine and others go on
            node.status = "error"
            self._set_error(e, node.file)
            self._error_line = node.line
            self._emit("error", node=node.id, data={"error": repr(e), "line": node.line})
        done = {"status": node.status, "text": self._text[start:]}
        if node.name is not None and node.name in self._vars:
            done["value"] = repr(self._vars[node.name])
        self._emit("node_finished", node=node.id, data=done)

    def _append(self, text: str, var: str | None = None) -> None:
        with self._cond:
            self._text += text
            self._stream.append((var, text))
            self._cond.notify_all()

    def _execute(self, node: Node, payload) -> None:
        if node.kind == "Text":
            self._append(node.detail["text"])
        elif node.kind in ("RoleBegin", "RoleEnd"):
            self._role_marker(node, payload)
        elif node.kind == "Gen":
            self._gen(node, payload)
        elif node.kind == "Select":
            self._select(node, payload)
        elif node.kind == "VarScope":
            self._scope(payload)

    def _role_marker(self, node: Node, mark: Role) -> None:
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
        node.detail["text"] = self._text[start:]  # the default system prompt included

    def _gen(self, node: Node, g: Gen) -> None:
        out = ""
        gate = None
        if self.debug is not None:
            gate = self.debug.may_decode
            self.debug._wake_engine = getattr(self.backend, "wake", None)
        prompt = self._text
        handle = self.backend.submit(prompt, stream=True, gate=gate, priority=self.priority,
                                     program=self.id, node=node.id, **node.detail)
        with self._cond:
            self._inflight.add(handle)
            cancelled = self._cancelled  # cancelled before the handle could be seen
        if cancelled:
            handle.cancel()
        try:
            for chunk in handle.chunks():
                out += chunk
                self._append(chunk, g.name)
            result = handle.result()
        finally:
            self._inflight.discard(handle)
        aborted = result.meta.get("finish_reason") == "abort"
        if g.name is not None:
            options = {} if aborted else g.logprob_options(self.defaults)
            self._meta[g.name] = {**result.meta,
                                  **logprob_meta(result, options, self.backend, prompt)}
            if g.reasoning is not None:
                reasoning, out = split_reasoning(out, g.reasoning)
                self[g.name + "_reasoning_content"] = reasoning
            self[g.name] = out if aborted else g.convert(out)  # a cut-off value stays text
        if aborted:
            raise ProgramCancelled(f"gen {g.name!r} was aborted")

    def _select(self, node: Node, sel: Select) -> None:
        if "static_select" in self.passes and is_static_select(node):
            # Decided without the model: no Score instruction runs.
            self.pass_counts["static_select"] = self.pass_counts.get("static_select", 0) + 1
            node.detail["resolved"] = "static"
            self._append(sel.choices[0], sel.name)
            if sel.name is not None:
                self._meta[sel.name] = {"choices": sel.choices, "resolved": "static"}
                self[sel.name] = sel.choices[0]
            return
        scores = self.backend.score(self._text, sel.choices, priority=self.priority,
                                    program=self.id, node=node.id)
        uncond = None
        if sel.method == "unconditional_likelihood_normalized" and not self._cancelled:
            uncond = self.backend.score(self.backend.tokenizer.bos_token or "\n", sel.choices,
                                        priority=self.priority, program=self.id, node=node.id)
        if self._cancelled:  # its scores may be cut short: no choice is made
            raise ProgramCancelled(f"select {sel.name!r} was aborted")
        index, meta = choose(sel.method, scores, uncond)
        self._append(sel.choices[index], sel.name)
        if sel.name is not None:
            self._meta[sel.name] = {"choices": sel.choices, **meta}
            self[sel.name] = sel.choices[index]

    def _scope(self, mark: _ScopeMark) -> None:
        if mark.begin:
            self._scopes[mark.name] = len(self._text)
        else:
            self[mark.name] = self._text[self._scopes.pop(mark.name):]


class ForkGroup:
    """The branches of `s.fork(n)`: `forks[i] += ...`, `forks += lambda i: ...`, `join()`."""

    def __init__(self, parent: ProgramState, states: list[ProgramState], node: Node):
        self.parent, self.states, self.node = parent, states, node

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:
            raise TypeError("assign fork branches with `forks[i] += ...`")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other) -> ForkGroup:
        frame = sys._getframe(1)
        for i, s in enumerate(self.states):
            s._submit(other(i) if callable(other) else other, frame)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(
                f"join mode must be gather_variable or concate_and_append, got {mode!r}"
            )
        for s in self.states:
            s.sync()
        p = self.parent
        preds = [s.nodes[-1].id for s in self.states if s.nodes] or [self.node.id]
        caller = sys._getframe(1)
        node = Node("Join", p.id, preds, None, {"mode": mode}, caller.f_code.co_filename,
                    caller.f_lineno)
        for s in self.states:
            p.nodes.extend(s.nodes)  # the branches' Nodes belong to the parent's graph
        p.nodes.append(node)
        errors = [s._error for s in self.states if s._error is not None]
        for s in self.states:
            s._emit("program_finished", data=s._end_data())
        if p._cancelled:  # the branches' variables are kept; the program goes no further
            for k in {k for s in self.states for k in s._vars}:
                p._vars[k] = [s._vars.get(k) for s in self.states]
            node.status = "cancelled"
            p._emit_instant(node, "join", {"mode": mode, "children": [s.id for s in self.states]})
            raise ProgramCancelled(f"program {p.id} was cancelled")
        if errors:
            node.status = "error"
            p._set_error(errors[0])
            p._error_line = next(s._error_line for s in self.states if s._error is not None)
            p._emit_instant(node, "join", {"mode": mode, "children": [s.id for s in self.states]})
            return
        if mode == "concate_and_append":
            p._submit("".join(s._text[s._fork_point:] for s in self.states))
        else:
            names = {k for s in self.states for k in s._vars}
            for k in names:
                p[k] = [s._vars.get(k) for s in self.states]
        node.status = "done"
        p._emit_instant(node, "join", {"mode": mode, "children": [s.id for s in self.states]})
