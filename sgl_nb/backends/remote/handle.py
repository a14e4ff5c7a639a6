"""One remote request in flight: a thread sends it and reads the answer (streamed or not);
the program reads `.chunks()` and `.result()` and may `.cancel()`, as with the in-kernel
engine's handle."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

from sgl_nb.backends.remote.cancel import CancelToken
from sgl_nb.runtime.request import GenerateOutput

_DONE = object()


def usage_of(meta: dict) -> dict:
    """A remote answer's figures, as an instruction_finished event carries them."""
    prompt, cached = meta.get("prompt_tokens"), meta.get("cached_tokens")
    return {"input_tokens": prompt, "cached_tokens": cached,
            "new_tokens": None if prompt is None or cached is None else prompt - cached,
            "output_tokens": meta.get("completion_tokens"), "batch_size": None,
            "preempted": 0, "finish_reason": meta.get("finish_reason")}


class RemoteHandle:
    def __init__(self, rid: int, run: Callable[[RemoteHandle], GenerateOutput],
                 on_chunk: Callable[[str], None] | None = None,
                 on_done: Callable[[RemoteHandle], None] | None = None):
        """on_chunk / on_done, if given, are called on the sending thread with each text
        piece and once at the end (the executor's only post)."""
        self.rid = rid
        self._on_chunk, self._on_done = on_chunk, on_done
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._out: GenerateOutput | None = None
        self._error: BaseException | None = None
        self.created = time.monotonic()
        self.first_chunk_at: float | None = None
        self.cancel_token = CancelToken()  # the sending thread's connection watches it
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
            if self._on_done is not None:
                self._on_done(self)

    def push(self, delta: str) -> None:
        if delta:
            if self.first_chunk_at is None:
                self.first_chunk_at = time.monotonic()
            if self._on_chunk is not None:
                self._on_chunk(delta)
            else:
                self._chunks.put(delta)

    def done(self) -> bool:
        return self._done.is_set()

    def usage(self) -> dict:
        """What its instruction_finished event reports (the server and its request id too)."""
        if self._out is None:
            return {}
        meta = self._out.meta
        return {**usage_of(meta), "server": meta.get("server"), "request": self.rid}

    @property
    def cancelled(self) -> bool:
        return self.cancel_token.cancelled

    def cancel(self) -> bool:
        """Abort the request: its connection is shut, so the server aborts it too. The
        handle then finishes with finish_reason "abort" and the text so far. Does not
        wait; False if it had already finished."""
        if self._done.is_set():
            return False
        return self.cancel_token.cancel()

    def result(self, timeout: float | None = None) -> GenerateOutput:
        """The output once finished (the sending thread always ends: every socket read has
        a timeout). An interrupt while waiting cancels the request before it propagates."""
        try:
            finished = self._done.wait(timeout)
        except KeyboardInterrupt:
            self.cancel()
            raise
        if not finished:
            raise TimeoutError(f"remote request {self.rid} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out

    def chunks(self) -> Iterator[str]:
        """Text pieces as the server streams them; raises if the request failed. Leaving
        the loop early (break, an exception, dropping the iterator) cancels the request."""
        try:
            while (item := self._chunks.get()) is not _DONE:
                yield item
        finally:
            if not self._done.is_set():
                self.cancel()
        self.result()


class ScoreShare:
    """One continuation's part of a remote request that scored several: the handle a
    Select's Score Instruction holds (its result: that continuation's input_logprobs)."""

    def __init__(self, index: int, handle: RemoteHandle | None = None):
        self.index, self.handle = index, handle

    @property
    def rid(self) -> int:
        return self.handle.rid

    def cancel(self) -> bool:
        return self.handle.cancel()

    def done(self) -> bool:
        return self.handle.done()

    def usage(self) -> dict:
        return self.handle.usage()

    def result(self, timeout: float | None = None) -> GenerateOutput:
        out = self.handle.result(timeout)
        return GenerateOutput(out.text, out.token_ids, out.meta,
                              input_logprobs=out.input_logprobs[self.index])
