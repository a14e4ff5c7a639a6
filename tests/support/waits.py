"""Waiting in tests: for a state, with a limit that only catches a hang (the rule is in
tests/conftest.py's docstring).

Every limit here is scaled by $SGL_NB_TEST_TIMEOUT_SCALE (default 1): the figures suit a
machine 3x slower than the 2-core one the suite is written on, with its CPU shared; on a
slower or busier one, SGL_NB_TEST_TIMEOUT_SCALE=3 triples them all (pytest-timeout's
per-test limit too, see tests/conftest.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SCALE_ENV = "SGL_NB_TEST_TIMEOUT_SCALE"


def scale() -> float:
    raw = os.environ.get(SCALE_ENV) or "1"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{SCALE_ENV}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{SCALE_ENV}={raw!r}: a factor > 0, such as 2")
    return value


def limit(seconds: float) -> float:
    """`seconds`, a limit generous for a 3x slower, busy machine, times the scale."""
    return seconds * scale()


# The limit of a wait for something that takes well under a second here (a request
# aborted, a program held, a widget's last render, a server answering): minutes, so that
# only a hang reaches it.
WAIT = limit(300)


def until(cond: Callable[[], object], what: str, timeout: float = WAIT,
          interval: float = 0.01) -> None:
    """Poll `cond` until it is true; a guard against hanging, not a speed check."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw: {what} (waited {timeout:.0f} s)")
        time.sleep(interval)
