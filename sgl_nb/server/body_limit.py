"""A request body over the limit is a 413 in the server's error shape: refused at once when
its Content-Length says so, or as soon as a chunked upload passes the limit (FastAPI's own
limit answers in plain text).

After a large body's request ends, answered or refused, the memory it took goes back to the
OS. Python frees the body and what was parsed from it at once (nothing keeps them), but
glibc keeps freed pages: after it frees one large block it serves the next ones from its
heaps instead of fresh mappings, and keeps those heaps. Measured on the default model: 10 MB
bodies refused left 30-40 MB behind; trimming the allocator after each gives it back."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import anyio
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sgl_nb.server.errors import error_response

# A body this large is given back after its request (a chat or a prompt of the default
# model's context is well under it, so ordinary requests never pay for the trim).
RELEASE_AFTER_BYTES = 1 * 2**20


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, self._too_large())(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # the route's error handler answers it
                raise HTTPException(413, self._too_large())
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if seen >= RELEASE_AFTER_BYTES:
                await anyio.to_thread.run_sync(release_memory)


def release_memory() -> None:
    """Hand the C allocator's free pages back to the OS."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere (macOS, musl: nothing to call)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
