"""`--api-key`: every route but /health wants `Authorization: Bearer <key>`, as vLLM's and
SGLang's servers do. A plain ASGI middleware: it leaves the request's receive channel
alone, which the routes watch for the client's disconnect."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from sgl_nb.server.errors import error_response

OPEN_PATHS = ("/health",)  # what a load balancer probes


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        problem = self.problem(Headers(scope=scope).get("authorization"))
        if problem is None:
            return await self.app(scope, receive, send)
        response = error_response(401, problem, {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def problem(self, header: str | None) -> str | None:
        """Why the request is refused, or None."""
        if not header:
            return ("missing API key: send the header 'Authorization: Bearer <key>' (the key "
                    "sgl-nb serve was started with)")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "the Authorization header must be 'Bearer <key>'"
        # Constant time: how much of a guess matched must not show in the timing.
        if not hmac.compare_digest(token.strip().encode(), self._key):
            return "invalid API key"
        return None
