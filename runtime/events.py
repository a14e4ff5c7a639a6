"""The one stream of runtime events that tracing and the views consume: one frozen
dataclass per kind, handled by one `match` per consumer (tracing/spans.py,
tracing/timeline.py). tracing/codec.py alone turns them into a trace's fields and back.

Publishing never blocks the engine: each subscriber gets its own unbounded queue (lossless;
a view that falls behind coalesces on its side), or a callback that must return at once.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, ClassVar

# The kinds and statuses the events carry: tracing/ imports them from here (it imports
# runtime's event types only).
from sgl_nb.runtime.compiler.instructions import Op
from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.runtime.compiler.step_controller import Hold
from sgl_nb.runtime.status import Status


class EventKind(StrEnum):
    PROGRAM_STARTED = "program_started"
    PROGRAM_FINISHED = "program_finished"
    NODE_QUEUED = "node_queued"
    NODE_STARTED = "node_started"
    NODE_FINISHED = "node_finished"
    VARIABLE_SET = "variable_set"
    INSTRUCTION_STARTED = "instruction_started"
    INSTRUCTION_FINISHED = "instruction_finished"
    TOKEN = "token"
    CACHE_HIT = "cache_hit"
    CACHE_INSERT = "cache_insert"
    CACHE_EVICT = "cache_evict"
    CACHE_NODE_ADDED = "cache_node_added"
    CACHE_NODE_SPLIT = "cache_node_split"
    CACHE_NODES_HIT = "cache_nodes_hit"
    CACHE_NODE_LOCKED = "cache_node_locked"
    CACHE_NODES_EVICTED = "cache_nodes_evicted"
    FORK = "fork"
    JOIN = "join"
    PAUSED = "paused"
    RESUMED = "resumed"
    PREEMPTED = "preempted"
    RETRACTED = "retracted"
    ERROR = "error"


_EVENT = {"frozen": True, "kw_only": True, "slots": True}


@dataclass(**_EVENT)
class Event:
    """What every event has: ids where they apply, a time and its place in the stream."""

    kind: ClassVar[EventKind]
    program: int | None = None  # program state id
    node: int | None = None
    request: int | None = None  # engine request id
    ts: int = field(default_factory=time.monotonic_ns)
    seq: int = 0  # set by the bus: the order events were published in


@dataclass(**_EVENT)
class ProgramStarted(Event):
    """A program (or a fork branch: `node` is its parent's Fork) starts."""

    kind: ClassVar[EventKind] = EventKind.PROGRAM_STARTED
    function: str | None = None
    priority: str | None = None
    model: str | None = None
    parent: int | None = None  # a fork branch's parent program
    # The call, for a re-run from a trace (sgl_nb/language/rerun.py): where the function
    # is, its arguments and run options as JSON (args None: not JSON values).
    module: str | None = None
    qualname: str | None = None
    args: str | None = None
    options: str | None = None


@dataclass(**_EVENT)
class ProgramFinished(Event):
    kind: ClassVar[EventKind] = EventKind.PROGRAM_FINISHED
    status: Status | None = None  # DONE | ERROR | CANCELLED (None: ERROR if error, else DONE)
    error: str | None = None  # repr of the error
    line: int | None = None  # the program line of the error


@dataclass(**_EVENT)
class NodeQueued(Event):
    """A Node the program recorded, handed to the executor: it waits for the Nodes before
    it (its program's Python runs ahead of them). What a view lists of a Node not started."""

    kind: ClassVar[EventKind] = EventKind.NODE_QUEUED
    node_kind: NodeKind | None = None
    name: str | None = None
    line: int | None = None
    file: str | None = None
    label: str | None = None
    preds: tuple[int, ...] = ()
    stack: tuple[str, ...] = ()
    stack_args: tuple[str, ...] = ()  # as NodeStarted's
    ops: tuple[Op, ...] = ()  # the kinds of its Instructions, in order


@dataclass(**_EVENT)
class NodeStarted(Event):
    kind: ClassVar[EventKind] = EventKind.NODE_STARTED
    node_kind: NodeKind | None = None
    name: str | None = None
    line: int | None = None
    file: str | None = None
    label: str | None = None
    preds: tuple[int, ...] = ()
    stack: tuple[str, ...] = ()  # the call stack: function names, outermost first
    # Each frame's arguments as text ("topic='x', n=2"), parallel to `stack` ("": not
    # known): what a call-stack view shows beside the names.
    stack_args: tuple[str, ...] = ()
    params: str | None = None  # a Gen's or Select's, as JSON: what a re-run compares


@dataclass(**_EVENT)
class NodeFinished(Event):
    kind: ClassVar[EventKind] = EventKind.NODE_FINISHED
    status: Status = Status.DONE  # DONE | ERROR | SKIPPED | CANCELLED
    text: str | None = None  # what the Node added to the program's text
    value: str | None = None  # repr of the variable it bound, if any
    # The meta of that variable (a gen's finish reason and token counts, a select's
    # choices and scores) as JSON, its per-token logprob lists left out.
    meta: str | None = None


@dataclass(**_EVENT)
class VariableSet(Event):
    """The program's own code bound a variable (`s[name] = value`): no Node says so."""

    kind: ClassVar[EventKind] = EventKind.VARIABLE_SET
    name: str = ""
    value: str | None = None  # its repr


@dataclass(**_EVENT)
class InstructionStarted(Event):
    """Decode and Score run on the engine and carry their request."""

    kind: ClassVar[EventKind] = EventKind.INSTRUCTION_STARTED
    op: Op = Op.EXTEND
    index: int = 0  # its place among its Node's Instructions


@dataclass(**_EVENT)
class InstructionFinished(Event):
    kind: ClassVar[EventKind] = EventKind.INSTRUCTION_FINISHED
    op: Op = Op.EXTEND
    index: int = 0
    status: Status = Status.DONE  # DONE | ERROR | CANCELLED
    error: str | None = None
    # What its request reported: input_tokens, cached_tokens, new_tokens (prompt tokens
    # computed), output_tokens, batch_size (its largest decode batch), preempted (times
    # suspended or retracted), finish_reason (stop | length | abort | error | score); a
    # server's name; a re-run's replayed / edited.
    usage: Mapping[str, Any] = field(default_factory=dict)


@dataclass(**_EVENT)
class Token(Event):
    kind: ClassVar[EventKind] = EventKind.TOKEN
    token: int | None = None  # its id (None: a server that sends text only)
    text: str = ""  # its characters
    logprob: float | None = None  # after the grammar mask
    # The grammar allowed only this token, or it is a jump-forward draft of forced text.
    forced: bool = False
    # A prompt-lookup draft (runtime/prompt_lookup.py) the model's own pick agreed with:
    # computed in the extend step of the token before it.
    drafted: bool = False
    step: int | None = None  # the scheduler's step counter: batches scheduled so far
    allowed: int = -1  # tokens the grammar left at that step (-1: no grammar)
    # With EngineConfig.token_alternatives: the step's most likely tokens before the mask,
    # (id, text, logprob, masked) each (runtime/token_choice.py).
    top: Sequence[Sequence] = ()


@dataclass(**_EVENT)
class CacheHit(Event):
    kind: ClassVar[EventKind] = EventKind.CACHE_HIT
    cached_tokens: int = 0
    prompt_tokens: int = 0


@dataclass(**_EVENT)
class CacheInsert(Event):
    kind: ClassVar[EventKind] = EventKind.CACHE_INSERT
    tokens: int = 0  # newly added to the radix tree
    total: int | None = None  # the request's tokens the tree holds now


@dataclass(**_EVENT)
class CacheEvict(Event):
    kind: ClassVar[EventKind] = EventKind.CACHE_EVICT
    tokens: int = 0  # freed


# The radix tree's own changes (runtime/radix_cache.py publishes them; the events above are
# a request's view of the cache): enough to rebuild the tree's shape, edges, hit counts and
# locks from the stream alone (tracing/cache_tree.py). `tree_node` ids are the tree's, not
# a program's Nodes; these events belong to no program.


@dataclass(**_EVENT)
class CacheNodeAdded(Event):
    """A node of the tree: a new leaf, or (from RadixCache.snapshot) one that was there
    before the listener came."""

    kind: ClassVar[EventKind] = EventKind.CACHE_NODE_ADDED
    tree_node: int = 0
    parent: int | None = None  # None: a child of the root
    key: tuple[int, ...] = ()  # its edge's token ids
    text: str | None = None  # the edge decoded (None: the cache has no decoder)
    hits: int = 0
    lock_ref: int = 0


@dataclass(**_EVENT)
class CacheNodeSplit(Event):
    """`tree_node`'s edge was cut after `cut` tokens: a new node `upper` takes the first
    part and becomes its parent; `tree_node` keeps the rest."""

    kind: ClassVar[EventKind] = EventKind.CACHE_NODE_SPLIT
    tree_node: int = 0
    cut: int = 0  # (not `at`: a trace reads that name as a Hold)
    upper: int = 0
    text: str | None = None  # upper's edge decoded
    rest_text: str | None = None  # tree_node's edge decoded, after the cut


@dataclass(**_EVENT)
class CacheNodesHit(Event):
    """A lookup: the nodes its match ran through (root's child first), each hit once."""

    kind: ClassVar[EventKind] = EventKind.CACHE_NODES_HIT
    tree_nodes: tuple[int, ...] = ()
    queried: int = 0  # tokens looked up
    matched: int = 0  # of them found


@dataclass(**_EVENT)
class CacheNodeLocked(Event):
    """A lock taken (+1) or released (-1) on `tree_node`; it holds its ancestors too."""

    kind: ClassVar[EventKind] = EventKind.CACHE_NODE_LOCKED
    tree_node: int = 0
    delta: int = 1


@dataclass(**_EVENT)
class CacheNodesEvicted(Event):
    kind: ClassVar[EventKind] = EventKind.CACHE_NODES_EVICTED
    tree_nodes: tuple[int, ...] = ()
    tokens: int = 0  # freed
    reset: bool = False  # the cache was reset: its statistics start again from zero


@dataclass(**_EVENT)
class Forked(Event):
    """`program` forked into `children` at its Fork Node."""

    kind: ClassVar[EventKind] = EventKind.FORK
    n: int = 0
    children: tuple[int, ...] = ()


@dataclass(**_EVENT)
class Joined(Event):
    kind: ClassVar[EventKind] = EventKind.JOIN
    mode: str | None = None
    children: tuple[int, ...] = ()


@dataclass(**_EVENT)
class Paused(Event):
    """A step controller holds the program."""

    kind: ClassVar[EventKind] = EventKind.PAUSED
    at: Hold | None = None
    reason: str | None = None


@dataclass(**_EVENT)
class Resumed(Event):
    """A held program goes on; or (reason "scheduler") a preempted request resumes."""

    kind: ClassVar[EventKind] = EventKind.RESUMED
    at: Hold | None = None
    reason: str | None = None


@dataclass(**_EVENT)
class Preempted(Event):
    """A running decode suspended, its KV kept."""

    kind: ClassVar[EventKind] = EventKind.PREEMPTED
    reason: str | None = None
    priority: str | None = None


@dataclass(**_EVENT)
class Retracted(Event):
    """A request stopped under memory pressure: its tokens stay in the radix tree as
    evictable cache, and it is re-admitted later."""

    kind: ClassVar[EventKind] = EventKind.RETRACTED
    reason: str | None = None


@dataclass(**_EVENT)
class Failed(Event):
    """A Node failed."""

    kind: ClassVar[EventKind] = EventKind.ERROR
    error: str | None = None  # repr
    line: int | None = None


def stack_args(stack: Sequence[str], frames: Sequence[Mapping]) -> tuple[str, ...]:
    """NodeStarted.stack_args: the arguments of each frame of `stack` as text, from the
    program's live frames ({"function", "args"}, outermost first) where the frame at that
    depth is the same function; "" where it is not (the body has returned from it)."""
    out = []
    for depth, name in enumerate(stack):
        frame = frames[depth] if depth < len(frames) else None
        args = (frame.get("args") or {}) if frame and frame.get("function") == name else {}
        out.append(", ".join(f"{k}={v!r}" for k, v in args.items()))
    return tuple(out)


def meta_json(meta: Mapping | None) -> str | None:
    """NodeFinished.meta: a variable's meta as JSON, without its per-token lists (logprobs
    of each prompt or output token: a trace keeps the tokens themselves)."""
    if not meta:
        return None
    kept = {k: v for k, v in meta.items()
            if not (isinstance(v, list | tuple) and any(isinstance(x, list | tuple) for x in v))}
    return json.dumps(kept, default=repr, sort_keys=True)


CACHE_EVENTS = (CacheHit, CacheInsert, CacheEvict)  # changes of the radix cache
# The tree's own changes: shared by every program, so every view's fold takes them.
TREE_EVENTS = (CacheNodeAdded, CacheNodeSplit, CacheNodesHit, CacheNodeLocked,
               CacheNodesEvicted)
EVENT_TYPES: dict[EventKind, type[Event]] = {
    cls.kind: cls for cls in (
        ProgramStarted, ProgramFinished, NodeQueued, NodeStarted, NodeFinished, VariableSet,
        InstructionStarted, InstructionFinished, Token, CacheHit, CacheInsert, CacheEvict,
        *TREE_EVENTS, Forked, Joined, Paused, Resumed, Preempted, Retracted, Failed)
}


class EventBus:
    def __init__(self):
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._queues: list[queue.SimpleQueue] = []
        self._callbacks: list[Callable[[Event], None]] = []
        self.counts: Counter[EventKind] = Counter()  # emitted by kind, listened to or not

    def subscribe(self, callback: Callable[[Event], None] | None = None):
        """A queue of every event from now on; or, with a callback, call it for each one."""
        with self._lock:
            if callback is not None:
                self._callbacks.append(callback)
                return callback
            q: queue.SimpleQueue = queue.SimpleQueue()
            self._queues.append(q)
            return q

    def unsubscribe(self, handle) -> None:
        with self._lock:
            for group in (self._queues, self._callbacks):
                if handle in group:
                    group.remove(handle)

    def publish(self, event: Event) -> None:
        """Send a copy of `event` numbered by this bus."""
        with self._lock:
            event = replace(event, seq=next(self._seq))
            queues, callbacks = list(self._queues), list(self._callbacks)
        _send(event, queues, callbacks)

    @property
    def listeners(self) -> int:
        """How many subscribers (queues and callbacks) it has now."""
        with self._lock:
            return len(self._queues) + len(self._callbacks)

    @property
    def active(self) -> bool:
        """Anyone listening? (Skip building costly event data when not.)"""
        return bool(self._queues or self._callbacks)

    def emit(self, cls: type[Event], **fields) -> None:
        """A `cls` event with these fields, built only when someone listens."""
        self.counts[cls.kind] += 1
        if self._queues or self._callbacks:
            with self._lock:
                event = cls(seq=next(self._seq), **fields)
                queues, callbacks = list(self._queues), list(self._callbacks)
            _send(event, queues, callbacks)


def _send(event: Event, queues: list, callbacks: list) -> None:
    for q in queues:
        q.put(event)
    for cb in callbacks:
        cb(event)

