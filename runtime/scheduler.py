"""Which requests run in the next engine step, and what happens to them after it.

Continuous batching: requests join (prefill, in chunks under a token budget) and leave
(finish) at every step. A step is either an extend step (prompt chunks; only the part
of a prompt the radix cache does not hold is computed) or a decode step (one token for
every running request). Extend steps go first, so new requests start quickly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from sgl_nb.runtime.forward_batch import ForwardBatch, build_batch
from sgl_nb.runtime.kv_pool import KVPool
from sgl_nb.runtime.radix_cache import RadixCache
from sgl_nb.runtime.request import EMPTY_SLOTS, Request

# Admission keeps room for the tokens running requests are still expected to generate:
# ratio x (their remaining max_new_tokens). The ratio starts cautious, relaxes a little at
# every decode step, and jumps back up after a retraction, so memory pressure does not
# turn into a loop of admit, retract, admit (the scheme SGLang uses).
NEW_TOKEN_RATIO_INIT, NEW_TOKEN_RATIO_MIN, NEW_TOKEN_RATIO_DECAY = 0.5, 0.1, 0.002
NEW_TOKEN_RATIO_AFTER_RETRACT = 0.3

# A waiting request that shares at least this many uncached tokens with one already
# chosen for this step waits one step, then finds that prefix in the cache.
IN_BATCH_SHARE_MIN = 32


@dataclass
class ScheduledBatch:
    reqs: list[Request]
    new_lens: list[int]  # tokens each request computes in this step
    forward: ForwardBatch
    # Scoring requests: (request, first scored position, number of rows) in score_rows order.
    scored: list[tuple[Request, int, int]]

    @property
    def is_decode(self) -> bool:
        return self.forward.is_decode


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(
        self,
        pool: KVPool,
        cache: RadixCache,
        device: torch.device,
        max_prefill_tokens: int = 512,
        max_running: int = 64,
    ):
        self.pool, self.cache, self.device = pool, cache, device
        self.max_prefill_tokens, self.max_running = max_prefill_tokens, max_running
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not fully computed yet
        self.running: list[Request] = []  # decoding
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.retractions = 0
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self.events = None  # the engine's EventBus: cache hits, inserts and evictions

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    # ---- choosing a step ----------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        return self._extend_batch() or self._decode_batch()

    def _extend_batch(self) -> ScheduledBatch | None:
        budget = self.max_prefill_tokens
        chosen: list[tuple[Request, int]] = []
        for req in list(self.prefilling):
            if budget <= 0:
                break
            n = min(req.seq_len - req.fill_len, budget)
            if not self._grow(req, n):
                break
            chosen.append((req, n))
            budget -= n
        deferred: list[Request] = []
        while self.waiting and budget > 0 and self._room_for_more(len(chosen)):
            req = self.waiting.popleft()
            if self._shares_uncached_prefix(req, [r for r, _ in chosen]):
                deferred.append(req)
                continue
            n = self._admit(req, budget)
            if n == 0:
                self.waiting.appendleft(req)
                break
            chosen.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        if not chosen:
            return None
        return self._make(False, chosen)

    def _room_for_more(self, n_chosen: int) -> bool:
        return len(self.running) + len(self.prefilling) + n_chosen < self.max_running

    def _shares_uncached_prefix(self, req: Request, chosen: list[Request]) -> bool:
        ids = req.all_ids
        for other in chosen:
            if other.cached_len >= len(other.prompt_ids):
                continue
            if common_prefix_len(ids, other.all_ids) - other.cached_len >= IN_BATCH_SHARE_MIN:
                return True
        return False

    def _expected_growth(self, reqs: list[Request]) -> int:
        r = self.new_token_ratio
        return sum(int(r * (q.max_new_tokens - len(q.output_ids))) + 1 for q in reqs)

    def _fits(self, req: Request, uncached: int) -> bool:
        """Would admitting req leave room for everyone's expected growth?"""
        others = self.running + self.prefilling
        if not others:
            return True  # alone it always fits: submission checked prompt + max_tokens
        others_left = sum(q.seq_len - q.fill_len for q in self.prefilling)
        need = uncached + others_left + self._expected_growth([*others, req])
        return self.pool.available() + self.cache.evictable_size() >= need

    def _admit(self, req: Request, budget: int) -> int:
        """Match the cached prefix, lock it, allocate the first chunk. 0 if out of memory."""
        ids = req.all_ids
        # Always leave one token to compute: its logits give the next token. A scoring
        # request also computes the token before its first scored one.
        limit = len(ids) - 1 if req.logprob_start is None else max(req.logprob_start - 1, 0)
        prefix, node = self.cache.match_prefix(ids[:limit])
        n = min(len(ids) - prefix.numel(), budget)
        self.cache.inc_lock_ref(node)
        if not self._fits(req, len(ids) - prefix.numel()):
            self.cache.dec_lock_ref(node)
            return 0
        slots = self._alloc(n)
        if slots is None:
            self.cache.dec_lock_ref(node)
            return 0
        req.slots, req.cached_len, req.last_node = prefix, prefix.numel(), node
        req.slots = torch.cat([req.slots, slots])
        self._emit("cache_hit", request=req.rid, data={"cached_tokens": prefix.numel(),
                                                         "prompt_tokens": len(ids)})
        if req.prompt_cached_tokens < 0:
            req.prompt_cached_tokens = prefix.numel()
            self.prompt_tokens += len(req.prompt_ids)
            self.cached_prompt_tokens += prefix.numel()
        self.prefilling.append(req)
        return n

    def _grow(self, req: Request, n: int) -> bool:
        slots = self._alloc(n)
        if slots is None:
            return False
        req.slots = torch.cat([req.slots, slots])
        return True

    def _alloc(self, n: int) -> torch.Tensor | None:
        short = n - self.pool.available()
        if short > 0:
            self._emit("cache_evict", data={"tokens": self.cache.evict(short)})
        return self.pool.alloc(n)

    def _emit(self, kind: str, **fields) -> None:
        if self.events is not None:
            self.events.emit(kind, **fields)

    def _decode_batch(self) -> ScheduledBatch | None:
        if not self.running:
            return None
        # A request held by a step controller sits out this step (and keeps its KV).
        ready = [r for r in self.running if r.gate is None or r.gate()]
        if not ready:
            return None
        self._make_room_for_decode()
        self.new_token_ratio = max(
            NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        chosen = [(req, 1) for req in ready if req in self.running]
        for req, _ in chosen:
            req.slots = torch.cat([req.slots, self.pool.alloc(1)])
        return self._make(True, chosen)

    def _make_room_for_decode(self) -> None:
        """Every running request needs one new slot; evict cache, then retract if still short."""
        while True:
            short = len(self.running) - self.pool.available()
            if short <= 0:
                return
            freed = self.cache.evict(short)
            self._emit("cache_evict", data={"tokens": freed})
            if freed >= short:
                return
            if len(self.running) == 1:
                raise MemoryError("KV pool exhausted by a single request")  # admission prevents
            self.retract(self.running[-1])

    def _make(self, is_decode: bool, chosen: list[tuple[Request, int]]) -> ScheduledBatch:
        reqs = [r for r, _ in chosen]
        lens = [n for _, n in chosen]
        starts = [r.fill_len - n for r, n in chosen]  # slots already include the new ones
        tokens = [r.all_ids[s : s + n] for r, s, n in zip(reqs, starts, lens)]
        out_loc = [r.slots[s:] for r, s in zip(reqs, starts)]
        rows, scored = self._score_rows(reqs, starts, lens)
        fb = build_batch(
            is_decode, tokens, starts, [r.slots for r in reqs], out_loc, self.device, rows
        )
        return ScheduledBatch(reqs, lens, fb, scored)

    @staticmethod
    def _score_rows(reqs, starts, lens) -> tuple[list[int] | None, list]:
        """Rows (in the flattened step) whose logits score a request's next prompt token."""
        rows: list[int] = []
        scored = []
        offset = 0
        for r, start, n in zip(reqs, starts, lens):
            if r.logprob_start is not None:
                # Position p's logits predict token p + 1; the last token predicts nothing.
                first = max(start, r.logprob_start - 1)
                last = min(start + n, r.seq_len - 1)
                if last > first:
                    rows.extend(range(offset + first - start, offset + last - start))
                    scored.append((r, first, last - first))
            offset += n
        return (rows or None), scored

    # ---- after a step -------------------------------------------------------------------

    def prefill_done(self, req: Request) -> bool:
        """After an extend step: cache the computed prefix; True when the request's whole
        sequence has KV and its logits give the next token."""
        self._cache_progress(req)
        if req.fill_len < req.seq_len:
            return False
        self.prefilling.remove(req)
        self.running.append(req)
        return True

    def release(self, req: Request) -> None:
        """A request left (finished, failed or aborted): its KV becomes evictable cache."""
        for queue in (self.prefilling, self.running):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.last_node is None:
            return
        self._cache_progress(req)
        self.cache.dec_lock_ref(req.last_node)
        req.last_node, req.slots, req.cached_len = None, EMPTY_SLOTS, 0

    def drop_uncomputed(self, req: Request, computed: int) -> None:
        """A step failed: give back the slots allocated for tokens that were not computed."""
        if req.fill_len > computed:
            self.pool.free(req.slots[computed:])
            req.slots = req.slots[:computed]

    def retract(self, req: Request) -> None:
        """Memory pressure: stop a running request; its tokens stay in the tree as evictable
        cache, and it waits to be admitted again with its output so far kept."""
        self.release(req)
        req.retractions += 1
        self.retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + NEW_TOKEN_RATIO_AFTER_RETRACT)
        self.waiting.appendleft(req)

    def _cache_progress(self, req: Request) -> None:
        """Insert the computed tokens into the radix tree and lock the new path.

        Tokens between cached_len and what the tree already held were computed twice
        (another request inserted them meanwhile): our copies are freed, the tree's kept.
        """
        key = req.all_ids[: req.fill_len]
        present = self.cache.insert(key, req.slots)
        if len(key) > present:
            self._emit("cache_insert", request=req.rid, data={"tokens": len(key) - present})
        if present > req.cached_len:
            self.pool.free(req.slots[req.cached_len : present])
        slots, node = self.cache.match_prefix(key, count=False)
        assert slots.numel() == len(key), "radix tree lost tokens just inserted"
        self.cache.inc_lock_ref(node)
        self.cache.dec_lock_ref(req.last_node)
        req.slots, req.cached_len, req.last_node = slots, len(key), node

    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
