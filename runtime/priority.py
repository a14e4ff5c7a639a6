"""Priority levels: which work the scheduler serves first, and how waiting work ages."""

from __future__ import annotations

# Lower number = served first. A notebook cell someone is watching outranks a batch job.
PRIORITIES = {"interactive": 0, "normal": 1, "batch": 2}
PRIORITY_NAMES = {v: k for k, v in PRIORITIES.items()}


def parse_priority(priority: str | int | None, default: str = "normal") -> int:
    """The level of a priority name; raises ValueError naming the known levels."""
    if priority is None:
        priority = default
    if isinstance(priority, int) and priority in PRIORITY_NAMES:
        return priority
    if isinstance(priority, str) and priority in PRIORITIES:
        return PRIORITIES[priority]
    raise ValueError(
        f"unknown priority {priority!r}: use one of {', '.join(map(repr, PRIORITIES))}"
    )


def priority_name(level: int) -> str:
    return PRIORITY_NAMES[level]
