"""The load of `sgl-nb bench serve`: concurrent streaming clients of an OpenAI-compatible
server sending chat and completion requests of mixed lengths, a fixed fraction of which hang
up mid-stream (the connection closed after a few chunks), and what each client saw.

Each request is drawn from its index alone (a random generator seeded by it), so a run
with the same flags sends the same requests, whichever client sends which."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction

# Words the prompts are drawn from: a vocabulary of everyday English, so the tokenizer
# sees ordinary text and the model answers in it.
WORDS = ("the river cold morning train station ticket window garden lamp violin castle "
         "storm harbour ship sailor map compass north letter friend kitchen bread market "
         "winter summer window road forest fox owl moon light clock tower bridge stone "
         "teacher lesson number story question answer careful quickly slowly because "
         "after before always never small large old new green blue quiet loud").split()
PROMPT_WORDS = (8, 24, 64, 160, 320)  # mixed prompt lengths
COMPLETE_TOKENS = (16, 48, 96, 160)  # max_tokens of a request read to its end
# A request that hangs up runs long and past EOS, so it is still generating when its
# client closes the connection: it can only end as an abort.
HANG_UP_TOKENS = 512
HANG_UP_AFTER = (1, 12)  # content chunks received before the client closes
CLIENT_TIMEOUT_S = 600.0  # a server that stops answering shows as an error, not a hang


class Route(Enum):
    CHAT = "/v1/chat/completions"
    COMPLETION = "/v1/completions"


@dataclass
class Plan:
    clients: int = 32
    duration_s: float | None = 180.0  # no new request after this many seconds ...
    max_requests: int | None = None  # ... or after this many (whichever comes first)
    disconnect_fraction: float = 1 / 3
    seed: int = 0
    model: str | None = None  # the "model" field of each body, if the server wants one


@dataclass
class Spec:
    """One request: where it goes, its body, and when its client hangs up (None: never)."""

    index: int
    route: Route
    body: dict
    hang_up_after: int | None


@dataclass
class Outcome:
    """What the client saw of one request (times on the client's perf_counter)."""

    spec: Spec
    started: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # events that carried text
    completion_tokens: int | None = None  # from the usage event
    finish_reason: str | None = None
    hung_up: bool = False
    error: str | None = None


def httpx_module():
    """httpx, which the load clients use; it ships with the test extras, not the runtime."""
    try:
        import httpx
    except ImportError:
        raise SystemExit("sgl-nb bench serve needs httpx: pip install httpx "
                         "(or the project's test extras, pip install -e .[test])") from None
    return httpx


def hangs_up(index: int, fraction: Fraction) -> bool:
    """Exactly `fraction` of every run of requests, spread evenly (1/3: every third)."""
    return (index + 1) * fraction // 1 > index * fraction // 1


def spec_for(index: int, plan: Plan) -> Spec:
    rng = random.Random(plan.seed * 1_000_003 + index)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.choice(PROMPT_WORDS)))
    hang_up = hangs_up(index, Fraction(plan.disconnect_fraction).limit_denominator(1000))
    body = {"stream": True, "stream_options": {"include_usage": True}, "seed": index,
            "temperature": rng.choice((0.0, 0.7)),
            "max_tokens": HANG_UP_TOKENS if hang_up else rng.choice(COMPLETE_TOKENS)}
    if hang_up:
        body["ignore_eos"] = True
    if plan.model:
        body["model"] = plan.model
    route = rng.choice(tuple(Route))
    if route is Route.CHAT:
        body["messages"] = [{"role": "user", "content": f"Tell a story with these words: {text}"}]
    else:
        body["prompt"] = text
    return Spec(index, route, body, rng.randint(*HANG_UP_AFTER) if hang_up else None)


def event_of(line: str) -> dict | None:
    """A server-sent event's JSON, or None for a blank line, a comment or [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return None if data == "[DONE]" else json.loads(data)


def _record(out: Outcome, event: dict, now: float, last: float) -> float:
    """Takes one event into `out`; the time of the last text event."""
    if "error" in event:
        out.error = f"error event: {event['error']}"
        return last
    if event.get("usage") and not event.get("choices"):
        out.completion_tokens = event["usage"]["completion_tokens"]
        return last
    choice = event["choices"][0]
    text = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
    out.finish_reason = choice.get("finish_reason") or out.finish_reason
    if not text:
        return last
    out.chunks += 1
    if out.ttft_s is None:
        out.ttft_s = now - out.started
    else:
        out.itl_s.append(now - last)
    return now


async def send(client, base_url: str, spec: Spec) -> Outcome:
    """One streamed request; the client hangs up after `spec.hang_up_after` text chunks."""
    httpx = httpx_module()
    out = Outcome(spec, started=time.perf_counter())
    last = out.started
    try:
        async with client.stream("POST", base_url + spec.route.value, json=spec.body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return out
            async for line in r.aiter_lines():
                event = event_of(line)
                if event is None:
                    continue
                last = _record(out, event, time.perf_counter(), last)
                if out.error:
                    return out
                if (spec.hang_up_after is not None and out.finish_reason is None
                        and out.chunks >= spec.hang_up_after):
                    out.hung_up = True  # leaving the block closes the connection mid-stream
                    return out
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    if out.finish_reason is None:
        out.error = "the stream ended without a finish_reason"
    return out


class _Dispenser:
    """Hands out request indices until the plan's time or count runs out."""

    def __init__(self, plan: Plan):
        self.plan, self.next = plan, 0
        self.stop_at = None if plan.duration_s is None else time.monotonic() + plan.duration_s

    def take(self) -> int | None:
        if self.plan.max_requests is not None and self.next >= self.plan.max_requests:
            return None
        if self.stop_at is not None and time.monotonic() >= self.stop_at:
            return None
        self.next += 1
        return self.next - 1


async def _client(client, base_url: str, plan: Plan, dispenser: _Dispenser,
                  outcomes: list[Outcome]) -> None:
    while (index := dispenser.take()) is not None:
        outcomes.append(await send(client, base_url, spec_for(index, plan)))


async def _tick(every_s: float, on_tick: Callable[[float], None], t0: float) -> None:
    while True:
        on_tick(time.monotonic() - t0)
        await asyncio.sleep(every_s)


async def _load(base_url: str, plan: Plan, on_tick: Callable[[float], None] | None
                ) -> tuple[list[Outcome], float]:
    httpx = httpx_module()
    outcomes: list[Outcome] = []
    dispenser = _Dispenser(plan)
    limits = httpx.Limits(max_connections=plan.clients, max_keepalive_connections=plan.clients)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        ticker = asyncio.create_task(_tick(1.0, on_tick, t0)) if on_tick else None
        try:
            await asyncio.gather(*(_client(client, base_url, plan, dispenser, outcomes)
                                   for _ in range(plan.clients)))
        finally:
            if ticker:
                ticker.cancel()
    return sorted(outcomes, key=lambda o: o.spec.index), time.monotonic() - t0


def run_load(base_url: str, plan: Plan, on_tick: Callable[[float], None] | None = None
             ) -> tuple[list[Outcome], float]:
    """Every request's outcome, and the seconds from the first sent to the last ended.
    `on_tick(seconds since the start)` is called about once a second meanwhile."""
    return asyncio.run(_load(base_url, plan, on_tick))
