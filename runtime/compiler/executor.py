"""The executor: one thread that runs the Instructions of every program.

Each program (a ProgramHost: the language layer's state) hands it Nodes, already passed
through the passes and lowered (runtime/compiler/lowering.py). Per program it keeps a ready queue;
it starts a program's next Node when the one before it has ended (and, for a Join, when the
fork branches it waits for have drained), asks the step controller at that point whether the
Node may start, then starts its Instructions: Extend, Fork, Join, Return at once, Decode,
Score and a shared Extend as engine requests that carry their Instruction. Every Instruction
starts, finishes and emits its events here. What an Instruction does to its program (text,
variables, roles, the choice of a Select) is the host's business (`start`).

Invariant: everything below runs on the executor thread, except `post`, `add`, `wake` and
`cancel`, which only enqueue. So a program's state changes in one thread, in order, and no
program costs a thread; a program's Python body runs elsewhere (sgl_nb/language/body_pool.py) and
blocks only where it reads a generated value.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from sgl_nb.runtime.compiler.instructions import Cancelled, Instruction, Op
from sgl_nb.runtime.compiler.ir import PROGRAM_NODES, InitNode, JoinNode, Node
from sgl_nb.runtime.compiler.step_controller import StepController
from sgl_nb.runtime.events import (
    Event,
    InstructionFinished,
    InstructionStarted,
    NodeQueued,
    stack_args,
)
from sgl_nb.runtime.status import Status

log = logging.getLogger("sgl_nb.executor")

# Called by a host when an Instruction it started has ended: the error (None: done) and,
# for engine work, the request's figures for the instruction_finished event.
Done = Callable[[BaseException | None, dict | None], None]


class ProgramHost(Protocol):
    id: int
    stepper: StepController | None  # asked before each Node (None: the program is not stepped)
    # The program body's live frames ({"function", "args"}, outermost first): a queued
    # Node's event names the arguments of the calls it was recorded in.
    call_stack: list[dict]

    def emit(self, cls: type[Event], **fields) -> None:
        """Publish a `cls` event of this program (runtime/events.py)."""
        ...

    def listening(self) -> bool:
        """Anyone subscribed to this program's events (else costly fields are skipped)."""
        ...

    def node_started(self, node: Node) -> bool:
        """Called as the Node is about to start: whether its Instructions run (not when it
        is skipped or cancelled)."""
        ...

    def start(self, ins: Instruction, done: Done) -> int | None:
        """Start one Instruction; return the engine request that runs it, if any. `done`
        is called once, from any thread, when it has ended."""
        ...

    def start_scores(self, group: list, dones: list[Done]) -> list[int | None]:
        """Start a Select's Score Instructions together; their requests, in order."""
        ...

    def node_finished(self, node: Node, error: BaseException | None) -> None: ...


@dataclass
class _Track:
    host: ProgramHost
    queue: deque = field(default_factory=deque)  # Nodes not started yet
    node: Node | None = None  # the Node running now
    todo: deque = field(default_factory=deque)  # its Instructions not started yet
    running: set = field(default_factory=set)  # its Instructions in flight
    error: BaseException | None = None  # the running Node's first failure

    @property
    def idle(self) -> bool:
        return self.node is None and not self.queue


class Executor:
    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracks: dict[int, _Track] = {}
        self._thread = threading.Thread(target=self._loop, name="sgl-nb-executor", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------

    def post(self, fn: Callable[[], None]) -> None:
        """Run fn on the executor thread, then look at what may advance."""
        self._inbox.put(fn)

    def add(self, host: ProgramHost, nodes: list[Node]) -> None:
        """Queue a program's Nodes (lowered: node.instructions set), in order. Their
        node_queued events go out from the caller's thread, while its frames are live."""
        frames = list(host.call_stack) if host.listening() else None
        for n in nodes:
            if frames is not None and n.kind not in PROGRAM_NODES:
                host.emit(NodeQueued, node=n.id, node_kind=n.kind, name=n.name, line=n.line,
                          file=n.file, label=n.label(), preds=tuple(n.preds),
                          stack=tuple(n.stack), stack_args=stack_args(n.stack, frames),
                          ops=tuple(i.op for i in n.instructions))
        self.post(lambda: self._track(host).queue.extend(nodes))

    def wake(self) -> None:
        """A step controller granted a step: held programs look again."""
        self.post(lambda: None)

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # ---- the executor thread ------------------------------------------------------------

    def _track(self, host: ProgramHost) -> _Track:
        track = self._tracks.get(host.id)
        if track is None:
            track = self._tracks[host.id] = _Track(host)
        return track

    def _loop(self) -> None:
        while True:
            fn = self._inbox.get()
            while True:
                try:
                    fn()
                except Exception:  # a bug in a host: log it, keep serving the others
                    log.exception("executor callback failed")
                try:
                    fn = self._inbox.get_nowait()
                except queue.Empty:
                    break
            for track in list(self._tracks.values()):
                try:
                    self._advance(track)
                except Exception:  # a bug: this program stalls, the others go on
                    log.exception("executor: program %s could not advance", track.host.id)

    def _advance(self, track: _Track) -> None:
        while True:
            if track.running:
                return  # one Node at a time: wait for what is in flight
            if track.todo:
                self._start_next(track)
                continue
            if track.node is not None:
                self._finish_node(track)
            if not track.queue or not self._may_start(track, track.queue[0]):
                if track.idle:
                    self._tracks.pop(track.host.id, None)  # comes back with its next Nodes
                return
            node = track.queue.popleft()
            track.node, track.error = node, None
            if track.host.node_started(node):
                track.todo.extend(node.instructions)

    def _may_start(self, track: _Track, node: Node) -> bool:
        if isinstance(node, InitNode):
            # A debugger holds at the program's first Node of its own, not here. A prefix
            # another program computes for this one: wait until it has ended, however.
            after = node.instructions[0].after
            return after is None or after.status.ended
        if isinstance(node, JoinNode):
            # Its branches' Nodes were all queued before it: it waits for them to drain.
            branches = node.instructions[0].branches if node.instructions else ()
            if any(b in self._tracks and not self._tracks[b].idle for b in branches):
                return False
        stepper = track.host.stepper
        return stepper is None or stepper.enter_node(node)

    def _start_next(self, track: _Track) -> None:
        first = track.todo.popleft()
        if first.op is not Op.SCORE:
            self._start(track, first)
            return
        # A Select's choices are scored together (one batch; one request to a server).
        group = [first]
        while (track.todo and track.todo[0].op is Op.SCORE
               and track.todo[0].unconditional == first.unconditional):
            group.append(track.todo.popleft())
        self._start_scores(track, group)

    def _start(self, track: _Track, ins: Instruction) -> None:
        host = track.host
        ins.status = Status.RUNNING
        track.running.add(ins)
        if not ins.on_engine:
            host.emit(InstructionStarted, node=ins.node, op=ins.op, index=ins.index)

        def done(error: BaseException | None, usage: dict | None = None) -> None:
            self.post(lambda: self._finish(track, ins, error, usage))

        try:
            ins.request = host.start(ins, done)
        except BaseException as e:  # noqa: BLE001 - the Instruction fails, not the executor
            done(e)
        if ins.on_engine:  # named by its request, so token events find it
            host.emit(InstructionStarted, node=ins.node, request=ins.request, op=ins.op,
                      index=ins.index)

    def _start_scores(self, track: _Track, group: list) -> None:
        for ins in group:
            ins.status = Status.RUNNING
            track.running.add(ins)

        def done_for(ins: Instruction) -> Done:
            return lambda error, usage=None: self.post(
                lambda: self._finish(track, ins, error, usage))

        dones = [done_for(ins) for ins in group]
        try:
            rids = track.host.start_scores(group, dones)
        except BaseException as e:  # noqa: BLE001 - the Select fails, not the executor
            rids = [None] * len(group)
            for done in dones:
                done(e)
        for ins, rid in zip(group, rids):
            ins.request = rid
            track.host.emit(InstructionStarted, node=ins.node, request=rid, op=ins.op,
                            index=ins.index)

    def _finish(self, track: _Track, ins: Instruction, error: BaseException | None,
                usage: dict | None) -> None:
        track.running.discard(ins)
        ins.status = _status(error)
        if error is not None and track.error is None:
            track.error = error
            track.todo.clear()  # the rest of a failed Node does not run
        ins.usage = usage or {}
        track.host.emit(InstructionFinished, node=ins.node, request=ins.request, op=ins.op,
                        index=ins.index, status=ins.status, usage=ins.usage,
                        error=None if error is None else repr(error))

    def _finish_node(self, track: _Track) -> None:
        node, error = track.node, track.error
        track.node = None
        track.host.node_finished(node, error)
        if track.host.stepper is not None:
            track.host.stepper.after_node(node)


def _status(error: BaseException | None) -> Status:
    if error is None:
        return Status.DONE
    return Status.CANCELLED if isinstance(error, Cancelled) else Status.ERROR


_executor: Executor | None = None
_lock = threading.Lock()


def get_executor() -> Executor:
    """The process's executor, started on first use."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = Executor()
        return _executor
