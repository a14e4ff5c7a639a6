"""Which requests run in the next engine step, and what happens to them after it.

Continuous batching: requests join (prefill, in chunks under a token budget) and leave
(finish) at every step. A step is either an extend step (prompt chunks; only the part
of a prompt the radix cache does not hold is computed) or a decode step (one token for
every running request). Extend steps go first, so new requests start quickly.

Jump-forward and prompt lookup: a running request whose grammar forces the next text, or
whose output repeats an earlier n-gram, has draft tokens (the picker proposes them); it
goes back to an extend step for its last token and its drafts (as many as the prefill
budget leaves), then decodes again. The decodes beside it wait that step, as they do for a
prompt chunk.

Priorities (runtime.priority) and time slices: while more urgent work exists, a running
decode of a lower level is suspended once it has used its slice of decode steps (it keeps
its KV and lock, so resuming recomputes nothing), lower-level work is not admitted, and
lower-level prefills pause. Work that has waited starvation_steps steps runs one slice at
the top level, so no program waits forever. Programs under a step controller (gated) do
not count as urgent: only the debugged program waits while it is held.
"""

from __future__ import annotations

import torch

from sgl_nb.runtime.engine_config import EngineConfig
from sgl_nb.runtime.events import (
    CacheEvict,
    CacheHit,
    CacheInsert,
    Event,
    Preempted,
    Resumed,
    Retracted,
)
from sgl_nb.runtime.kv_pool import KVPool
from sgl_nb.runtime.priority import priority_name
from sgl_nb.runtime.radix_cache import RadixCache, common_prefix_len
from sgl_nb.runtime.request import EMPTY_SLOTS, Request
from sgl_nb.runtime.scheduled_batch import ScheduledBatch, make_batch

# Admission keeps room for the tokens running requests are still expected to generate:
# ratio x (their remaining max_new_tokens). The ratio starts cautious, relaxes a little at
# every decode step, and jumps back up after a retraction, so memory pressure does not
# turn into a loop of admit, retract, admit (the scheme SGLang uses).
NEW_TOKEN_RATIO_INIT, NEW_TOKEN_RATIO_MIN, NEW_TOKEN_RATIO_DECAY = 0.5, 0.1, 0.002
NEW_TOKEN_RATIO_AFTER_RETRACT = 0.3

# A waiting request that shares at least this many uncached tokens with one already
# chosen for this step waits one step, then finds that prefix in the cache.
IN_BATCH_SHARE_MIN = 32

# With at least this many requests waiting, admit the ones with the longest cached prefix
# first ("lpm"), so requests sharing a prefix run together while it is still cached. Past
# LPM_MAX_QUEUE the ranking costs more than it saves and the queue goes in arrival order.
LPM_MIN_QUEUE, LPM_MAX_QUEUE = 4, 256

# Decode steps a run takes at most where a request has stop strings (the step cannot see
# text, so the steps past one are computed for nothing: at most 7 here, where at 32 a
# 20-token answer ending at a newline could compute 12 more) or prompt lookup (its drafts
# are proposed between runs: at 32 `sgl-nb bench copy` drafted 666 tokens and lookup
# gained 1.35x; at 8, 903 and 1.61x).
SHORT_AHEAD = 8


class Scheduler:
    def __init__(self, pool: KVPool, cache: RadixCache, device: torch.device,
                 config: EngineConfig | None = None, drafts_as_decodes: bool = False):
        """drafts_as_decodes: steps of drafts only run decode-shaped (the model's fused CPU
        decode computes them; scheduled_batch.py)."""
        c = config or EngineConfig(device=str(device))
        self.pool, self.cache, self.device = pool, cache, device
        self.drafts_as_decodes = drafts_as_decodes
        # decode_ahead and prompt_lookup are read from it at each step: the engine may swap
        # it (Engine.settings); the limits below keep what they were built with.
        self.settings = c
        self.max_prefill_tokens, self.max_running = c.max_prefill_tokens, c.max_running
        self.time_slice, self.preemption = c.time_slice, c.preemption
        self.starvation_steps, self.schedule_policy = c.starvation_steps, c.schedule_policy
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []  # admitted, prompt not fully computed yet
        self.running: list[Request] = []  # decoding
        self.suspended: list[Request] = []  # preempted: KV kept and locked, not decoding
        self.boosted: set[int] = set()  # rids running one slice at the top level (starved)
        self.step_no = 0  # batches scheduled so far: the clock of slices and waits
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.retractions = self.preemptions = self.resumes = 0
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self.events = None  # the engine's EventBus: cache hits, inserts and evictions
        # Requests whose step controller refused their jump in the step being chosen: it is
        # asked once a step, so a step granted meanwhile goes to the next one, as a jump.
        self._held_now: set[int] = set()

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.suspended)

    def add(self, req: Request) -> None:
        req.waiting_since = self.step_no
        self.waiting.append(req)

    # ---- choosing a step ----------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        if self.preemption:
            self._rebalance()
        self._held_now.clear()
        batch = self._extend_batch() or self._decode_batch()
        if batch is not None:
            self.step_no += 1
        return batch

    def level(self, req: Request) -> int:
        """Its priority, or the top level for one slice once it has waited too long."""
        return 0 if req.rid in self.boosted else req.priority

    def _urgent_level(self) -> int:
        """The most urgent level of any work that could run (held programs excluded)."""
        live = [*self.waiting, *self.prefilling, *self.suspended]
        live += [r for r in self.running if r.gate is None]
        return min((self.level(r) for r in live), default=0)

    def _rebalance(self) -> None:
        """Age waiting work, suspend lower-level decodes whose slice is used up, resume
        suspended work that is the most urgent again."""
        for req in [*self.waiting, *self.suspended]:
            if self.step_no - req.waiting_since >= self.starvation_steps:
                self.boosted.add(req.rid)
        for req in self.running:
            if req.slice_used >= self.time_slice:
                self.boosted.discard(req.rid)  # its slice at the top level is over
        top = self._urgent_level()
        for req in list(self.running):
            if self.level(req) > top and req.slice_used >= self.time_slice:
                self._suspend(req, f"{priority_name(top)} work waits")
        for req in list(self.suspended):
            if self.level(req) <= top:
                self._resume(req)

    def _suspend(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        self.suspended.append(req)
        self.boosted.discard(req.rid)
        req.preemptions += 1
        req.waiting_since = self.step_no
        self.preemptions += 1
        self._emit(Preempted, req, reason=reason, priority=priority_name(req.priority))

    def _resume(self, req: Request) -> None:
        self.suspended.remove(req)
        self.running.append(req)
        req.slice_used = 0
        self.resumes += 1
        self._emit(Resumed, req, reason="scheduler")

    def _queue_order(self) -> list[Request]:
        """Waiting requests in admission order: level, then (with a long queue) the longest
        cached prefix, then arrival."""
        lpm = (self.schedule_policy == "lpm"
               and LPM_MIN_QUEUE <= len(self.waiting) <= LPM_MAX_QUEUE)
        cached = {r.rid: self.cache.cached_len(r.all_ids) for r in self.waiting} if lpm else {}
        return sorted(self.waiting, key=lambda r: (self.level(r), -cached.get(r.rid, 0), r.rid))

    def _extend_batch(self) -> ScheduledBatch | None:
        budget = self.max_prefill_tokens
        top = self._urgent_level() if self.preemption else None
        chosen: list[tuple[Request, int]] = []
        for req in list(self.prefilling):
            if budget <= 0:
                break
            if top is not None and self.level(req) > top:
                continue  # a lower-level prefill pauses while more urgent work exists
            n = min(req.seq_len - req.fill_len, budget)
            while not (grown := self._grow(req, n)) and self._retract_for(req):
                pass
            if not grown:
                break
            chosen.append((req, n))
            budget -= n
        jumps = 0  # running requests: already counted by _room_for_more
        for req in [r for r in self.running if r.draft_ids]:
            if budget <= 0:
                break
            # A stepped request is left out of the urgent level (it must not hold others
            # back), so that level may be above its own: a step granted to it runs, as its
            # decode would.
            if top is not None and self.level(req) > top and req.gate is None:
                continue
            if n := self._jump(req, budget):
                chosen.append((req, n))
                budget -= n
                jumps += 1
        # Ranking the queue reads the radix tree per request: skip it when nothing can join.
        room = budget > 0 and self._room_for_more(len(chosen) - jumps)
        queue = self._queue_order() if room else []
        for req in queue:
            if budget <= 0 or not self._room_for_more(len(chosen) - jumps):
                break
            if top is not None and self.level(req) > top:
                break  # sorted by level: everything after waits too
            if self._shares_uncached_prefix(req, [r for r, _ in chosen]):
                continue
            while (n := self._admit(req, budget)) == 0 and self._retract_for(req):
                pass
            if n == 0:
                break
            self.waiting.remove(req)
            chosen.append((req, n))
            budget -= n
        if not chosen:
            return None
        return self._make(False, chosen)

    def _jump(self, req: Request, budget: int) -> int:
        """Tokens a running request with drafts computes in this extend step (its last
        output token, then drafts, as many as the budget allows); 0: it waits or decodes."""
        n = min(req.seq_len - req.fill_len, budget)
        if not self._grow(req, n):
            self.drop_drafts(req)  # no memory for them: it decodes, as without jump-forward
            return 0
        if req.gate is not None and not req.gate():  # held by a step controller
            self.pool.free(req.slots[-n:])
            req.slots = req.slots[:-n]
            self._held_now.add(req.rid)
            return 0
        req.slice_used += 1
        return n

    def _retract_for(self, req: Request) -> bool:
        """Memory for an urgent request: retract one suspended request of a lower level (its
        tokens stay cached). True if one was retracted."""
        victims = [r for r in self.suspended if r.priority > self.level(req)]
        if not victims:
            return False
        victim = max(victims, key=lambda r: (r.priority, r.rid))
        self.retract(victim, f"memory for {priority_name(self.level(req))} work")
        return True

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
        others = self.running + self.prefilling + self.suspended
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
        self._emit(CacheHit, req, cached_tokens=prefix.numel(), prompt_tokens=len(ids))
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
            self._emit(CacheEvict, tokens=self.cache.evict(short))
        return self.pool.alloc(n)

    def _emit(self, cls: type[Event], req: Request | None = None, **fields) -> None:
        if self.events is None:
            return
        if req is not None:
            fields.update(request=req.rid, program=req.program, node=req.node)
        self.events.emit(cls, **fields)

    def _decode_batch(self) -> ScheduledBatch | None:
        if not self.running:
            return None
        # A request held by a step controller sits out this step (and keeps its KV).
        ready = [r for r in self.running
                 if r.rid not in self._held_now and (r.gate is None or r.gate())]
        if not ready:
            return None
        self._make_room_for_decode()
        self.new_token_ratio = max(
            NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        reqs = [req for req in ready if req in self.running]
        n = self._steps_ahead(reqs)
        chosen = [(req, n) for req in reqs]
        for req in reqs:
            req.slots = torch.cat([req.slots, self.pool.alloc(n)])
            req.slice_used += n  # a slice counts tokens: a decode ahead is n steps
            req.max_batch = max(req.max_batch, len(chosen))
        return self._make(True, chosen)

    def _steps_ahead(self, reqs: list[Request]) -> int:
        """Decode steps this batch computes in one forward (ForwardBatch.ahead): up to
        decode_ahead where every request's next tokens are its greedy picks and nothing
        between the steps could change them (no grammar, penalties or drafts, no step
        controller), within what each may still generate, what it has generated so far
        and the free KV; else 1."""
        # decode_ahead rows of logits over the batch: a run's rows [steps, B, vocab] are
        # fp32, and the picker reads each. Only the fused step decodes ahead.
        ahead = self.settings.decode_ahead if self.drafts_as_decodes else 1
        n = ahead // len(reqs) if reqs else 1
        for r in reqs:
            p = r.params
            if (n <= 1 or r.draft_ids or r.grammar is not None or r.gate is not None
                    or not p.greedy or p.adjusts_logits):
                return 1
            # At most as many as it has generated: a request that stops early (a stop
            # string) wastes at most the steps past its stop, and a short one few.
            n = min(n, r.max_new_tokens - len(r.output_ids), max(len(r.output_ids), 1))
            if p.stop or p.uses_prompt_lookup(self.settings.prompt_lookup):
                n = min(n, SHORT_AHEAD)
        return n if n * len(reqs) <= self.pool.available() else 1

    def _make_room_for_decode(self) -> None:
        """Every running request needs one new slot; evict cache, then retract if still short."""
        while True:
            short = len(self.running) - self.pool.available()
            if short <= 0:
                return
            freed = self.cache.evict(short)
            self._emit(CacheEvict, tokens=freed)
            if freed >= short:
                return
            if self.suspended:  # idle work gives way first
                self.retract(max(self.suspended, key=lambda r: (r.priority, r.rid)),
                             "KV pool full")
                continue
            if len(self.running) == 1:
                raise MemoryError("KV pool exhausted by a single request")  # admission prevents
            # The least urgent, most recently arrived request gives way.
            self.retract(max(self.running, key=lambda r: (r.priority, r.rid)), "KV pool full")

    def _make(self, is_decode: bool, chosen: list[tuple[Request, int]]) -> ScheduledBatch:
        if not is_decode:
            for r, n in chosen:
                if not r.draft_ids:  # a jump's tokens are output, not prompt
                    r.prefill_tokens += n
        return make_batch(is_decode, chosen, self.device, self.drafts_as_decodes)

    # ---- after a step -------------------------------------------------------------------

    def prefill_done(self, req: Request) -> bool:
        """After an extend step: cache the computed prefix; True when the request's whole
        sequence has KV and its logits give the next token."""
        self._cache_progress(req)
        if req.fill_len < req.seq_len:
            return False
        self.prefilling.remove(req)
        self.running.append(req)
        req.slice_used = 0
        return True

    def release(self, req: Request) -> None:
        """A request left (finished, failed or aborted): its KV becomes evictable cache.
        It leaves the queues last, so a reader that sees it gone sees its KV unlocked."""
        self.boosted.discard(req.rid)
        self.drop_drafts(req)
        if req.last_node is not None:
            self._cache_progress(req)
            self.cache.dec_lock_ref(req.last_node)
            req.last_node, req.slots, req.cached_len = None, EMPTY_SLOTS, 0
        for queue in (self.prefilling, self.running, self.suspended, self.waiting):
            if req in queue:
                queue.remove(req)

    def drop_drafts(self, req: Request) -> None:
        """Forget req's draft tokens, and free the KV a step computed for them."""
        req.draft_ids = []
        keep = req.committed_len
        if req.fill_len > keep:
            self.pool.free(req.slots[keep:])
            req.slots = req.slots[:keep]

    def drop_uncomputed(self, req: Request, computed: int) -> None:
        """A step failed: give back the slots allocated for tokens that were not computed."""
        if req.fill_len > computed:
            self.pool.free(req.slots[computed:])
            req.slots = req.slots[:computed]

    def retract(self, req: Request, reason: str = "KV pool full") -> None:
        """Memory pressure: stop a running request; its tokens stay in the tree as evictable
        cache, and it waits to be admitted again with its output so far kept."""
        self.release(req)
        req.retractions += 1
        self.retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + NEW_TOKEN_RATIO_AFTER_RETRACT)
        req.waiting_since = self.step_no
        self.waiting.append(req)  # its rid is old: it sorts ahead of later arrivals
        self._emit(Retracted, req, reason=reason)

    def _cache_progress(self, req: Request) -> None:
        """Insert the computed tokens into the radix tree and lock the new path.

        Tokens between cached_len and what the tree already held were computed twice
        (another request inserted them meanwhile): our copies are freed, the tree's kept.
        """
        key = req.all_ids[: req.fill_len]
        present = self.cache.insert(key, req.slots)
        if len(key) > present:
            self._emit(CacheInsert, req, tokens=len(key) - present, total=len(key))
        if present > req.cached_len:
            self.pool.free(req.slots[req.cached_len : present])
        slots, node = self.cache.match_prefix(key, count=False)
        assert slots.numel() == len(key), "radix tree lost tokens just inserted"
        self.cache.inc_lock_ref(node)
        self.cache.dec_lock_ref(req.last_node)
        req.slots, req.cached_len, req.last_node = slots, len(key), node

    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
