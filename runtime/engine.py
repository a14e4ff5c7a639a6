"""The engine: one background thread that schedules, runs the model and samples, step by step.

`submit` may be called from any thread; a request's progress comes back through its
RequestHandle (runtime/request_handle.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import warnings
import weakref
from concurrent.futures import Future

import torch
from transformers import AutoTokenizer

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.engine_config import EngineConfig
from sgl_nb.runtime.events import EventBus
from sgl_nb.runtime.grammar import GrammarCompilerCache, GrammarError
from sgl_nb.runtime.model.load import load_model
from sgl_nb.runtime.model.model_loader import resolve_model_path
from sgl_nb.runtime.penalties import adjust_logits
from sgl_nb.runtime.priority import PRIORITIES
from sgl_nb.runtime.radix_cache import RadixCache
from sgl_nb.runtime.request import Request
from sgl_nb.runtime.request_handle import EngineError as EngineError  # its old import path
from sgl_nb.runtime.request_handle import RequestHandle
from sgl_nb.runtime.sampler import Sampled, sample, top_alternatives
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.runtime.scheduler import ScheduledBatch, Scheduler
from sgl_nb.runtime.token_choice import Alternative, TokenChoice
from sgl_nb.runtime.token_usage import TokenUsage

log = logging.getLogger("sgl_nb.engine")
_WAKE = object()
# While every runnable request is held by a step controller, look again this often (a
# grant also wakes the loop at once).
STALLED_POLL_S = 0.05


def off_main_thread(fn):
    """Run fn on a short-lived thread and return (or raise) what it does.

    libgomp keeps an OpenMP worker pool per thread that ever ran a parallel region; once
    the caller's thread has one, the engine thread's own parallel regions slowed down
    (measured on 2 cores: prefill 3.3 s -> 2.6 s and decode 5% faster with the loading
    moved off the main thread). The pool of a thread that exits goes with it."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="sgl-nb-load")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


_live_engines: weakref.WeakSet = weakref.WeakSet()


def shutdown_all() -> None:
    """Stop every engine of the process and the CPU kernels' worker threads, and join them.

    Runs at interpreter exit, before Python tears itself down: an engine thread still inside
    a step when the interpreter finalizes is ended by it mid-call, which aborts the process
    from C++ ("terminate called without an active exception"). Requests still running
    finish with an error naming the shutdown, so threads waiting on them return."""
    for engine in list(_live_engines):
        engine.shutdown()
    cpu_decode.stop_workers()


# threading's own exit hook runs before non-daemon threads are joined (a thread waiting on
# a request would otherwise keep the process from exiting); atexit as the fallback.
_register_exit = getattr(threading, "_register_atexit", atexit.register)
_register_exit(shutdown_all)


def capped_context_len(model_context: int, pool_tokens: int) -> int:
    """The longest request (prompt + new tokens) the engine takes: the model's context, or
    the KV pool's capacity where that is smaller (a request must fit the pool), said once."""
    if model_context <= pool_tokens:
        return model_context
    warnings.warn(
        f"the model's context ({model_context} tokens, max_position_embeddings) is longer "
        f"than the KV pool ({pool_tokens} tokens): requests are capped at {pool_tokens} "
        "tokens; raise kv_pool_tokens for longer ones", stacklevel=4,  # the Runtime(...) call
    )
    return pool_tokens


class Engine:
    def __init__(self, settings: EngineConfig | None = None):
        self.settings = s = settings or EngineConfig()
        self.device = s.torch_device
        self.model_path = off_main_thread(lambda: resolve_model_path(s.model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.model = off_main_thread(lambda: load_model(
            self.model_path, dtype=s.dtype, device=self.device, quantization=s.quantization
        ))
        self.config = self.model.config
        self.eos_ids = self._eos_ids()
        self.pool = off_main_thread(lambda: self.model.new_kv_pool(s.kv_pool_tokens))
        self.context_len = capped_context_len(self.config.max_position_embeddings,
                                              self.pool.capacity)
        self.cache = RadixCache(self.pool)
        self.scheduler = Scheduler(self.pool, self.cache, self.device, s)
        self.events = EventBus()
        self.scheduler.events = self.events
        self._grammars: GrammarCompilerCache | None = None
        self._grammar_lock = threading.Lock()
        # Token id -> its text, decoded once: every step names k alternatives (a decode
        # is ~2 us, a lookup a tenth of that).
        self._token_texts: dict[int, str] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._handles: dict[int, RequestHandle] = {}
        # Request ids to abort, added from any thread; the engine thread applies them
        # between steps (a set's add/discard are atomic under the GIL).
        self._aborts: set[int] = set()
        self._abort_programs: set[int] = set()
        self.aborted = 0
        self.token_usage = TokenUsage()
        self._stopping = False
        self.steps = {"extend": 0, "decode": 0}
        self.generated_tokens = 0
        # Tokens the grammar chose (one allowed, or a jump-forward draft the model agreed
        # with), draft tokens proposed and taken, and decode steps the jumps saved.
        self.forced = {"tokens": 0, "drafted": 0, "accepted": 0, "steps_saved": 0}
        self.started = time.monotonic()
        self.step_seconds = {"extend": 0.0, "decode": 0.0}
        # On CPU the torch decode path (~35 small ops per layer, each its own OpenMP region)
        # ran slower on two threads than on one from a thread other than the main one (81
        # vs 55 ms per step at batch 1); the fused step (kernels/cpu_decode.cpp) gains from
        # every core (int4: 24 -> 10 ms). Prefill always does. Where that module runs (its
        # own threads: every matmul, and the whole decode step) torch gets one thread, as
        # an OpenMP worker spinning between torch ops took the second core from ours (int4
        # decode 19 vs 10 ms per step; bf16 16-request workload 6.4 vs 5.8 s, measured).
        self.extend_threads = torch.get_num_threads()
        fused = off_main_thread(self.model.fused_decode_ready)
        default = self.extend_threads if fused else 1
        self.decode_threads = int(os.environ.get("SGL_NB_DECODE_THREADS", default))
        self._fused = fused
        # The C++ module's thread count, set when it changes (not every step).
        self._kernel_threads = cpu_decode.load() if fused else None
        self._kernel_threads_now = 0
        self._thread = threading.Thread(target=self._loop, name="sgl-nb-engine", daemon=True)
        self._thread.start()
        _live_engines.add(self)

    def _pool_cap_note(self) -> str:
        if self.context_len >= self.config.max_position_embeddings:
            return ""
        return (f": it can never fit the KV pool of {self.pool.capacity} tokens, which caps "
                "the context; raise kv_pool_tokens")

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ---- called from user threads ---------------------------------------------------------

    def make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Check a request against the model and the pool; raises ValueError naming the problem."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty prompt: give at least one token")
        if any(not isinstance(t, int) or not 0 <= t < self.config.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.config.vocab_size})")
        if n >= self.context_len:
            raise ValueError(
                f"prompt is {n} tokens, longer than the model's context of {self.context_len} "
                f"tokens (leave room for at least one new token){self._pool_cap_note()}"
            )
        if params.top_logprobs > self.config.vocab_size:
            raise ValueError(f"top_logprobs must be at most the vocabulary size "
                             f"({self.config.vocab_size}), got {params.top_logprobs}")
        outside = sorted(t for t in params.logit_bias if t >= self.config.vocab_size)
        if outside:
            raise ValueError(f"logit_bias: token ids {outside[:5]} are outside the model's "
                             f"vocabulary [0, {self.config.vocab_size})")
        # Trimmed to the model's own context; past the pool's it is an error saying so.
        max_new = min(params.max_tokens, self.config.max_position_embeddings - n)
        if n + max_new > self.pool.capacity:
            raise ValueError(
                f"request can never fit the KV pool: prompt {n} + max_tokens {max_new} tokens "
                f"> pool capacity {self.pool.capacity} tokens; lower max_tokens or raise "
                "kv_pool_tokens"
            )
        req = Request(list(prompt_ids), params, max_new)
        if self.settings.token_alternatives:
            req.token_choices = []
        if params.regex is not None or params.json_schema is not None:
            req.grammar = self.grammars().matcher(params.regex, params.json_schema)
        return req

    def grammars(self) -> GrammarCompilerCache:
        """Built on first use: reading the vocabulary into xgrammar takes a moment."""
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompilerCache(
                    self.tokenizer, self.config.vocab_size, list(self.eos_ids)
                )
            return self._grammars

    def make_score_request(self, ids: list[int], start: int) -> Request:
        """A request that returns the logprob of ids[start:] (each given what precedes it)."""
        if not 1 <= start < len(ids):
            raise ValueError(f"scored tokens must start in [1, {len(ids)}), got {start}")
        req = self.make_request(ids, SamplingParams(max_tokens=1))
        req.logprob_start = start
        return req

    def submit(self, req: Request, stream: bool = False, on_chunk=None,
               on_done=None) -> RequestHandle:
        if self._stopping:
            raise RuntimeError("the engine has been shut down")
        handle = RequestHandle(req, stream, self, on_chunk, on_done)
        self._inbox.put(handle)
        return handle

    def alive(self) -> bool:
        """Whether the engine thread is serving (a health check reads it)."""
        return self._thread.is_alive() and not self._stopping

    def abort(self, rid: int) -> bool:
        """Abort request `rid` (from any thread): before the next step it leaves the batch,
        its KV is unlocked (its tokens stay in the radix tree as evictable cache) and it
        finishes with finish_reason "abort" and the text generated so far. False if no such
        request is running or queued."""
        if self._stopping:
            return False
        self._aborts.add(rid)
        self._inbox.put(_WAKE)
        return True

    def abort_program(self, program: int) -> None:
        """Abort every request of program `program` (its Gen and Score instructions), those
        already submitted included, as `abort` does for one."""
        if not self._stopping:
            self._abort_programs.add(program)
            self._inbox.put(_WAKE)

    def flush_cache(self, timeout: float | None = 60.0) -> int:
        """Free every cached prefix no running request holds (held ones stay: their
        requests read those slots); the tokens freed. Runs on the engine thread, between
        steps, as everything that touches the cache does."""
        if self._stopping:
            raise RuntimeError("the engine has been shut down")
        done: Future = Future()

        def flush() -> None:
            before = self.cache.total_size()
            self.cache.reset()
            done.set_result(before - self.cache.total_size())

        self._inbox.put(flush)
        return done.result(timeout)

    def shutdown(self) -> None:
        """Stop the engine thread and join it (it finishes the step it is in); requests still
        running or queued fail with an error naming the shutdown."""
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # ---- the engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        stalled = False  # work exists but none may run now (a stepped program is held)
        while True:
            if stalled:
                wait = STALLED_POLL_S
            else:
                wait = None if not self.scheduler.has_work() else 0
            if not self._drain(wait):
                break
            try:
                batch = self.scheduler.schedule()
            except Exception as e:  # a scheduler bug must not kill the loop silently
                log.exception("scheduling failed")
                self._fail_all(e)
                continue
            stalled = batch is None
            if batch is None:
                continue
            try:
                self._step(batch)
            except Exception as e:  # a bug past the forward pass: fail this batch, serve on
                log.exception("engine step failed")
                for req in batch.reqs:
                    # Its KV was computed (a failed forward is handled in _step): nothing to
                    # give back by hand. (Freeing slots a finished prefill had already put
                    # into the radix tree freed them twice.)
                    if req.rid in self._handles:
                        self._finish(req, error=e)
        self._fail_all(RuntimeError("the engine was shut down"))

    def _drain(self, timeout: float | None) -> bool:
        """Move submitted requests into the scheduler, waiting up to timeout (None: until
        something arrives) for the first; False once shut down."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
            while True:
                if item is None:
                    return False
                if callable(item):  # engine-thread work (flush_cache)
                    item()
                elif item is not _WAKE:
                    self._handles[item.req.rid] = item
                    self.scheduler.add(item.req)
                    if item.req.instruction is None:  # else the executor reports it
                        self._emit_instruction("instruction_started", item.req)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        if self._aborts or self._abort_programs:
            self._apply_aborts()
        return True

    def _apply_aborts(self) -> None:
        programs = list(self._abort_programs)
        self._abort_programs.difference_update(programs)
        rids = {rid for rid, h in self._handles.items() if h.req.program in programs}
        for rid in list(self._aborts):
            self._aborts.discard(rid)
            rids.add(rid)
        for rid in rids:
            handle = self._handles.get(rid)
            if handle is None:
                continue  # finished meanwhile: nothing to abort
            req = handle.req
            req.finish_reason = "abort"
            if req.output_ids:  # the exact text of what was generated, as on a stop
                req.text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            self.aborted += 1
            self._finish(req)

    def _set_threads(self, decode: bool) -> None:
        want = self.decode_threads if decode else self.extend_threads
        torch_threads = 1 if self._fused else want
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        if self._kernel_threads is not None and self._kernel_threads_now != want:
            self._kernel_threads.set_num_threads(want)
            self._kernel_threads_now = want

    def wake(self) -> None:
        """Re-check held work now (a step controller granted a step)."""
        self._inbox.put(_WAKE)

    def _step(self, batch: ScheduledBatch) -> None:
        computed = [r.fill_len - n for r, n in zip(batch.reqs, batch.new_lens)]
        if self.device.type == "cpu":
            self._set_threads(batch.is_decode)
        t0 = time.perf_counter()
        try:
            logits = self.model.forward(batch.forward, self.pool)
        except Exception as e:
            log.exception("model step failed")
            for req, done in zip(batch.reqs, computed):
                self.scheduler.drop_uncomputed(req, done)
                self._finish(req, error=e)
            return
        kind = "decode" if batch.is_decode else "extend"
        self.steps[kind] += 1
        self.step_seconds[kind] += time.perf_counter() - t0
        last, extra = logits if isinstance(logits, tuple) else (logits, None)
        if batch.scored:
            self._record_scores(batch, extra)
        # Requests with draft tokens (jump-forward) are checked row by row; a prompt chunk
        # that is not the last has nothing to sample.
        drafted = [(i, r) for i, r in enumerate(batch.reqs) if r.draft_ids]
        ready = []
        for i, r in enumerate(batch.reqs):
            if r.draft_ids or not (batch.is_decode or self.scheduler.prefill_done(r)):
                continue
            if r.logprob_start is not None:  # scored, nothing to generate: done
                r.finish_reason = "score"
                self._finish(r)
            else:
                ready.append((i, r))
        if ready:
            self._sample_ready(last, ready)
        rows_of = {r.rid: (first, n) for r, first, n in batch.drafts}
        for i, r in drafted:
            first, n = rows_of.get(r.rid, (0, 0))
            rows = last[i : i + 1] if n == 0 else torch.cat([extra[first : first + n],
                                                               last[i : i + 1]])
            self._take_drafted(r, rows.float().cpu())

    def _sample_ready(self, last: torch.Tensor, ready: list[tuple[int, Request]]) -> None:
        """One token for each request from its last row of logits, sampled together."""
        reqs = [r for _, r in ready]
        if len(ready) < last.shape[0]:
            last = last[torch.tensor([i for i, _ in ready], device=last.device)]
        rows, reqs, top = self._masked_rows(last.float().cpu(), reqs)
        if not reqs:
            return
        sampled = sample(rows, [r.params for r in reqs], [r.generator for r in reqs],
                         all_logprobs=self.events.active)
        alts = top.lists(rows, [s.token for s in sampled]) if top is not None else None
        for b, (req, s) in enumerate(zip(reqs, sampled)):
            self._take(req, s, alts[b] if alts else None)
            self._propose_drafts(req)

    def _take_drafted(self, req: Request, rows: torch.Tensor) -> None:
        """A request that had draft tokens: rows[j] are the logits after its j-th new token.
        Each row picks the next token exactly as a decode step would (penalties, grammar
        mask, sampler, seeded generator in the same order), so the output is the one token
        by token decoding gives. While the pick is the next draft, the draft is taken
        (forced); the first pick that differs is taken instead, and the drafts after it are
        dropped with their KV."""
        taken = 0
        for j in range(rows.shape[0]):
            row, kept, top = self._masked_rows(rows[j : j + 1], [req])
            if not kept:
                return  # its penalties or grammar failed: finished with the error
            s = sample(row, [req.params], [req.generator], all_logprobs=self.events.active)[0]
            s.forced = s.token == req.draft_ids[0] if req.draft_ids else False
            if s.forced:
                req.draft_ids.pop(0)
                self.forced["accepted"] += 1
            else:
                self.scheduler.drop_drafts(req)
            self._take(req, s, top.lists(row, [s.token])[0] if top is not None else None)
            taken += 1
            if req.finished or not s.forced:
                break  # the rows after a pick of its own belong to dropped drafts
        self.forced["steps_saved"] += max(taken - 1, 0)
        if not req.draft_ids:
            self._propose_drafts(req)

    def _propose_drafts(self, req: Request) -> None:
        """Jump-forward: the tokens of the text req's grammar forces next become its drafts,
        computed by its next step together with its last token."""
        on = req.params.jump_forward
        if req.grammar is None or req.finished or not (
                self.settings.jump_forward if on is None else on):
            return
        req.draft_ids = req.grammar.jump_forward(
            self.tokenizer, req.max_new_tokens - len(req.output_ids))
        self.forced["drafted"] += len(req.draft_ids)

    # A request whose own logits or grammar go wrong fails alone: the rest of its batch
    # goes on, and its KV (all computed by then) is released as for any other end.

    def _masked_rows(self, rows: torch.Tensor, reqs: list[Request]):
        """Penalties, then the top alternatives (TopK, or None when not recorded), then
        the grammar masks, on each request's row of logits: the rows, requests and
        alternatives of those that still have a token to sample. The alternatives come
        between the two so that they show what the model offered, masked or not."""
        keep = self._rows_that(self._penalize, rows, range(len(reqs)), reqs)
        k = self.settings.token_alternatives
        top = top_alternatives(rows, k) if k else None  # the whole batch at once
        grammars = [i for i in keep if reqs[i].grammar is not None]
        if grammars:
            failed = set(grammars) - set(self._rows_that(self._mask, rows, grammars, reqs))
            keep = [i for i in keep if i not in failed]
            if top is not None:
                top.mark_masked(rows)
        if len(keep) < len(reqs):
            rows, reqs = rows[keep], [reqs[i] for i in keep]
            top = top.select(keep) if top is not None else None
        return rows, reqs, top

    def _rows_that(self, fn, rows: torch.Tensor, which, reqs: list[Request]) -> list[int]:
        """fn(row, request) for each row in `which`; those it did not fail on (a request
        whose own logits or grammar go wrong finishes with the error)."""
        ok = []
        for i in which:
            try:
                fn(rows[i], reqs[i])
            except Exception as e:  # noqa: BLE001 - handed to the request's caller
                self._finish(reqs[i], error=e)
                continue
            ok.append(i)
        return ok

    def _penalize(self, row: torch.Tensor, r: Request) -> None:
        p = r.params
        if p.adjusts_logits:
            stops = [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_ids)]
            adjust_logits(row, p, r.prompt_ids, r.output_ids, stops)

    def _mask(self, row: torch.Tensor, r: Request) -> None:
        p = r.params
        if r.grammar is not None:
            r.grammar.mask(row)
            if r.grammar.allowed == 0:
                what = f"regex {p.regex!r}" if p.regex is not None else "JSON schema"
                raise GrammarError(
                    f"request {r.rid}: its {what} allows no next token after "
                    f"{len(r.output_ids)} generated ({r.text[-40:]!r}): no token of the "
                    "model's vocabulary continues it")

    def _take(self, req: Request, s: Sampled, alts: tuple | None = None) -> None:
        """One sampled token into its request: text, events, stream, finish. alts: its
        row of TopK.lists (None when alternatives are not recorded)."""
        if s.error is not None:  # its own sampling parameters: a ValueError, like bad input
            self._finish(req, error=ValueError(f"request {req.rid}: {s.error}"))
            return
        try:
            req.append(s, self.eos_ids, self.tokenizer)
        except Exception as e:  # noqa: BLE001 - e.g. a grammar that rejects the token
            self._finish(req, error=e)
            return
        self.generated_tokens += 1
        forced = s.forced or (req.grammar is not None and req.grammar.forced)
        self.forced["tokens"] += forced
        allowed = req.grammar.allowed if req.grammar is not None else -1
        choice = None
        if alts is not None and req.token_choices is not None:
            choice = self._choice(s.token, forced, allowed, alts)
            req.token_choices.append(choice)
        if self.events.active:
            data = {"token": s.token, "logprob": s.logprob, "step": self.scheduler.step_no,
                    "text": self._token_text(s.token), "forced": forced, "allowed": allowed}
            if choice is not None:
                data["top"] = [a.to_json() for a in choice.top]
            self.events.emit("token", request=req.rid, program=req.program, node=req.node,
                             data=data)
        handle = self._handles.get(req.rid)
        if handle is not None:
            handle.push_text(req.take_delta())
        if req.finished:
            self._finish(req)

    def _choice(self, token: int, forced: bool, allowed: int, alts: tuple) -> TokenChoice:
        ids, logprobs, masked, chosen = alts
        text = self._token_text
        top = [Alternative(t, text(t), lp, m) for t, lp, m in zip(ids, logprobs, masked)]
        return TokenChoice(token, text(token), chosen, forced, allowed, top)

    def _token_text(self, token: int) -> str:
        """One token's own text (as the token event has always given it), decoded once."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _record_scores(self, batch: ScheduledBatch, scored_logits: torch.Tensor) -> None:
        n_scored = sum(n for _, _, n in batch.scored)  # jump-forward's rows come after
        logp = torch.log_softmax(scored_logits[:n_scored].float(), -1)
        row = 0
        for req, first, n in batch.scored:
            targets = torch.tensor(req.all_ids[first + 1 : first + 1 + n], device=logp.device)
            got = logp[row : row + n].gather(1, targets[:, None])[:, 0]
            req.input_logprobs.extend(got.tolist())
            row += n

    def _finish(self, req: Request, error: BaseException | None = None) -> None:
        if error is not None:
            req.error, req.finish_reason = error, "error"
        self.token_usage.add(len(req.prompt_ids), len(req.output_ids))
        self.scheduler.release(req)
        if req.instruction is None:
            self._emit_instruction("instruction_finished", req)
        handle = self._handles.pop(req.rid, None)
        if handle is not None:
            handle.push_text(req.take_delta())
            handle.mark_done()

    def _emit_instruction(self, kind: str, req: Request) -> None:
        """A request submitted bare (rt.generate, rt.score: no program's Instruction) is
        reported as the Decode or Score it is."""
        data = {"kind": "Score" if req.logprob_start is not None else "Decode",
                "index": req.index}
        if kind == "instruction_finished":
            data.update(req.usage())
        self.events.emit(kind, request=req.rid, program=req.program, node=req.node, data=data)

    def _fail_all(self, error: BaseException) -> None:
        for handle in list(self._handles.values()):
            self._finish(handle.req, error=error)

    # ---- statistics -----------------------------------------------------------------------

    def metrics(self) -> dict:
        """Scheduler figures; read from any thread (list copies are atomic under the GIL)."""
        sch = self.scheduler
        queued = list(sch.waiting) + list(sch.suspended)
        busy = sum(self.step_seconds.values())
        return {
            "waiting": len(sch.waiting), "prefilling": len(sch.prefilling),
            "running": len(sch.running), "suspended": len(sch.suspended),
            "queued_by_priority": {name: sum(r.priority == level for r in queued)
                                   for name, level in PRIORITIES.items()},
            "cache_hit_rate": sch.hit_rate(),
            "preemptions": sch.preemptions, "resumes": sch.resumes,
            "retractions": sch.retractions, "aborted": self.aborted,
            "forks": self.events.counts["fork"], "joins": self.events.counts["join"],
            "generated_tokens": self.generated_tokens,
            "forced_tokens": self.forced["tokens"],
            "jump_forward_drafted": self.forced["drafted"],
            "jump_forward_tokens": self.forced["accepted"],
            "jump_forward_steps_saved": self.forced["steps_saved"],
            "tokens_per_second": self.generated_tokens / busy if busy else 0.0,
            "steps": dict(self.steps), "busy_seconds": round(busy, 3),
            "uptime_seconds": round(time.monotonic() - self.started, 3),
            "time_slice": sch.time_slice, "preemption": sch.preemption,
        }

    def cache_stats(self) -> dict:
        s = self.cache.stats()
        s.update(
            prompt_tokens=self.scheduler.prompt_tokens,
            cached_prompt_tokens=self.scheduler.cached_prompt_tokens,
            prompt_hit_rate=self.scheduler.hit_rate(),
            kv_pool_capacity=self.pool.capacity,
            kv_pool_used=self.pool.used(),
            retractions=self.scheduler.retractions,
            steps=dict(self.steps),
            step_seconds={k: round(v, 3) for k, v in self.step_seconds.items()},
            time=time.time(),
        )
        return s
