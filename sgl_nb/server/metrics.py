"""Prometheus `/metrics`: the engine's own totals and queue lengths, read at scrape time,
plus what the server saw of its requests (finish reasons, time to first token), counted as
each one finishes.

Totals are counters, so a rate or a hit rate (cached / prompt tokens) can be taken over any
window; queue lengths are gauges."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sgl_nb.runtime.request_handle import RequestHandle

PREFIX = "sgl_nb_"
# Time to first token on a CPU runs from ~50 ms to seconds under load.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RequestLog:
    """The server's requests in flight; each is counted once, when it is seen finished (at
    the next submit or scrape), so nothing waits on a request to count it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: list[RequestHandle] = []
        self.finished = Counter(f"{PREFIX}requests_finished", "Requests this server ran, by "
                                "finish reason (stop, length, abort, error)", ["finish_reason"],
                                registry=None)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Seconds from a "
                              "request's arrival at the engine to its first output token",
                              buckets=TTFT_BUCKETS, registry=None)

    def add(self, handle: RequestHandle) -> None:
        with self._lock:
            self._open.append(handle)
        self.sweep()

    def in_flight(self) -> list[RequestHandle]:
        """The requests submitted and not finished yet."""
        with self._lock:
            return [h for h in self._open if not h.done()]

    def sweep(self) -> None:
        with self._lock:
            done = [h for h in self._open if h.done()]
            self._open = [h for h in self._open if not h.done()]
        for h in done:
            req = h.req
            self.finished.labels(finish_reason=req.finish_reason or "unknown").inc()
            if req.first_token_at is not None:
                self.ttft.observe(req.first_token_at - req.created)


class EngineCollector(Collector):
    def __init__(self, runtime, log: RequestLog):
        self.runtime, self.log = runtime, log

    def collect(self) -> Iterator[Metric]:
        m, cache = self.runtime.metrics(), self.runtime.cache_stats()
        for name, doc, value in (
                ("prompt_tokens", "Prompt tokens of the requests admitted", cache["prompt_tokens"]),
                ("cached_prompt_tokens", "Prompt tokens found in the radix cache (not computed)",
                 cache["cached_prompt_tokens"]),
                ("generation_tokens", "Tokens generated", m["generated_tokens"]),
                ("requests_aborted", "Requests aborted (client gone, cancelled)", m["aborted"]),
                ("preemptions", "Decodes suspended for higher-priority work", m["preemptions"]),
                ("retractions", "Requests retracted when the KV pool ran out",
                 m["retractions"])):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        for state in ("waiting", "prefilling", "running", "suspended"):
            yield GaugeMetricFamily(f"{PREFIX}num_requests_{state}",
                                    f"Requests {state} in the engine now", value=m[state])
        self.log.sweep()
        yield from self.log.finished.collect()
        yield from self.log.ttft.collect()


def metrics_registry(runtime, log: RequestLog) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(runtime, log))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format, for one scrape."""
    return generate_latest(registry)
