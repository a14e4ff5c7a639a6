"""One remote request in flight: a thread sends it and reads the answer (streamed or not);
the program reads `.chunks()` and `.result()`, as from the in-kernel engine's handle."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

from sgl_nb.runtime.request import GenerateOutput

_DONE = object()


class RemoteHandle:
    def __init__(self, rid: int, run: Callable[[RemoteHandle], GenerateOutput]):
        self.rid = rid
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._out: GenerateOutput | None = None
        self._error: BaseException | None = None
        self.created = time.monotonic()
        self.first_chunk_at: float | None = None
        threading.Thread(target=self._run, args=(run,), name=f"sgl-remote-{rid}",
                         daemon=True).start()

    def _run(self, run: Callable[[RemoteHandle], GenerateOutput]) -> None:
        try:
            self._out = run(self)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, never lost
            self._error = e
        finally:
            self._done.set()
            self._chunks.put(_DONE)

    def push(self, delta: str) -> None:
        if delta:
            if self.first_chunk_at is None:
                self.first_chunk_at = time.monotonic()
            self._chunks.put(delta)

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> GenerateOutput:
        # The sending thread always ends: every socket read has a timeout.
        if not self._done.wait(timeout):
            raise TimeoutError(f"remote request {self.rid} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out

    def chunks(self) -> Iterator[str]:
        """Text pieces as the server streams them; raises if the request failed."""
        while (item := self._chunks.get()) is not _DONE:
            yield item
        self.result()
