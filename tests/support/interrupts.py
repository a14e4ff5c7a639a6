"""A real SIGINT to the main thread, as Ctrl-C or a Jupyter interrupt delivers it, sent once
the state it is meant to interrupt holds, not after a fixed delay (see tests/conftest.py)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

from support.waits import until


def interrupt_main_inside(call: Callable, ready: Callable[[], object]) -> threading.Event:
    """SIGINT the main thread once it runs inside `call` (a function or bound method: its
    code is on the main thread's stack; a generator's only while it runs, in a next()) and
    ready() holds (the request decoding, a chunk received): on any machine it lands in the
    blocking call, where the test means it to, not after a delay in which a slow machine may
    not have reached the call. Set the returned Event to call it off."""
    main, code = threading.main_thread().ident, getattr(call, "__func__", call).__code__
    off = threading.Event()

    def inside() -> bool:
        f = sys._current_frames().get(main)
        while f is not None and f.f_code is not code:
            f = f.f_back
        return f is not None

    def send() -> None:
        until(lambda: off.is_set() or (ready() and inside()), "the main thread in the call")
        if not off.is_set():
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=send, daemon=True, name="interrupt-main").start()
    return off
