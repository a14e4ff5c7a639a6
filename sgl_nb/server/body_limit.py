"""A request body over the limit is a 413 in the server's error shape: refused at once when
its Content-Length says so, or as soon as a chunked upload passes the limit (FastAPI's own
limit answers in plain text)."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sgl_nb.server.errors import error_response


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

        await self.app(scope, counted, send)
