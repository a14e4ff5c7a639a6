"""Several samples of one prompt: OpenAI's and vLLM's `n` and `best_of`, SGLang's
`sampling_params.n`. The prompt's KV is computed once, by a prefill into the radix cache
(Runtime.prefill, what the language layer's shared Extend runs), and the samples are
submitted after it has finished, so each finds all but its last prompt token cached
(SGLang's tokenizer manager does the same with a max_new_tokens=0 request first).

Sample i draws with seed + i when a seed is given (vLLM's rule): each is reproducible on
its own, and the n are not copies of one another. Greedy samples are all the same text."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from sgl_nb.runtime.request import GenerateOutput
from sgl_nb.runtime.request_handle import RequestHandle
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.server.metrics import RequestLog

# Runtime.prefill scores the last prompt token, so it needs two.
MIN_SHARED_PROMPT = 2


@dataclass
class Delta:
    """Streamed text of sample `index`; `end` once that sample has finished (its text is
    then empty, and `Samples.output(index)` has its result)."""

    index: int
    text: str
    end: bool = False


def sample_params(params: dict, index: int) -> dict:
    """The SamplingParams fields of sample `index`: its own seed, if there is one."""
    if params.get("seed") is None:
        return params
    return {**params, "seed": params["seed"] + index}


class Samples:
    """n samples of one prompt. Made (and so checked) before anything is submitted;
    `begin()` starts the shared prefill; the results (`outputs()`, `deltas()`) wait for it,
    then submit the n requests. `cancel()` stops all of it, from any thread."""

    def __init__(self, runtime, log: RequestLog, prompt: list[int], params: dict, n: int,
                 stream: bool = False):
        self._runtime, self._log, self.prompt, self.n = runtime, log, prompt, n
        engine = runtime.engine
        # Every check the engine makes (vocabulary, context, grammar) raises here: a 400
        # with nothing running.
        self._requests = [engine.make_request(prompt, SamplingParams(**sample_params(params, i)))
                          for i in range(n)]
        self._deltas: queue.Queue[Delta] | None = queue.Queue() if stream else None
        self._lock = threading.Lock()
        self._cancelled = False
        self._prefill: RequestHandle | None = None
        self.handles: list[RequestHandle] = []

    def begin(self) -> None:
        if self.n > 1 and len(self.prompt) >= MIN_SHARED_PROMPT:
            self._prefill = self._runtime.prefill(self.prompt)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            handles = list(self.handles)
        if self._prefill is not None:
            self._prefill.cancel()
        for h in handles:
            h.cancel()

    def _submit(self) -> None:
        """The n requests, once the prefill has finished (it is only an optimisation: one
        that failed leaves each request to compute the prompt, or report its own error)."""
        if self._prefill is not None:
            try:
                self._prefill.result()
            except Exception:  # noqa: BLE001, S110 - see the docstring
                pass
        engine = self._runtime.engine
        with self._lock:
            if self.handles:
                return
            if self._cancelled:
                raise RuntimeError("the request was cancelled before its samples started")
            for i, req in enumerate(self._requests):
                if self._deltas is None:
                    handle = engine.submit(req)
                else:
                    handle = engine.submit(req, on_chunk=self._on_chunk(i),
                                           on_done=self._on_done(i))
                self.handles.append(handle)
                self._log.add(handle)

    def _on_chunk(self, index: int):
        return lambda text: self._deltas.put(Delta(index, text))

    def _on_done(self, index: int):
        return lambda handle: self._deltas.put(Delta(index, "", end=True))

    def outputs(self) -> list[GenerateOutput]:
        """Each sample's result, in order (waits for them all)."""
        self._submit()
        return [h.result() for h in self.handles]

    def output(self, index: int) -> GenerateOutput:
        """A finished sample's result (raises its error, if it failed)."""
        return self.handles[index].result()

    def deltas(self) -> Iterator[Delta]:
        """The samples' text as it comes, interleaved (stream=True). Leaving early cancels."""
        assert self._deltas is not None, "Samples(..., stream=True) to stream"
        self._submit()
        running = self.n
        try:
            while running:
                delta = self._deltas.get()
                running -= delta.end
                yield delta
        finally:
            if running:
                self.cancel()

    def prompt_usage(self) -> tuple[int, int]:
        """(prompt tokens, of those found cached), counted once for the n samples: the
        prefill's figures, or the one sample's."""
        try:
            out = (self._prefill or self.handles[0]).result()
        except Exception:  # noqa: BLE001 - a failed prefill: the first sample computed it
            out = self.handles[0].result()
        return len(self.prompt), out.meta.get("cached_tokens") or 0


def best_by_logprob(outputs: list[GenerateOutput], n: int) -> list[GenerateOutput]:
    """best_of: the n outputs with the highest mean logprob per token (OpenAI's rule),
    best first. The outputs carry logprobs (the samples were made with logprobs=True)."""
    def mean(out: GenerateOutput) -> float:
        lps = out.logprobs or []
        return sum(lps) / len(lps) if lps else float("-inf")

    return sorted(outputs, key=mean, reverse=True)[:n]


def begin_all(groups: list[Samples]) -> list[Samples]:
    """Start each group's prefill; all of them or none."""
    try:
        for g in groups:
            g.begin()
    except BaseException:
        for g in groups:
            g.cancel()
        raise
    return groups
