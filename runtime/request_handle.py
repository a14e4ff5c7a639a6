"""What `Engine.submit` gives back: a handle to wait on, stream from or cancel a request.

The engine thread fills it (`push_text`, `mark_done`); any other thread reads it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from sgl_nb.runtime.request import GenerateOutput, Request

if TYPE_CHECKING:
    from sgl_nb.runtime.engine import Engine

# Put after the last chunk: a streaming reader stops there.
_DONE = object()


class EngineError(RuntimeError):
    """The engine failed while running a request (the message names the cause)."""


class RequestHandle:
    """A submitted request: `.result()` waits for its output, `.chunks()` streams its text,
    `.cancel()` aborts it (what it generated so far is kept, finish_reason "abort")."""

    def __init__(self, req: Request, stream: bool, engine: Engine | None = None,
                 on_chunk: Callable[[str], None] | None = None,
                 on_done: Callable[[RequestHandle], None] | None = None):
        """on_chunk / on_done, if given, are called on the engine thread with each text
        chunk and once at the end: they must return at once (the executor's only post)."""
        self.req = req
        self._engine = engine
        self._done = threading.Event()
        self._on_chunk, self._on_done = on_chunk, on_done
        self._chunks: queue.Queue | None = queue.Queue() if stream and not on_chunk else None

    @property
    def rid(self) -> int:
        return self.req.rid

    def push_text(self, delta: str) -> None:
        """The engine thread: new text of the request, to its stream or on_chunk."""
        if not delta:
            return
        if self._on_chunk is not None:
            self._on_chunk(delta)
        elif self._chunks is not None:
            self._chunks.put(delta)

    def mark_done(self) -> None:
        """The engine thread: the request has finished (its output is final)."""
        self._done.set()
        if self._chunks is not None:
            self._chunks.put(_DONE)
        if self._on_done is not None:
            self._on_done(self)

    def usage(self) -> dict:
        """What its instruction_finished event reports of the request."""
        return self.req.usage()

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        """Abort the request: it leaves the batch before the engine's next step. False if
        it had already finished. Does not wait; `.result()` then returns the output so far."""
        if self._done.is_set() or self._engine is None:
            return False
        return self._engine.abort(self.req.rid)

    def result(self, timeout: float | None = None) -> GenerateOutput:
        """The output once finished. An interrupt while waiting (Ctrl-C, a Jupyter
        interrupt) aborts the request before it propagates."""
        try:
            finished = self._done.wait(timeout)
        except KeyboardInterrupt:
            self.cancel()
            raise
        if not finished:
            raise TimeoutError(f"request {self.req.rid} not finished after {timeout} s")
        if self.req.error is not None:
            err = self.req.error
            if isinstance(err, ValueError):  # its own input (a grammar no token continues)
                raise err
            raise EngineError(f"request {self.req.rid} failed: {err}") from err
        return self.req.output()

    def chunks(self) -> Iterator[str]:
        """Text chunks as they are generated; raises if the request failed. Leaving the
        loop early (break, an exception, a KeyboardInterrupt, dropping the iterator) aborts
        the request."""
        assert self._chunks is not None, "submit(..., stream=True) to stream"
        try:
            while (item := self._chunks.get()) is not _DONE:
                yield item
        finally:
            if not self._done.is_set():
                self.cancel()
        self.result()
