"""Stopping `sgl-nb serve` while it is busy, so that every client gets a well-formed end.

The order is the server's own, not uvicorn's. On SIGINT or SIGTERM (or `.shutdown()` from
a notebook) the gate stops taking requests: a new one gets 503 with Retry-After, and
/health 503 so that a load balancer moves on. The requests in flight get the grace period;
then the engine aborts what is left. An aborted request finishes like any other, with the
text generated so far and finish_reason "abort": a 200 answer, or a stream's last chunk
and `data: [DONE]`. Only once every answer has been sent does uvicorn close the
connections, so its own graceful timeout never cancels a handler building its answer."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from sgl_nb.server.errors import error_response

if TYPE_CHECKING:
    from sgl_nb.runtime.request_handle import RequestHandle
    from sgl_nb.server.metrics import RequestLog

# Once aborted, a request answers within an engine step; this limit only keeps a client
# still sending its body, or a wedged engine, from holding the exit.
ANSWER_SECONDS = 10.0
# The abort is repeated this often while requests are in flight: a route that was still
# tokenizing, or samples that start after their shared prefill, submit after the first.
ABORT_POLL_SECONDS = 0.05
# Still answered while stopping: a last scrape sees the aborts.
STILL_ANSWERED = {("GET", "/metrics")}


class Phase(Enum):
    SERVING = "serving"
    DRAINING = "draining"  # new requests refused; those in flight have the grace period
    ABORTING = "aborting"  # the grace is over: the engine aborts what is left


@dataclass
class Stopped:
    """What a stop did: the HTTP requests in flight when it began, and how many engine
    requests it aborted after the grace period (the others finished within it). `forced`:
    a second Ctrl-C ended it without waiting."""

    in_flight: int = 0
    aborted: int = 0
    forced: bool = False

    def summary(self) -> str:
        if self.forced:
            return f"stopped at once (Ctrl-C again), {self.in_flight} requests were in flight"
        return (f"stopped: {self.in_flight} requests were in flight, {self.aborted} aborted "
                "after the grace period")


class ShutdownGate:
    """The app behind a gate that counts the HTTP requests in flight and, once `drain()`
    has begun, refuses new ones. `log` holds the server's engine requests (the ones to
    abort: a notebook's own programs on the same Runtime are left alone)."""

    def __init__(self, app: ASGIApp, log: RequestLog, grace: float):
        self.app, self.log, self.grace = app, log, grace
        self.phase = Phase.SERVING
        self.in_flight = 0
        self.report = Stopped()
        self._idle = asyncio.Event()
        self._idle.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (self.phase is not Phase.SERVING
                and (scope["method"], scope["path"]) not in STILL_ANSWERED):
            await self._refuse(scope, receive, send)
            return
        self.in_flight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Retry-After: by then this server is gone; a replica, or this one restarted, answers.
        headers = {"Retry-After": str(max(1, math.ceil(self.grace))), "Connection": "close"}
        await error_response(503, "the server is shutting down", headers)(scope, receive, send)

    async def drain(self) -> Stopped:
        """Refuse new requests, give those in flight the grace period, then abort what is
        left and wait for their answers to go out."""
        self.phase = Phase.DRAINING
        self.report = Stopped(in_flight=self.in_flight)
        if await self._idle_within(self.grace):
            return self.report
        self.phase = Phase.ABORTING
        aborted: set[RequestHandle] = set()
        deadline = time.monotonic() + ANSWER_SECONDS
        while True:
            aborted.update(self._abort_running())
            if await self._idle_within(ABORT_POLL_SECONDS) or time.monotonic() > deadline:
                break
        self.report.aborted = sum(h.req.finish_reason == "abort" for h in aborted)
        return self.report

    def _abort_running(self) -> list[RequestHandle]:
        """Abort every request generating; a score (one prefill, no text to cut short:
        a /generate's prompt logprobs, n samples' shared prefix) is left to finish."""
        running = [h for h in self.log.in_flight() if h.req.logprob_start is None]
        for h in running:
            h.cancel()
        return running

    async def _idle_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), seconds)
        except TimeoutError:
            return False
        return True
