"""What `sgl-nb bench serve` (and its test) require of a server after a load: every request
accounted for in /metrics by finish reason, nothing left running, the server still
answering, greedy output unchanged, resident memory stable. Each is a Check: a name, whether
it held, and the figures that say so."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from sgl_nb.bench.serve_load import Outcome, httpx_module

FINISHED = "sgl_nb_requests_finished_total"
ABORTED = "sgl_nb_requests_aborted_total"
QUEUES = ("waiting", "prefilling", "running", "suspended")  # the engine's gauges
REASONS = ("stop", "length", "abort")  # how a request may end; any other is a failure
GREEDY_COMPLETION = {"prompt": "A short history of the lighthouse keeper's year:",
                     "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                     "return_token_ids": True}
GREEDY_CHAT = {"messages": [{"role": "user", "content": "Name three uses of a compass."}],
               "max_tokens": 48, "temperature": 0}
HTTP_TIMEOUT_S = 600.0  # one request on a busy machine; the limit only stops a hang


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(base_url: str) -> Metrics:
    """/metrics as {(sample name, sorted labels): value}, read with prometheus_client."""
    r = httpx_module().get(base_url + "/metrics", timeout=HTTP_TIMEOUT_S)
    r.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def finished(m: Metrics) -> Counter:
    """Requests finished so far, by finish reason."""
    return Counter({dict(labels)["finish_reason"]: v for (name, labels), v in m.items()
                    if name == FINISHED})


def queues(m: Metrics) -> dict[str, float]:
    return {q: m.get((f"sgl_nb_num_requests_{q}", ()), 0.0) for q in QUEUES}


def wait_idle(base_url: str, before: Metrics, sent: int, timeout_s: float = 300.0
              ) -> Metrics:
    """The first scrape where the engine's queues are empty and `sent` more requests have
    finished than in `before` (or the last one when `timeout_s` runs out: the checks then
    say what is missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(base_url)
        done = sum((finished(m) - finished(before)).values())
        if (not any(queues(m).values()) and done >= sent) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def accounting(outcomes: list[Outcome], before: Metrics, after: Metrics) -> list[Check]:
    """The clients' requests against the server's counts of them, by finish reason."""
    sent = len(outcomes)
    errors = [o for o in outcomes if o.error]
    hung_up = sum(o.hung_up for o in outcomes)
    seen = Counter(o.finish_reason for o in outcomes if not o.hung_up and not o.error)
    delta = finished(after) - finished(before)
    aborted = after.get((ABORTED, ()), 0) - before.get((ABORTED, ()), 0)
    others = {k: v for k, v in delta.items() if k not in REASONS}
    counted = " + ".join(f"{r} {delta[r]:g}" for r in REASONS)
    return [
        Check("clients saw no error", not errors, f"{len(errors)} of {sent}" + (
            f"; first: request {errors[0].spec.index}: {errors[0].error}" if errors else "")),
        Check("every request finished once, by finish reason",
              sum(delta[r] for r in REASONS) == sent and not others,
              f"{counted} = {sum(delta[r] for r in REASONS):g} of {sent} sent"
              + (f"; other reasons {others}" if others else "")),
        Check("a hang-up ends as abort, a read stream as the client saw it",
              delta["abort"] == hung_up == aborted and all(delta[r] == seen[r]
                                                           for r in ("stop", "length")),
              f"abort {delta['abort']:g} (engine aborts {aborted:g}) for {hung_up} hung up; "
              f"stop {delta['stop']:g} / length {delta['length']:g} for {seen['stop']} / "
              f"{seen['length']} seen by clients"),
        Check("nothing left running", not any(queues(after).values()),
              ", ".join(f"{q} {v:g}" for q, v in queues(after).items())),
    ]


def still_answers(base_url: str) -> Check:
    httpx = httpx_module()
    try:
        health = httpx.get(base_url + "/health", timeout=HTTP_TIMEOUT_S).status_code
        r = httpx.post(base_url + "/v1/completions", timeout=HTTP_TIMEOUT_S,
                       json={"prompt": "Hello", "max_tokens": 4})
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:200]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Check("the server still answers", False, f"{type(e).__name__}: {e}")
    return Check("the server still answers", health == 200 and r.status_code == 200,
                 f"/health {health}, /v1/completions {r.status_code}: {text!r}")


def greedy_answers(base_url: str, model: str | None = None) -> dict:
    """A greedy completion (text, token ids) and a greedy chat answer (text)."""
    httpx = httpx_module()
    extra = {"model": model} if model else {}
    c = httpx.post(base_url + "/v1/completions", json={**GREEDY_COMPLETION, **extra},
                   timeout=HTTP_TIMEOUT_S)
    c.raise_for_status()
    chat = httpx.post(base_url + "/v1/chat/completions", json={**GREEDY_CHAT, **extra},
                      timeout=HTTP_TIMEOUT_S)
    chat.raise_for_status()
    choice = c.json()["choices"][0]
    return {"completion": choice["text"], "completion_ids": choice.get("token_ids"),
            "chat": chat.json()["choices"][0]["message"]["content"]}


def greedy_unchanged(before: dict, after: dict) -> Check:
    differ = [k for k in before if before[k] != after[k]]
    return Check("greedy output unchanged by the load", not differ,
                 f"{', '.join(differ)} differ: {before} -> {after}" if differ else
                 f"completion ({len(before['completion_ids'] or [])} token ids) and chat "
                 "text identical")


def rss_stable(samples: list[tuple[float, float]], warmup_s: float, limit_mb: float
               ) -> Check:
    """Stable: the server's RSS after the load is at most `limit_mb` above its RSS at the
    end of the warm-up (allocator pools and per-shape buffers grow while warming up)."""
    name = f"RSS stable (growth after warm-up <= {limit_mb:g} MB)"
    # The last sample is the one after the load: the baseline is taken before it.
    warm = next((mb for t, mb in samples[:-1] if t >= warmup_s), None)
    if warm is None:
        return Check(name, False, f"no RSS sample after the {warmup_s:g} s warm-up")
    growth = samples[-1][1] - warm
    return Check(name, growth <= limit_mb, f"{warm:.0f} MB after warm-up -> "
                 f"{samples[-1][1]:.0f} MB after the load ({growth:+.0f} MB), peak "
                 f"{max(mb for _, mb in samples):.0f} MB")
