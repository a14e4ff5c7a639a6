"""The threads that run programs' Python bodies: at most `size` at once.

A body blocks only where it reads a generated value, and those come from the executor and
the engine, never from another body, so bodies waiting in the queue always get a thread in
the end (unless a body itself waits on another program's end: then give the pool room).
Daemon threads: a process never waits for a body at exit (sgl_nb.runtime.engine stops the
engines, and a body waiting on one then ends with an error).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("sgl_nb.bodies")


class BodyPool:
    def __init__(self, size: int, name: str = "sgl-body"):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"num_threads must be a positive integer, got {size!r}")
        self.size, self.name = size, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._jobs.put(fn)
            if self._idle > 0:
                self._idle -= 1  # an idle worker takes it: the next submit counts it busy
            elif self._threads < self.size:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._threads}",
                                 daemon=True).start()

    def close(self) -> None:
        """Let the threads end once the queue is empty."""
        with self._lock:
            for _ in range(self._threads):
                self._jobs.put(None)

    @property
    def threads(self) -> int:
        return self._threads

    def _work(self) -> None:
        while True:
            fn = self._jobs.get()
            if fn is None:
                with self._lock:
                    self._threads -= 1
                return
            try:
                fn()
            except BaseException:  # noqa: BLE001 - a body keeps its own errors; log a leak
                log.exception("a program body raised past its state")
            with self._lock:
                self._idle += 1
