"""Where a program, a Node or an Instruction is in its life (and the Timeline's views of
them, which a replay rebuilds from the events)."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    PENDING = "pending"  # queued, not started
    RUNNING = "running"
    SUSPENDED = "suspended"  # a program: preempted, retracted or held by a step controller
    DONE = "done"
    ERROR = "error"
    SKIPPED = "skipped"  # a Node after its program failed: it never ran
    CANCELLED = "cancelled"  # what it produced until then is kept
    TRACED = "traced"  # a Node of a static graph (`f.trace()`): recorded, never run

    @property
    def ended(self) -> bool:
        """Done, failed, skipped or cancelled: it will not change again."""
        return self in _ENDED


_ENDED = frozenset({Status.DONE, Status.ERROR, Status.SKIPPED, Status.CANCELLED})
