"""Sending a reply while watching the client: a client that disconnects, streaming or not,
cancels its engine requests at once (they leave the batch before the next engine step).

The engine's blocking calls (a handle's result, the next streamed chunk) run in worker
threads so the event loop stays free. Those threads are abandoned on cancellation rather
than waited for: after the cancel they return within one engine step anyway."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sgl_nb.server.errors import error_response
from sgl_nb.server.replies import Answer, Stream, cancel_all

log = logging.getLogger("sgl_nb.serve")
T = TypeVar("T")
_END = object()


async def in_thread(fn: Callable[..., T], *args, limiter: anyio.CapacityLimiter) -> T:
    return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=limiter)


async def submitted(route: Callable[[], Answer | Stream], limiter: anyio.CapacityLimiter
                    ) -> Answer | Stream:
    """The route's reply, from a thread that is waited for even when cancelled (it is
    short: tokenize, compile a grammar, submit), so that the requests it submitted are
    cancelled too, never left running for nobody."""
    box: list[Answer | Stream] = []

    def run() -> Answer | Stream:
        box.append(route())
        return box[0]

    try:
        return await anyio.to_thread.run_sync(run, limiter=limiter)
    except BaseException:
        for out in box:
            cancel_all(out.handles)
        raise


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def answer(request: Request, reply: Answer, limiter: anyio.CapacityLimiter
                 ) -> dict | list:
    """The reply's body, built in a thread; the requests are cancelled if the client
    disconnects first (or the server stops)."""
    finished, error = False, None

    async def watch() -> None:
        await wait_for_disconnect(request.receive)
        cancel_all(reply.handles)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            try:
                body = await in_thread(reply.build, limiter=limiter)
                finished = True
            except Exception as e:  # noqa: BLE001 - raised below, not in an ExceptionGroup
                error = e
            tg.cancel_scope.cancel()
    finally:
        if not finished:
            cancel_all(reply.handles)
    if error is not None:
        raise error
    return body


class EventStream(Response):
    """Server-sent events: `data: {json}` per event, then `data: [DONE]`. The client's
    disconnect is watched the whole time, not only noticed at the next write, so a request
    still queued or prefilling is cancelled as promptly as one that streams."""

    media_type = "text/event-stream"

    def __init__(self, reply: Stream, limiter: anyio.CapacityLimiter):
        # No body, so no Content-Length: the events go out as chunks (as in
        # StreamingResponse, which this replaces to watch the client throughout).
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})
        self.reply, self.limiter = reply, limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    await wait_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                finished = await self._send_all(scope, receive, send)
                tg.cancel_scope.cancel()
        except OSError:
            pass  # the client went while we wrote
        finally:
            if not finished:
                cancel_all(self.reply.handles)

    async def _send_all(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """The 200 goes out with the first event: a request its own input fails before
        that (a grammar no token continues, ...) is a 400, never an error in a 200 stream."""
        try:
            first = await self._next()
        except ValueError as e:
            cancel_all(self.reply.handles)
            await error_response(400, str(e) or type(e).__name__)(scope, receive, send)
            return True
        except Exception as e:  # noqa: BLE001 - the engine's own failure: a 500
            log.exception("a streamed request failed")
            await error_response(500, f"{type(e).__name__}: {e}")(scope, receive, send)
            return True
        await send({"type": "http.response.start", "status": 200,
                    "headers": self.raw_headers})
        async for chunk in self._chunks(first):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    async def _next(self):
        return await in_thread(next, self.reply.events, _END, limiter=self.limiter)

    async def _chunks(self, event) -> AsyncIterator[bytes]:
        while event is not _END:
            yield _sse(event)
            try:
                event = await self._next()
            except Exception as e:  # noqa: BLE001 - the headers are sent: say it in the stream
                log.exception("a streamed request failed")
                yield _sse({"error": {"message": f"{type(e).__name__}: {e}",
                                      "type": "server_error", "code": 500}})
                break
        yield b"data: [DONE]\n\n"


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()
