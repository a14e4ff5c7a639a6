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
from typing import Protocol

from sgl_nb.runtime.engine import RequestHandle
from sgl_nb.server.choices import Samples, begin_all
from sgl_nb.server.metrics import RequestLog
from sgl_nb.server.refusals import ModelNotFound


class Cancellable(Protocol):
    """An engine request (RequestHandle), or several samples of one prompt (Samples)."""

    def cancel(self) -> object: ...


@dataclass
class Answer:
    build: Callable[[], dict | list]
    handles: list[Cancellable] = field(default_factory=list)


@dataclass
class Stream:
    events: Iterator[dict]
    handles: list[Cancellable] = field(default_factory=list)


def cancel_all(handles: list[Cancellable]) -> None:
    for h in handles:
        h.cancel()


def default_model_names(runtime) -> list[str]:
    """The model folder's name (what people type, and what traces call the model), not its
    path: a client learns nothing of the server's disk from it. /v1/models reports the path
    as the model's `root`, where a client on the same machine finds the tokenizer."""
    return [runtime.model_path.name]


class Served:
    """The runtime behind the routes, the model names it answers to, and the log of the
    requests they submit."""

    def __init__(self, runtime, model_names: list[str] | None = None):
        self.runtime = runtime
        self.model_names = list(model_names or default_model_names(runtime))
        self.model_name = self.model_names[0]  # what answers report
        self.log = RequestLog()

    def check_model(self, model: str | None) -> None:
        """No model (or an empty name) is this one, as in vLLM; another name is a 404."""
        if model and model not in self.model_names:
            raise ModelNotFound(f"The model `{model}` does not exist.")

    def sample(self, prompts: list[list[int]], params: dict | list[dict], n: int,
               stream: bool = False) -> list[Samples]:
        """n samples of each prompt (params: for all, or one each), each prompt computed
        once; all checked before any is submitted."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        groups = [Samples(self.runtime, self.log, ids, p, n, stream)
                  for ids, p in zip(prompts, each, strict=True)]
        return begin_all(groups)

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
