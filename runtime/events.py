"""The one stream of runtime events that tracing and the views consume.

Publishing never blocks the engine: each subscriber gets its own unbounded queue (lossless;
a view that falls behind coalesces on its side), or a callback that must return at once.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

EVENT_KINDS = (
    "program_started", "program_finished", "node_started", "node_finished",
    "instruction_started", "instruction_finished", "token", "cache_hit", "cache_insert",
    "cache_evict", "fork", "join", "paused", "resumed", "preempted", "retracted", "error",
)

# What each kind carries (the contract tracing/ and the views build on). Every event has
# kind, ts (time.monotonic_ns), seq (publication order); program / node / request ids where
# they apply. `data` keys:
#   program_started   function, priority, model, parent (program id of a fork parent or None)
#   program_finished  error (repr or None), line (the program line of the error, or None),
#                     status (done | error | cancelled)
#   node_started      kind, name, line, file, label, preds (node ids), stack (call stack:
#                     function names, outermost first)
#   node_finished     status (done | error | skipped | cancelled), text (what the node added to the
#                     program's text), value (repr of the variable it bound, if any)
#   instruction_started / instruction_finished
#                     kind (Extend | Decode | Score | Fork | Join | Return), index (0-based
#                     within the node); Decode and Score run on the engine and also carry
#                     request. Finished Decode/Score add: input_tokens, cached_tokens,
#                     new_tokens (prompt tokens computed), output_tokens, batch_size (largest
#                     decode batch it ran in), preempted (times suspended or retracted),
#                     finish_reason (stop | length | abort | error | score).
#   token             token (id), text (its characters, may be ""), logprob, forced (True
#                     when the grammar allowed only this token, or it is a jump-forward
#                     draft of the grammar's forced text), step (the scheduler's step
#                     counter: batches scheduled so far), allowed (tokens the grammar
#                     left at that step, -1 without one), top (when the engine records
#                     alternatives, EngineConfig.token_alternatives: [[id, text, logprob,
#                     masked], ...], the step's k most likely tokens before the grammar
#                     mask, masked = ruled out by it; these logprobs are taken before the
#                     mask, "logprob" above after it: runtime/token_choice.py);
#                     program/node/request set
#   cache_hit         cached_tokens, prompt_tokens           (request, program, node)
#   cache_insert      tokens (newly added to the radix tree) (request, program, node)
#   cache_evict       tokens (freed)
#   fork              n, children (program ids)              (program = the parent)
#   join              mode, children
#   paused / resumed  the step controller held / released a program: at ("node" | "decode")
#                     resumed is also sent when the scheduler resumes a preempted request
#                     (data reason="scheduler")
#   preempted         reason, priority: a running decode suspended, KV kept (request, ...)
#   retracted         reason: a request stopped under memory pressure; its tokens stay in
#                     the radix tree as evictable cache and it is re-admitted later
#   error             error (repr), line


@dataclass
class Event:
    kind: str
    program: int | None = None  # program state id
    node: int | None = None
    request: int | None = None  # engine request id
    data: dict = field(default_factory=dict)
    ts: int = field(default_factory=time.monotonic_ns)
    seq: int = 0  # set by the bus: the order events were published in

    def __post_init__(self) -> None:
        assert self.kind in EVENT_KINDS, self.kind


class EventBus:
    def __init__(self):
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._queues: list[queue.SimpleQueue] = []
        self._callbacks: list[Callable[[Event], None]] = []
        self.counts: Counter[str] = Counter()  # events emitted by kind, listened to or not

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
        with self._lock:
            event.seq = next(self._seq)
            queues, callbacks = list(self._queues), list(self._callbacks)
        for q in queues:
            q.put(event)
        for cb in callbacks:
            cb(event)

    @property
    def active(self) -> bool:
        """Anyone listening? (Skip building costly event data when not.)"""
        return bool(self._queues or self._callbacks)

    def emit(self, kind: str, **fields) -> None:
        self.counts[kind] += 1
        if self._queues or self._callbacks:
            self.publish(Event(kind, **fields))

