"""ProgramState: the `s` of a program, a façade over its run.

The program's Python (a body thread from sgl_nb/language/body_pool.py) is the interpreter:
`s += ...` records Nodes through the state's recorder (sgl_nb/language/recorder.py). Wherever
something depends on them (a gen, a select, a fork, a read, the end) the Nodes recorded since
the last such point go through the passes, are lowered and handed to the executor, which runs
them in order on its own thread; what they do to the run (sgl_nb/language/program_run.py) is
in sgl_nb/language/effects.py. The Python goes on at once and blocks only where it reads a
generated value (`s["x"]`, `s.text()`). A static recorder (sgl_nb/language/static_graph.py)
keeps the Nodes instead, for a program's static graph."""

from __future__ import annotations

import itertools
import operator
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from sgl_nb.language.errors import ProgramCancelled, ProgramError
from sgl_nb.language.expression_nodes import ScopeMark, expression_nodes
from sgl_nb.language.expressions import Role, assistant, system, user
from sgl_nb.language.program_run import ProgramRun
from sgl_nb.language.recorder import LiveRecorder
from sgl_nb.language.rerun import rerun_state
from sgl_nb.language.rerun_cursor import MISSING
from sgl_nb.language.rerun_strategy import LIVE
from sgl_nb.language.snapshot import ProgramSnapshot
from sgl_nb.language.token_info import TokenInfo, token_info
from sgl_nb.runtime.compiler.ir import InitNode, Node, ReturnNode, dot
from sgl_nb.runtime.compiler.listing import listing
from sgl_nb.runtime.compiler.step_controller import StepController
from sgl_nb.runtime.events import VariableSet

__all__ = ["ForkGroup", "ProgramCancelled", "ProgramError", "ProgramState", "View"]

_state_ids = itertools.count(1)


_TURNS = {"system": system, "user": user, "assistant": assistant}


class View(Protocol):
    """What shows a program (a notebook widget): `state.add_view(view)` attaches it."""

    def attach(self, state: ProgramState) -> None: ...


class ProgramState:
    """The `s` a program writes to and a caller reads from. What it holds is what the
    program is (its backend, defaults, call, call stack); what its run produced is its
    ProgramRun, read here with waiting or through snapshot() without."""

    def __init__(self, backend, defaults: dict, parent: ProgramState | None = None,
                 stepper: StepController | None = None, passes: frozenset[str] = frozenset(),
                 priority: str = "normal", strategy=LIVE, recorder=None):
        self.priority = priority  # the scheduler's level for this program's requests
        self.passes = passes
        self.pass_counts: dict[str, int] = {}
        self.backend, self.defaults, self.parent = backend, defaults, parent
        self.events = backend.events if backend is not None else None
        # The run's data, which the language core changes (effects.py) and reads; readers
        # elsewhere take snapshot().
        self.run = ProgramRun(next(_state_ids), parent.run if parent is not None else None,
                              stepper, strategy)
        # Nested calls `f(s, ...)`: one frame per level, outermost first (a debugger shows it).
        self.call_stack: list[dict] = [] if parent is None else list(parent.call_stack)
        # API speculative execution (sgl_nb/language/speculation.py): tokens a gen asks for
        # at once.
        self.spec_tokens: int | None = None
        self.rerun_report = None  # a re-run's RerunReport
        self.rerun_of = None  # ... and the record of the run it repeats (a ProgramRecord)
        self.ret_value = None  # what the program's function returned (SGLang's name)
        self.views: list[View] = []  # what shows it (add_view)
        self.copy_of: ForkGroup | None = None  # `with s.copy() as c:` joins this at its end
        # Where its Nodes go (a factory of (state, run)): the executor, or a static graph.
        self.recorder = (recorder or LiveRecorder)(self, self.run)

    # ---- what it is ----------------------------------------------------------------------

    @property
    def id(self) -> int:
        return self.run.id

    @property
    def nodes(self) -> list[Node]:
        """Its Nodes as handed to the executor, in order (a Join brings its branches')."""
        return self.run.nodes

    @property
    def stepper(self) -> StepController | None:
        """The step controller, when the program runs under the debugger."""
        return self.run.stepper

    debug = stepper  # the name the stepper had first

    @property
    def call(self):
        """The ProgramCall that started it (function.py): rerun() repeats it."""
        return self.run.call

    @property
    def function(self) -> str | None:
        return self.run.function

    @property
    def fn(self):
        """The program's function (run it again: `NAME.fn.run(...)`); None for a branch."""
        return self.call.function if self.call is not None else None

    @property
    def widget(self) -> View | None:
        """The first view shown for it (a `%%sgl` cell's widget), if any."""
        return self.views[0] if self.views else None

    def add_view(self, view: View) -> None:
        """Show the program in `view` (it follows the program from now on)."""
        self.views.append(view)
        view.attach(self)

    def begin(self, function: str, shared_prefix: str = "", after=None, call=None) -> Node:
        """A program's start: its Init Node, queued ahead of anything its body records (the
        executor runs its Init Instruction, which says program_started). `call`: the
        ProgramCall. `shared_prefix`: this program also computes that text for others (a
        shared Extend after Init); `after`: such an Extend of another program, which this
        one starts after."""
        self.run.function, self.run.call = function, call
        self.recorder.has_body = True
        node = InitNode(program=self.id, function=function, shared_prefix=shared_prefix,
                        after=after, call=call.attrs() if call is not None else {})
        self.recorder.record(node)
        return node

    def body_started(self) -> None:
        """Called on the thread that runs the program's Python, before it starts."""
        self.recorder.body_thread = threading.current_thread()

    def body_ended(self, error: BaseException | None = None, file: str | None = None):
        """The body has returned (or raised `error`): what it queued runs, then Return."""
        if self.parent is not None:
            self.recorder.flush()
            return
        self.recorder.record(ReturnNode(program=self.id, preds=self.recorder.preds()),
                              (error, file))

    def branch(self, strategy) -> ProgramState:
        """A fork branch of this state, as its Fork runs (effects.py)."""
        return type(self)(self.backend, self.defaults, parent=self, stepper=self.stepper,
                          passes=self.passes, priority=self.priority, strategy=strategy)

    def emit(self, cls, **fields) -> None:
        """Publish a `cls` event of this program (runtime/events.py)."""
        if self.events is not None:
            self.events.emit(cls, program=self.id, **fields)

    # ---- the program side ----------------------------------------------------------------

    def __iadd__(self, expr) -> ProgramState:
        self.submit(expr, sys._getframe(1))
        return self

    def submit(self, expr, frame=None) -> None:
        """`s += expr`, written at `frame` (the Nodes' file and line; None: unknown)."""
        self.recorder.check_open()
        line, file = (frame.f_lineno, frame.f_code.co_filename) if frame else (None, None)
        stack = tuple(f["function"] for f in self.call_stack)
        with self.run.lock:
            for cls, fields, payload in expression_nodes(expr, self.run, self.defaults,
                                                         self.backend):
                self.recorder.record(cls(program=self.id, preds=self.recorder.preds(),
                                          file=file, line=line, stack=stack, **fields),
                                      payload)

    @contextmanager
    def _role_block(self, role: str):
        self.submit(Role(role, True), sys._getframe(2))
        try:
            yield self
        finally:
            self.submit(Role(role, False), sys._getframe(2))

    def _role_turn(self, role: str, expr, caller):
        """`with s.user():` (no expr), or SGLang's `s.user(expr)`: the whole turn added at
        once, the expression returned."""
        if expr is None:
            return self._role_block(role)
        turn = _TURNS[role](expr)
        self.submit(turn, caller)
        return turn

    def system(self, expr=None):
        return self._role_turn("system", expr, sys._getframe(1))

    def user(self, expr=None):
        return self._role_turn("user", expr, sys._getframe(1))

    def assistant(self, expr=None):
        return self._role_turn("assistant", expr, sys._getframe(1))

    @contextmanager
    def var_scope(self, name: str):
        self.submit(ScopeMark(name, True))
        try:
            yield self
        finally:
            self.submit(ScopeMark(name, False))

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
        branch.copy_of = group
        return branch

    def __enter__(self) -> ProgramState:
        if self.copy_of is None:
            raise TypeError("`with` takes a copy of a state: `with s.copy() as c:`")
        return self

    def __exit__(self, *exc) -> None:
        group, self.copy_of = self.copy_of, None
        group.join("gather_variable", sys._getframe(1))  # SGLang joins even on an error

    def _fork(self, n: int, caller) -> ForkGroup:
        node, branches = self.recorder.fork(n, caller)
        return ForkGroup(self, branches, node)

    # ---- cancelling ----------------------------------------------------------------------

    def cancel(self) -> bool:
        """Stop the program: its running Gen or Select is aborted, its pending Nodes become
        `cancelled`, its fork branches are cancelled too, and its Python stops at its next
        `s += ...` or read. The text and variables produced so far are kept; `error()` is a
        ProgramCancelled. Returns at once; False if the program had already ended."""
        run = self.run
        with run.cond:
            if run.finished or run.cancelled:
                return False
            run.cancelled = True
            if run.error is None:
                run.error = ProgramCancelled(f"program {self.id} was cancelled")
            handles = list(run.inflight)
            run.cond.notify_all()
        for child in run.children:
            child.cancel()
        for handle in handles:
            handle.cancel()
        self.backend.cancel_program(self.id)  # anything submitted and not seen yet
        if self.stepper is not None:
            self.stepper.continue_()  # a held program must not stay held: it has to end
        self.recorder.executor.wake()
        return True

    @property
    def cancelled(self) -> bool:
        return self.run.cancelled

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
        ran, or it was cancelled, and what waits on its end, such as a cell's trace file,
        has run); returns the state. TimeoutError after `timeout` s."""
        self.recorder.flush()
        if not self.interruptible(lambda: self.run.ended.wait(timeout)):
            raise TimeoutError(f"program {self.id} still running after {timeout} s")
        return self

    def on_end(self, task) -> None:
        """Run `task()` once the program has ended, before wait() returns (at once if it
        has ended)."""
        self.run.on_end(task)

    @property
    def ended(self) -> bool:
        """It has ended, and what waits on its end has run (wait() would not block)."""
        return self.run.ended.is_set()

    # ---- reading results ---------------------------------------------------------------

    def sync(self) -> None:
        """Wait until everything queued so far has run; from outside the program (a
        notebook cell reading a streamed run), until the program has finished."""
        self.interruptible(self.recorder.sync)

    @property
    def held(self) -> bool:
        """Its step controller holds it now (what exists is all there is until a step)."""
        return self.run.held

    @property
    def finished(self) -> bool:
        """Its Return ran: everything it queued has run."""
        return self.run.finished

    def snapshot(self) -> ProgramSnapshot:
        """The run as it is now, without waiting (sgl_nb/language/snapshot.py)."""
        return self.run.snapshot()

    def __getitem__(self, name: str):
        return self.interruptible(lambda: self.recorder.read(name))

    def __setitem__(self, name: str, value) -> None:
        self.run.bind(name, value)
        self.emit(VariableSet, name=name, value=repr(value))  # no Node's event says it

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.run.vars

    def get_var(self, name: str):
        """SGLang's spelling of s[name]."""
        return self[name]

    def set_var(self, name: str, value) -> None:
        """SGLang's spelling of s[name] = value."""
        self[name] = value

    def text(self) -> str:
        self.recorder.before_read("s.text()")
        return self.run.text

    def messages(self) -> list[dict]:
        self.recorder.before_read("s.messages()")
        return [dict(m) for m in self.run.messages]

    def variables(self) -> dict:
        self.recorder.before_read("s.variables()")
        return dict(self.run.vars)

    def get_meta_info(self, name: str) -> dict:
        """What the gen or select bound to `name` reported ({} for another name)."""
        self.recorder.before_read("s.get_meta_info()")
        return self.run.meta.get(name, {})

    def error(self) -> BaseException | None:
        self.sync()
        return self.run.error

    @property
    def error_line(self) -> int | None:
        return self.run.error_line

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
        self.recorder.flush()
        yield from self.run.chunks(var_name, self.interruptible)

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
                yield chunk, meta if meta is not None else dict(self.run.meta.get(var_name, {}))
            else:
                yield chunk

    def __repr__(self) -> str:
        return f"ProgramState(id={self.id}, text={self.run.text[-60:]!r})"


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
            s.submit(expr, frame)
        return self

    def join(self, mode: str = "gather_variable", caller=None) -> None:
        """Wait for the branches. gather_variable: each variable a branch has that the
        parent does not becomes a list on the parent (one value per branch that has it);
        concate_and_append: the branches' new text is appended to the parent's, in order
        (no variable is gathered). As SGLang joins. `caller`: the frame the join is written
        in (default: the caller's)."""
        caller = caller or sys._getframe(1)
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(
                f"join mode must be gather_variable or concate_and_append, got {mode!r}"
            )
        self.parent.recorder.join(self.states, self.node, mode, caller)
