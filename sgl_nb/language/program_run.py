"""ProgramRun: one program's run as data, in one object.

The façade (ProgramState, sgl_nb/language/state.py) reads it for the program's Python, the
executor's side (sgl_nb/language/effects.py) changes it, and readers elsewhere take a
ProgramSnapshot of it. The executor changes the text and the variables on its own thread;
`cond` guards what the program's Python waits on (the text, the variables, the end)."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterator
from types import MappingProxyType

from sgl_nb.language.rerun_strategy import LIVE, LiveRun, Rerun
from sgl_nb.language.snapshot import ProgramSnapshot
from sgl_nb.runtime.compiler.ir import Node
from sgl_nb.runtime.compiler.step_controller import StepController
from sgl_nb.runtime.status import Status


class ProgramRun:
    def __init__(self, id: int, parent: ProgramRun | None = None,
                 stepper: StepController | None = None, strategy: LiveRun | Rerun = LIVE):
        self.id = id
        self.function: str | None = None
        self.parent = parent
        self.stepper = stepper  # the step controller, when it runs under the debugger
        self.strategy = strategy  # live, or a re-run's (rerun_strategy.py)
        self.call = None  # the ProgramCall that started it (function.py)
        self.text = "" if parent is None else parent.text
        self.fork_point = len(self.text)  # where a branch's own text starts
        # How much of the text the engine is known to have computed.
        self.kv_len = 0 if parent is None else parent.kv_len
        # As SGLang forks: a branch starts with the variables, messages and open turn so far.
        self.vars: dict = {} if parent is None else dict(parent.vars)
        self.meta: dict = {}
        self.messages: list[dict] = [] if parent is None else [dict(m) for m in parent.messages]
        self.role_start: int | None = None if parent is None else parent.role_start
        # The role a turn has open (not yet ended).
        self.open_role: str | None = None if parent is None else parent.open_role
        self.scopes: dict[str, int] = {}
        self.error: BaseException | None = None
        self.error_line: int | None = None
        self.cancelled = False
        self.finished = False  # its Return ran
        self.ended = threading.Event()  # ... and what waits on its end has run
        self.end_tasks: list[Callable[[], None]] = []
        self.inflight: set = set()  # engine requests running for it now
        self.nodes: list[Node] = []  # handed to the executor, in order
        self.nodes_by_id: dict[int, Node] = {}
        self.payloads: dict[int, object] = {}  # node id -> the expression it came from
        self.node_start: dict[int, int] = {}  # node id -> where its text starts
        self.scores: dict[int, dict] = {}  # select node id -> the scores of its choices
        self.tokens: dict[int, list] = {}  # gen node id -> its TokenChoices, in order
        self.forked: dict[int, list] = {}  # fork node id -> its branches (ProgramStates)
        self.children: list = []  # every fork branch, cancelled with it
        # (variable, text, meta) as it is produced; meta: a decoded chunk's tokens so far
        self.stream: list[tuple[str | None, str, dict | None]] = []
        self.pending = 0  # Nodes handed to the executor that have not ended
        self.speculated = ""  # what of a speculated answer the program has not taken yet
        self.lock = threading.RLock()  # the program and a reader may both flush
        self.cond = threading.Condition()

    def append(self, text: str, var: str | None = None, meta: dict | None = None) -> None:
        with self.cond:
            self.text += text
            self.stream.append((var, text, meta))
            self.cond.notify_all()

    def chunks(self, var_name: str | None, wait: Callable) -> Iterator[tuple[str, dict | None]]:
        """(text, meta) as produced (only variable `var_name`'s, if given), until the end;
        meta: a decoded chunk's token counts and logprobs. `wait(fn)` runs each blocking
        wait (the façade's interruptible)."""
        i = 0
        while True:
            with self.cond:
                wait(lambda i=i: self.cond.wait_for(lambda: len(self.stream) > i or self.finished))
                items, done = self.stream[i:], self.finished and len(self.stream) <= i
            if done:
                return
            i += len(items)
            for var, chunk, meta in items:
                if var_name is None or var == var_name:
                    yield chunk, meta

    def bind(self, name: str, value) -> None:
        with self.cond:
            self.vars[name] = value
            self.cond.notify_all()

    def set_error(self, error: BaseException, file: str | None = None) -> None:
        """The program's error, at the last line of `file` its traceback passes."""
        tb = traceback.extract_tb(error.__traceback__)
        lines = [f.lineno for f in tb if file is None or f.filename == file]
        self.error_line = lines[-1] if lines else None
        self.error = error

    def end_status(self) -> Status:
        return Status.CANCELLED if self.cancelled else Status.ERROR if self.error \
            else Status.DONE

    def end(self) -> None:
        """Its Return ran: readers wake, then what waits on its end runs (off the
        executor's thread: writing a trace file must not hold other programs up)."""
        with self.cond:
            self.finished = True
            tasks, self.end_tasks = self.end_tasks, []
            self.cond.notify_all()
        if not tasks:
            self.ended.set()
            return
        threading.Thread(target=self._run_end_tasks, args=(tasks,), name="sgl-program-end",
                         daemon=True).start()

    def _run_end_tasks(self, tasks: list[Callable[[], None]]) -> None:
        try:
            for task in tasks:
                task()
        finally:
            self.ended.set()

    def on_end(self, task: Callable[[], None]) -> None:
        """Run `task` once the program has ended (at once if it has)."""
        with self.cond:
            if not self.finished:
                self.end_tasks.append(task)
                return
        self.ended.wait()  # a task queued before this one runs first
        task()

    @property
    def held(self) -> bool:
        return self.stepper is not None and self.stepper.waiting_at is not None

    def snapshot(self) -> ProgramSnapshot:
        with self.cond:
            text, vars_, meta = self.text, dict(self.vars), dict(self.meta)
            messages = tuple(dict(m) for m in self.messages)
            error, error_line, finished = self.error, self.error_line, self.finished
        with self.lock:
            nodes = tuple(self.nodes)
        tokens = {k: tuple(v) for k, v in list(self.tokens.items())}
        forks = {k: tuple(c.snapshot() for c in v) for k, v in list(self.forked.items())}
        call = self.call.attrs() if self.call is not None else {}
        status = (Status.CANCELLED if self.cancelled else Status.ERROR if error is not None
                  else Status.DONE if finished or self.parent is not None else Status.RUNNING)
        return ProgramSnapshot(
            self.id, self.function, self.parent.id if self.parent is not None else None, text,
            MappingProxyType(vars_), MappingProxyType(meta), messages, nodes,
            MappingProxyType(tokens), MappingProxyType(forks), status, error, error_line,
            finished, self.held, MappingProxyType(call))
