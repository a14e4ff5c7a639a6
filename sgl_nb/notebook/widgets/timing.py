"""Per-Node timing, folded from the events: how long its engine requests waited in the
scheduler's queue, their prefill, their decode, and how many prompt tokens the radix
cache served.

From a request's events: its Instruction starts when it is submitted, `cache_hit` says when
the scheduler admitted it (the first one, if it was retracted and admitted again), the
first `token` ends its prefill, and `instruction_finished` ends it. A Select's Scores run
as one batch: their prefill ends when they finish, and they decode nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_nb.runtime.events import CacheHit, Event, InstructionFinished, InstructionStarted, Token


@dataclass
class _Request:
    node: int | None
    kind: str | None
    submitted: int | None = None
    admitted: int | None = None
    first_token: int | None = None
    last_token: int | None = None
    finished: int | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass
class NodeTiming:
    """Seconds of the Node's requests: queue (submitted to admitted), prefill (admitted to
    the first token), decode (first token to the end); prompt and cached tokens."""

    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0

    @property
    def cache_hit(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def summary(self) -> str:
        if not self.requests:
            return ""
        parts = [f"{label} {_ms(v)}" for label, v in (("queue", self.queue_s),
                                                        ("prefill", self.prefill_s),
                                                        ("decode", self.decode_s))
                 if v is not None]
        if self.prompt_tokens:
            parts.append(f"cache {self.cached_tokens}/{self.prompt_tokens} tok")
        return " · ".join(parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


@dataclass
class Timings:
    """Fold events with `apply`; `node(id)` gives a Node's timing so far."""

    _requests: dict[int, _Request] = field(default_factory=dict)
    _by_node: dict[int, list[int]] = field(default_factory=dict)

    def apply(self, e: Event) -> None:
        if e.request is None:
            return
        r = self._requests.get(e.request)
        if isinstance(e, InstructionStarted):
            if r is None or r.node is None:
                r = self._requests.setdefault(e.request, _Request(None, None))
                r.node, r.kind = e.node, e.op
                self._by_node.setdefault(e.node, []).append(e.request)
            # The executor reports a start once the engine has the request, which may have
            # admitted it already: it was submitted no later than that.
            r.submitted = e.ts if r.admitted is None else min(e.ts, r.admitted)
            return
        if r is None:  # its engine events came before its start: kept for when it comes
            r = self._requests[e.request] = _Request(None, None)
        if isinstance(e, CacheHit) and r.admitted is None:
            r.admitted = e.ts
            r.cached_tokens, r.prompt_tokens = e.cached_tokens, e.prompt_tokens
        elif isinstance(e, Token):
            if r.first_token is None:
                r.first_token = e.ts
            r.last_token = e.ts
        elif isinstance(e, InstructionFinished):
            r.finished = e.ts
            u = e.usage
            if u.get("input_tokens") is not None:
                r.prompt_tokens = u["input_tokens"]
                r.cached_tokens = u.get("cached_tokens") or 0
            r.output_tokens = u.get("output_tokens") or 0

    def node(self, node_id: int) -> NodeTiming:
        reqs = [self._requests[r] for r in self._by_node.get(node_id, [])]
        t = NodeTiming(requests=len(reqs))
        if not reqs:
            return t
        queue = [r.admitted - r.submitted for r in reqs
                 if r.admitted is not None and r.submitted is not None]
        prefill = []
        decode = []
        for r in reqs:
            if r.admitted is None:
                continue
            end_of_prefill = r.first_token if r.first_token is not None else r.finished
            if end_of_prefill is not None:
                prefill.append(end_of_prefill - r.admitted)
            if r.first_token is not None:
                end = r.finished if r.finished is not None else r.last_token
                decode.append(end - r.first_token)
        # Requests of one Node run together (a Select's Scores): the longest is the Node's.
        t.queue_s = max(queue) / 1e9 if queue else None
        t.prefill_s = max(prefill) / 1e9 if prefill else None
        t.decode_s = max(decode) / 1e9 if decode else None
        t.prompt_tokens = sum(r.prompt_tokens for r in reqs)
        t.cached_tokens = sum(r.cached_tokens for r in reqs)
        t.output_tokens = sum(r.output_tokens for r in reqs)
        return t
