"""ProgramState: the `s` of a program.

The program's Python (a body thread from sgl_nb/language/body_pool.py) is the interpreter:
`s += ...` records Nodes. Wherever something depends on them (a gen, a select, a fork, a read,
the end) the Nodes recorded since the last such point go through the passes
(runtime/compiler/passes.py), are lowered to Instructions (runtime/compiler/lowering.py) and
handed to the executor (runtime/compiler/executor.py), which runs them in order on its own
thread; what they do to the text and the variables is in sgl_nb/language/effects.py. The
Python goes on at once and blocks only where it reads a generated value (`s["x"]`,
`s.text()`)."""

from __future__ import annotations

import itertools
import operator
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import MappingProxyType

from sgl_nb.language.effects import ProgramEffects
from sgl_nb.language.expressions import (
    Concat,
    Gen,
    Role,
    RoleBlock,
    Select,
    assistant,
    system,
    user,
)
from sgl_nb.language.replay import MISSING
from sgl_nb.language.rerun import rerun_state
from sgl_nb.language.snapshot import ProgramSnapshot
from sgl_nb.language.token_info import TokenInfo, token_info
from sgl_nb.runtime.compiler.executor import get_executor
from sgl_nb.runtime.compiler.instructions import Cancelled
from sgl_nb.runtime.compiler.ir import (
    ForkNode,
    GenNode,
    InitNode,
    JoinNode,
    Node,
    ReturnNode,
    RoleBeginNode,
    RoleEndNode,
    SelectNode,
    TextNode,
    VarScopeNode,
    dot,
)
from sgl_nb.runtime.compiler.listing import listing
from sgl_nb.runtime.compiler.lowering import lower
from sgl_nb.runtime.compiler.passes import run_passes
from sgl_nb.runtime.compiler.step_controller import StepController
from sgl_nb.runtime.events import ProgramFinished, VariableSet
from sgl_nb.runtime.status import Status

_state_ids = itertools.count(1)


_TURNS = {"system": system, "user": user, "assistant": assistant}


class _ScopeMark:
    """Where `with s.var_scope(name):` starts or ends."""

    def __init__(self, name: str, begin: bool):
        self.name, self.begin = name, begin


class ProgramError(RuntimeError):
    """An exception inside a program, with the program line it came from."""


class ProgramCancelled(ProgramError, Cancelled):
    """The program was cancelled (`state.cancel()`, `fut.cancel()`, an interrupt while
    waiting on it). What it produced until then is kept on the state."""


class ProgramState(ProgramEffects):
    def __init__(self, backend, defaults: dict, text: str = "", parent: ProgramState | None = None,
                 debug: StepController | None = None, passes: frozenset[str] = frozenset(),
                 priority: str = "normal"):
        self.id = next(_state_ids)
        self.priority = priority  # the scheduler's level for this program's requests
        self.passes = passes
        self.pass_counts: dict[str, int] = {}
        self.backend, self.defaults, self.parent = backend, defaults, parent
        self.debug = debug  # the step controller, when the program runs under the debugger
        self.events = backend.events
        self._executor = get_executor()
        if debug is not None:
            debug.add_waker(self._executor.wake)
        self._text = text
        self._fork_point = len(text)
        self._kv_len = 0  # how much of the text the engine is known to have computed
        self._vars: dict = {}
        self._meta: dict = {}
        self._messages: list[dict] = [] if parent is None else [dict(m) for m in parent._messages]
        self._role_start: int | None = None
        self._open_role: str | None = None  # the role a turn has open (not yet ended)
        self._scopes: dict[str, int] = {}
        self._error: BaseException | None = None
        self._error_line: int | None = None
        self._cancelled = False
        self._inflight: set = set()  # engine requests running for it now
        self._children: list[ProgramState] = []  # fork branches, cancelled with it
        self.nodes: list[Node] = []  # handed to the executor, in order
        self._buffer: list[Node] = []  # recorded, not yet through the passes
        self._payloads: dict[int, object] = {}  # node id -> the expression it came from
        self._nodes_by_id: dict[int, Node] = {}
        self._node_start: dict[int, int] = {}  # node id -> where its text starts
        self._scores: dict[int, dict] = {}  # select node id -> the scores of its choices
        self._forked: dict[int, list[ProgramState]] = {}  # fork node id -> its branches
        self._lock = threading.RLock()  # the program and a reader may both flush
        self._cond = threading.Condition()
        self._pending = 0  # Nodes handed to the executor that have not ended
        # (variable, text, meta) as it is produced; meta: a decoded chunk's tokens so far
        self._stream: list[tuple[str | None, str, dict | None]] = []
        self._finished = False  # its Return ran
        self._ended = threading.Event()
        # Nested calls `f(s, ...)`: one frame per level, outermost first (a debugger shows it).
        self.call_stack: list[dict] = [] if parent is None else list(parent.call_stack)
        self._body_thread: threading.Thread | None = None  # the thread running the program
        self._has_body = False  # a body runs (or will): a fork branch has none
        # API speculative execution (sgl_nb/language/speculation.py): tokens a gen asks for at once,
        # and what of the answer the following text and gens have not taken yet.
        self.spec_tokens: int | None = None
        self.speculated = ""
        self.call = None  # the ProgramCall that started it (function.py): rerun() repeats it
        self.replay = None  # a re-run's record of the run it repeats (language/replay.py)
        self._tokens: dict = {}  # gen node id -> its TokenChoices, in order
        self._steps: dict = {}  # node id -> what the re-run does with it (Stepped)
        self._chosen: dict = {}  # select node id -> (choice, how) a re-run gave it
        self.rerun_report = None  # a re-run's RerunReport
        self.rerun_of = None  # ... and the record of the run it repeats (a ProgramRecord)
        self.ret_value = None  # what the program's function returned (SGLang's name)
        self._copy_of: ForkGroup | None = None  # `with s.copy() as c:` joins this at its end

    def begin(self, function: str, shared_prefix: str = "", after=None,
              call: dict | None = None) -> Node:
        """A program's start: its Init Node, queued ahead of anything its body records (the
        executor runs its Init Instruction, which says program_started). `shared_prefix`:
        this program also computes that text for others (a shared Extend after Init);
        `after`: such an Extend of another program, which this one starts after."""
        self.function = function
        self._has_body = True
        node = InitNode(program=self.id, function=function, shared_prefix=shared_prefix,
                        after=after, call=call or {})
        self._record(node)
        return node

    # ---- the program side ----------------------------------------------------------------

    def __iadd__(self, expr) -> ProgramState:
        self._submit(expr, sys._getframe(1))
        return self

    def _submit(self, expr, frame=None) -> None:
        if self._cancelled:  # the program's Python stops at its next `s += ...`
            raise ProgramCancelled(f"program {self.id} was cancelled")
        line, file = (frame.f_lineno, frame.f_code.co_filename) if frame else (None, None)
        stack = tuple(f["function"] for f in self.call_stack)
        with self._lock:
            for cls, fields, payload in self._to_nodes(expr):
                self._record(cls(program=self.id, preds=self._preds(), file=file, line=line,
                                 stack=stack, **fields), payload)

    def _record(self, node: Node, payload=None) -> None:
        with self._lock:
            self._buffer.append(node)
            self._payloads[node.id] = payload
            if not isinstance(node, TextNode):  # text may still fuse with what follows
                self._flush()

    def _preds(self) -> list[int]:
        last = self._buffer[-1] if self._buffer else self.nodes[-1] if self.nodes else None
        return [last.id] if last is not None and not isinstance(last, InitNode) else []

    def _flush(self) -> None:
        """The Nodes recorded since the last flush: passes, lowering, the executor."""
        with self._lock:
            if not self._buffer:
                return
            nodes, reports = run_passes(self._buffer, self.passes)
            self._buffer = []
            for r in reports:
                if r.changed:
                    self.pass_counts[r.name] = self.pass_counts.get(r.name, 0) + r.changed
            for n in nodes:
                n.instructions = lower(n)
                self._nodes_by_id[n.id] = n
            self.nodes.extend(nodes)
            with self._cond:
                self._pending += len(nodes)
            self._executor.add(self, nodes)

    def _to_nodes(self, expr) -> list[tuple[type[Node], dict, object]]:
        """What `s += expr` adds: (Node class, its fields, the expression it came from)."""
        if isinstance(expr, str):
            return [(TextNode, {"text": expr}, expr)]
        if isinstance(expr, Concat):
            return [n for part in expr.parts for n in self._to_nodes(part)]
        if isinstance(expr, _ScopeMark):
            return [(VarScopeNode, {"name": expr.name, "begin": expr.begin}, expr)]
        if isinstance(expr, Gen):
            params = expr.sampling(self.defaults)
            if self.backend is not None and ("regex" in params or "json_schema" in params):
                # Compiled here, in the program's thread: a bad pattern fails at its line,
                # before any token is generated.
                self.backend.check_grammar(params.get("regex"), params.get("json_schema"))
            return [(GenNode, {"name": expr.name, "sampling": params}, expr)]
        if isinstance(expr, Select):
            fields = {"name": expr.name, "choices": expr.choices, "method": expr.method}
            allowed = expr.allowed()
            if len(allowed) < len(expr.choices):  # the gen's grammar ruled some out
                fields["allowed"] = allowed
            return [(SelectNode, fields, expr)]
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
            return [(RoleBeginNode if expr.begin else RoleEndNode, {"role": expr.role}, expr)]
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

    def _role_turn(self, role: str, expr, caller):
        """`with s.user():` (no expr), or SGLang's `s.user(expr)`: the whole turn added at
        once, the expression returned."""
        if expr is None:
            return self._role_block(role)
        turn = _TURNS[role](expr)
        self._submit(turn, caller)
        return turn

    def system(self, expr=None):
        return self._role_turn("system", expr, sys._getframe(1))

    def user(self, expr=None):
        return self._role_turn("user", expr, sys._getframe(1))

    def assistant(self, expr=None):
        return self._role_turn("assistant", expr, sys._getframe(1))

    @contextmanager
    def var_scope(self, name: str):
        self._submit(_ScopeMark(name, True))
        try:
            yield self
        finally:
            self._submit(_ScopeMark(name, False))

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ForkGroup:
        """`size` branches, each starting from this state's text, messages, open role and
        variables. `position_ids_offset` is accepted as SGLang takes it; SGLang's own
        interpreter passes it nowhere, and here too it changes nothing."""
        return self._fork(_fork_size(size, position_ids_offset), sys._getframe(1))

    def copy(self, position_ids_offset: list[int] | None = None) -> ProgramState:
        """A branch that goes on from this state (a fork of one). `with s.copy() as c:`
        joins it at the block's end (its new variables gathered, as SGLang's copy does);
        `c = s.copy()` leaves it unjoined."""
        group = self._fork(_fork_size(1, position_ids_offset), sys._getframe(1))
        branch = group.states[0]
        branch._copy_of = group
        return branch

    def __enter__(self) -> ProgramState:
        if self._copy_of is None:
            raise TypeError("`with` takes a copy of a state: `with s.copy() as c:`")
        return self

    def __exit__(self, *exc) -> None:
        group, self._copy_of = self._copy_of, None
        group._join("gather_variable", sys._getframe(1))  # SGLang joins even on an error

    def _fork(self, n: int, caller) -> ForkGroup:
        node = ForkNode(program=self.id, preds=self._preds(), n=n,
                        file=caller.f_code.co_filename, line=caller.f_lineno)
        self._record(node)
        self._wait_node(node)  # the branches start from the text the parent has then
        return ForkGroup(self, self._forked[node.id], node)

    def _wait_node(self, node: Node) -> None:
        """Until the executor has run `node`; raises if it did not run to its end."""
        with self._cond:
            self.interruptible(lambda: self._cond.wait_for(lambda: node.status.ended))
        if node.status is Status.CANCELLED or self._cancelled:
            raise ProgramCancelled(f"program {self.id} was cancelled")
        if node.status is not Status.DONE:
            raise ProgramError(f"{node.kind.value} did not run: {self._error}")

    def _model_name(self) -> str | None:
        """For the events and spans only: never lets a backend's attribute error out."""
        try:
            return self.backend.model_name
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
        self.backend.cancel_program(self.id)  # anything submitted and not seen yet
        if self.debug is not None:
            self.debug.continue_()  # a held program must not stay held: it has to end
        self._executor.wake()
        return True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def _cancel_error(self, what: str) -> ProgramCancelled:
        return ProgramCancelled(what)

    def interruptible(self, wait):
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
        self._flush()
        if not self.interruptible(lambda: self._ended.wait(timeout)):
            raise TimeoutError(f"program {self.id} still running after {timeout} s")
        return self

    # ---- reading results ---------------------------------------------------------------

    def sync(self) -> None:
        """Wait until everything queued so far has run; from outside the program (a
        notebook cell reading a streamed run), until the program has finished."""
        self.interruptible(self._sync)

    def _sync(self) -> None:
        self._flush()
        if self._outside():
            self._wait_outside(lambda: False)
            return
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    def _outside(self) -> bool:
        """Called from a thread that is not the program's own body? (Its body may not have
        queued the Nodes yet, so "nothing pending" does not mean "done".)"""
        return self._has_body and threading.current_thread() is not self._body_thread

    @property
    def held(self) -> bool:
        """Its step controller holds it now (what exists is all there is until a step)."""
        return self.debug is not None and self.debug.waiting_at is not None

    @property
    def finished(self) -> bool:
        """Its Return ran: everything it queued has run (`wait()` blocks for this)."""
        return self._finished

    def snapshot(self) -> ProgramSnapshot:
        """The run as it is now, without waiting (sgl_nb/language/snapshot.py)."""
        with self._cond:
            text, vars_, meta = self._text, dict(self._vars), dict(self._meta)
            messages = tuple(dict(m) for m in self._messages)
            error, error_line, finished = self._error, self._error_line, self._finished
        with self._lock:
            nodes = tuple(self.nodes)
        tokens = {k: tuple(v) for k, v in list(self._tokens.items())}
        forks = {k: tuple(c.snapshot() for c in v) for k, v in list(self._forked.items())}
        status = (Status.CANCELLED if self._cancelled else Status.ERROR if error is not None
                  else Status.DONE if finished or self.parent is not None else Status.RUNNING)
        return ProgramSnapshot(
            self.id, getattr(self, "function", None),
            self.parent.id if self.parent is not None else None, text,
            MappingProxyType(vars_), MappingProxyType(meta), messages, nodes,
            MappingProxyType(tokens), MappingProxyType(forks), status, error, error_line,
            finished, self.held, MappingProxyType(self.call.attrs() if self.call else {}))

    def _wait_outside(self, ready) -> None:
        """Until ready(), the program ends, or a step controller holds it (what exists then
        is all there is until someone steps: waiting longer would hang a notebook cell)."""
        with self._cond:
            while not (ready() or self._finished or self.held):
                self._cond.wait(0.05)

    def __getitem__(self, name: str):
        return self.interruptible(lambda: self._get(name))

    def _get(self, name: str):
        self._flush()
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
        self.emit(VariableSet, name=name, value=repr(value))  # no Node's event says it

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
        """What the gen or select bound to `name` reported ({} for another name)."""
        self.sync()
        return self._meta.get(name, {})

    def error(self) -> BaseException | None:
        self.sync()
        return self._error

    def graph(self) -> str:
        """The Nodes this program ran, each with the Instructions it ran (Init ... Return)."""
        self.sync()
        return listing(self.nodes)

    listing = graph

    def token_info(self, var: str, i: int, branch: int | None = None) -> TokenInfo:
        """Why token i of `var` was chosen: its alternatives, mask, Node, line, cache hit."""
        self.sync()
        return token_info(self.snapshot(), var, i, branch)

    def rerun(self, at, value=MISSING, *, stream: bool = False, backend=None,
              debug: bool = False, **sampling) -> ProgramState:
        """Run this program again from Node `at` (a Node of `nodes`, a node id, or the
        variable a gen or select binds) with an edit: `value` replaces its output (a gen's
        text, a select's choice, a text), or sampling arguments (temperature, max_tokens,
        seed, regex, ...) generate a gen again with them. The program's Python runs again
        from its start, side effects included; before `at` every Node's recorded output is
        replayed (no decoding; the radix cache serves the prompt), from `at` on it runs
        live, as it does from the first Node where the Python leaves the record. Returns the
        new state (at once with stream=True; debug=True: under a step controller, not held);
        `rerun_report` says what was replayed."""
        return rerun_state(self, at, value, stream=stream, backend=backend, debug=debug,
                           **sampling)

    def dot(self) -> str:
        """The graph this program ran, as Graphviz DOT."""
        self.sync()
        return dot(f"program {self.id}", self.nodes)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is produced (only variable `var_name`'s, if given), until the end.
        An interrupt while it waits cancels the program."""
        for chunk, _ in self._chunks(var_name):
            yield chunk

    def _chunks(self, var_name: str | None) -> Iterator[tuple[str, dict | None]]:
        """(text, meta) as produced; meta: a decoded chunk's token counts and logprobs."""
        self._flush()
        i = 0
        while True:
            with self._cond:
                self.interruptible(lambda i=i: self._cond.wait_for(
                    lambda: len(self._stream) > i or self._finished))
                items, done = self._stream[i:], self._finished and len(self._stream) <= i
            if done:
                return
            i += len(items)
            for var, chunk, meta in items:
                if var_name is None or var == var_name:
                    yield chunk, meta

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False):
        """text_iter for asyncio. With `var_name` and return_meta_data=True, (text, meta)
        pairs, as SGLang streams them: meta's completion_tokens counts the variable's
        tokens so far, and with return_logprob its output_token_logprobs are this chunk's
        tokens' (output_token_logprobs_length: all so far)."""
        import asyncio

        with_meta = return_meta_data and var_name is not None
        it = self._chunks(var_name)
        while True:
            item = await asyncio.to_thread(next, it, None)
            if item is None:
                return
            chunk, meta = item
            if with_meta:
                yield chunk, meta if meta is not None else dict(self._meta.get(var_name, {}))
            else:
                yield chunk

    def _finish(self, error: BaseException | None = None, frame_file: str | None = None):
        """The body has returned (or raised `error`): what it queued runs, then Return."""
        if self.parent is not None:
            self._flush()
            return
        self._record(ReturnNode(program=self.id, preds=self._preds()), (error, frame_file))

    def _set_error(self, error: BaseException, file: str | None = None) -> None:
        tb = traceback.extract_tb(error.__traceback__)
        lines = [f.lineno for f in tb if file is None or f.filename == file]
        self._error_line = lines[-1] if lines else None
        self._error = error

    @property
    def error_line(self) -> int | None:
        return self._error_line

    def _end_status(self) -> Status:
        return Status.CANCELLED if self._cancelled else Status.ERROR if self._error \
            else Status.DONE

    def _emit_finished(self) -> None:
        self.emit(ProgramFinished, status=self._end_status(), line=self._error_line,
                  error=repr(self._error) if self._error else None)

    def __repr__(self) -> str:
        return f"ProgramState(id={self.id}, text={self._text[-60:]!r})"

    def _append(self, text: str, var: str | None = None, meta: dict | None = None) -> None:
        with self._cond:
            self._text += text
            self._stream.append((var, text, meta))
            self._cond.notify_all()


def _fork_size(size, position_ids_offset) -> int:
    """fork()'s arguments checked: a size of 0 or more, and SGLang's list of offsets."""
    if isinstance(size, bool):
        raise TypeError(f"fork size must be an integer, got {size!r}")
    try:
        n = operator.index(size)
    except TypeError:
        raise TypeError(f"fork size must be an integer, got {size!r}") from None
    if n < 0:
        raise ValueError(f"fork size must be >= 0, got {n}")
    offsets = position_ids_offset
    if offsets is not None and (not isinstance(offsets, list | tuple) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in offsets)):
        raise TypeError(f"position_ids_offset must be None or a list of integers, got "
                        f"{offsets!r}")
    return n


class ForkGroup:
    """The branches of `s.fork(n)`: `forks[i] += ...`, `forks += lambda i: ...`, `join()`."""

    def __init__(self, parent: ProgramState, states: list[ProgramState], node: Node):
        self.parent, self.states, self.node = parent, states, node

    @property
    def src_state(self) -> ProgramState:
        """SGLang's name for the state that forked."""
        return self.parent

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
        """`forks += expr` (each branch), `forks += lambda i: ...` or `forks += [e0, e1]`
        (one expression a branch, as SGLang takes a list or tuple)."""
        frame = sys._getframe(1)
        if isinstance(other, list | tuple) and len(other) != len(self.states):
            raise ValueError(f"forks += a list of {len(other)} expressions: there are "
                             f"{len(self.states)} branches")
        for i, s in enumerate(self.states):
            expr = other(i) if callable(other) else \
                other[i] if isinstance(other, list | tuple) else other
            s._submit(expr, frame)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for the branches. gather_variable: each variable a branch has that the
        parent does not becomes a list on the parent (one value per branch that has it);
        concate_and_append: the branches' new text is appended to the parent's, in order
        (no variable is gathered). As SGLang joins."""
        self._join(mode, sys._getframe(1))

    def _join(self, mode: str, caller) -> None:
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(
                f"join mode must be gather_variable or concate_and_append, got {mode!r}"
            )
        for s in self.states:
            s._flush()  # every branch Node is queued before the Join that waits for them
        p = self.parent
        preds = [s.nodes[-1].id for s in self.states if s.nodes] or [self.node.id]
        node = JoinNode(program=p.id, preds=preds, mode=mode,
                        branches=tuple(s.id for s in self.states),
                        file=caller.f_code.co_filename, line=caller.f_lineno)
        p._record(node)
        try:
            p._wait_node(node)
        except ProgramError as e:
            if isinstance(e, ProgramCancelled):
                raise
            raise p._error from None  # a branch's own error, at its line
