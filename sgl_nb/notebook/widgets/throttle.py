"""Feeding views from the event stream without flooding the notebook's frontend.

The engine publishes thousands of events a second; a widget message per event would swamp
the browser. `EventPump` reads a subscriber queue on its own thread, folds every event at
once (lossless), and asks for a render at most `rate` times a second (`Throttle`); each
render sends one message per widget (`hold_sync`). It never blocks the engine (the queue is
the bus's), and a final render after the program ends leaves the last state in the traits.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from sgl_nb.runtime.events import Event


class Throttle:
    """Says when a render is due: at most `rate` a second. `clock` is injectable (tests)."""

    def __init__(self, rate: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if rate <= 0:
            raise ValueError(f"rate must be > 0 renders a second, got {rate}")
        self.interval = 1.0 / rate
        self.clock = clock
        self._last: float | None = None
        self.renders = 0

    def wait_s(self) -> float:
        """Seconds until the next render may happen (0 when it may happen now)."""
        if self._last is None:
            return 0.0
        return max(0.0, self._last + self.interval - self.clock())

    def due(self) -> bool:
        return self.wait_s() == 0.0

    def mark(self) -> None:
        """A render happened now."""
        self._last = self.clock()
        self.renders += 1


@contextlib.contextmanager
def held(widgets: Iterable) -> Iterator[None]:
    """Hold every widget's sync: each sends its changed traits as one message at the end."""
    with contextlib.ExitStack() as stack:
        for w in widgets:
            stack.enter_context(w.hold_sync())
        yield


class _Flush:
    """Put in the queue by flush(): the pump renders when it reaches it, then says so."""

    def __init__(self):
        self.done = threading.Event()


class EventPump:
    """A thread that drains `q`, hands each batch to `fold`, and calls `render` when the
    throttle allows, or every `poll` seconds when `changed()` says something outside the
    event stream moved (a held step controller). It stops once `finished()` is true and the
    queue is empty, after one last render; `stop()` ends it early."""

    def __init__(self, q: queue.SimpleQueue, fold: Callable[[list[Event]], bool | None],
                 render: Callable[[], None], finished: Callable[[], bool],
                 changed: Callable[[], bool] = lambda: False, rate: float = 30.0,
                 poll: float = 0.2, on_stop: Callable[[], None] | None = None):
        self.q, self.fold, self.render = q, fold, render
        self.finished, self.changed, self.poll = finished, changed, poll
        self.throttle = Throttle(rate)
        self.on_stop = on_stop
        self.events_seen = 0
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sgl-widget-pump", daemon=True)

    def start(self) -> EventPump:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Fold every event published before this call and render, then return (headless
        use and tests: the view is then exactly up to date). False on timeout."""
        if not self._thread.is_alive():
            return True  # it stopped after folding everything and a final render
        marker = _Flush()
        self.q.put(marker)  # FIFO: every event published before it is folded first
        deadline = None if timeout is None else time.monotonic() + timeout
        while not marker.done.wait(0.05):
            if not self._thread.is_alive():
                return True  # it ended meanwhile, after its final render
            if deadline is not None and time.monotonic() > deadline:
                return False
        return True

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the final render; True when it happened."""
        return self._done.wait(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _drain(self, first: Event | None) -> list:
        batch = [] if first is None else [first]
        while True:
            try:
                batch.append(self.q.get_nowait())
            except queue.Empty:
                return batch

    def _loop(self) -> None:
        dirty = True
        waiting: list[_Flush] = []  # flush() calls answered by the next render
        try:
            while not self._stop.is_set():
                timeout = self.throttle.wait_s() if dirty else self.poll
                try:
                    first = self.q.get(timeout=max(timeout, 0.001))
                except queue.Empty:
                    first = None
                batch = self._drain(first)
                flushes = [e for e in batch if isinstance(e, _Flush)]
                waiting.extend(flushes)
                events = [e for e in batch if not isinstance(e, _Flush)]
                if events:
                    self.events_seen += len(events)
                    # fold may say (False) that none of these concern the view.
                    dirty |= self.fold(events) is not False
                if not batch and self.changed():
                    dirty = True
                if self.finished() and self.q.empty():
                    break
                if flushes or (dirty and self.throttle.due()):
                    self.render()
                    self.throttle.mark()
                    dirty = False
                    for f in waiting:
                        f.done.set()
                    waiting.clear()
            rest = self._drain(None)
            self.fold([e for e in rest if not isinstance(e, _Flush)])
            self.render()  # the final state, kept in the traits
            self.throttle.mark()
        finally:
            self._done.set()
            for f in waiting + [e for e in self._drain(None) if isinstance(e, _Flush)]:
                f.done.set()
            if self.on_stop is not None:
                self.on_stop()


class PumpedView:
    """A view fed by an EventPump (its `pump`, None before it starts) that draws itself in
    `render`: the headless controls every such view has."""

    pump: EventPump | None

    def render(self) -> None:
        raise NotImplementedError

    def sync(self, timeout: float | None = 60.0) -> None:
        """Fold everything published so far and render it (headless use, tests)."""
        if self.pump is not None:
            self.pump.flush(timeout)
        else:
            self.render()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the final render (after what it shows has ended); True when it happened."""
        return self.pump.join(timeout) if self.pump is not None else True
