"""What a route hands back, with the engine requests behind it, so that whoever sends the
reply can cancel those requests when the client goes away.

A route runs in a worker thread (tokenizing, compiling a grammar and submitting block) and
returns an Answer (a JSON body, built in a worker thread once the requests finish) or a
Stream (events, read one at a time in a worker thread). Either way the requests were
submitted, and checked, before the reply starts: a bad request is a 400, never a broken
stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sgl_nb.runtime.engine import RequestHandle
from sgl_nb.server.metrics import RequestLog


@dataclass
class Answer:
    build: Callable[[], dict | list]
    handles: list[RequestHandle] = field(default_factory=list)


@dataclass
class Stream:
    events: Iterator[dict]
    handles: list[RequestHandle] = field(default_factory=list)


def cancel_all(handles: list[RequestHandle]) -> None:
    for h in handles:
        h.cancel()


class Served:
    """The runtime behind the routes, and the log of the requests they submit."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.model_name = str(runtime.model_path)
        self.log = RequestLog()

    def submit_all(self, prompts: list[list[int]], params: list[dict],
                   stream: bool = False) -> list[RequestHandle]:
        """All of them or none: one the engine refuses cancels those already queued."""
        handles: list[RequestHandle] = []
        try:
            for ids, p in zip(prompts, params, strict=True):
                handles.append(self.runtime.submit(ids, stream=stream, **p))
                self.log.add(handles[-1])
        except BaseException:
            cancel_all(handles)
            raise
        return handles

    def submit(self, ids: list[int], params: dict, stream: bool = False) -> RequestHandle:
        return self.submit_all([ids], [params], stream)[0]
