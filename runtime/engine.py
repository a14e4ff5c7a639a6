"""The engine: one background thread that runs the model, step by step.

A step reads as: the scheduler picks a batch (runtime/scheduler.py), the model computes
its logits (forward), the picker chooses each request's next token (runtime/token_picker.py),
and the engine applies them (postprocess: the request's text, its token event, its stream,
its end). `submit` may be called from any thread; a request's progress comes back through
its RequestHandle (runtime/request_handle.py).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from typing import NamedTuple

import torch
from transformers import AutoTokenizer

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.engine_config import EngineConfig
from sgl_nb.runtime.events import EventBus, InstructionFinished, InstructionStarted, Op, Token
from sgl_nb.runtime.grammar import GrammarCompilerCache
from sgl_nb.runtime.model.forward_batch import AheadLogits
from sgl_nb.runtime.model.load import load_model
from sgl_nb.runtime.model.model_loader import resolve_model_path
from sgl_nb.runtime.priority import PRIORITIES
from sgl_nb.runtime.radix_cache import RadixCache
from sgl_nb.runtime.request import Request
from sgl_nb.runtime.request_factory import RequestFactory
from sgl_nb.runtime.request_handle import EngineError as EngineError  # its old import path
from sgl_nb.runtime.request_handle import RequestHandle
from sgl_nb.runtime.sampler import float_cpu
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.runtime.scheduled_batch import ScheduledBatch
from sgl_nb.runtime.scheduler import Scheduler
from sgl_nb.runtime.step_threads import StepThreads
from sgl_nb.runtime.text_decoder import text_decoder
from sgl_nb.runtime.token_picker import AheadRows, PickRows, TokenPick, TokenPicker
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


class StepLogits(NamedTuple):
    """What the model returns for a step."""

    last: torch.Tensor  # [B, vocab]: each request's row at its last new token
    extra: torch.Tensor | None  # the rows the batch asked for: scored, then draft rows
    ahead: AheadLogits | None = None  # a batch that decoded ahead: every step's rows


class Engine:
    def __init__(self, settings: EngineConfig | None = None):
        self._settings = s = settings or EngineConfig()
        self.device = s.torch_device
        self.model_path = off_main_thread(lambda: resolve_model_path(s.model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.decode_text = text_decoder(self.tokenizer)  # a request's output text
        self.model = off_main_thread(lambda: load_model(
            self.model_path, dtype=s.dtype, device=self.device, quantization=s.quantization
        ))
        self.config = self.model.config
        self.eos_ids = self._eos_ids()
        self.pool = off_main_thread(lambda: self.model.new_kv_pool(s.kv_pool_tokens))
        self.requests = RequestFactory(self.config, self.tokenizer, self.eos_ids,
                                       self.pool.capacity, s)
        self.context_len = self.requests.context_len
        self.cache = RadixCache(self.pool)
        # torch's own count is read before anything sets it: extend steps keep it.
        extend_threads = torch.get_num_threads()
        fused = off_main_thread(self.model.fused_decode_ready)
        self.scheduler = Scheduler(self.pool, self.cache, self.device, s, drafts_as_decodes=fused)
        self.events = EventBus()
        self.scheduler.events = self.events
        self.cache.events, self.cache.decode = self.events, self.tokenizer.decode
        self.picker = TokenPicker(self.tokenizer, s, self.events, self.scheduler.drop_drafts)
        self._inbox: queue.Queue = queue.Queue()
        self._ahead_mark = 0  # model.ahead_mark() as the loop last drained the inbox
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
        # Tokens the grammar chose: one allowed, or a jump-forward draft the model agreed with.
        self.forced_tokens = 0
        self.started = time.monotonic()
        self.step_seconds = {"extend": 0.0, "decode": 0.0}
        self.threads = StepThreads(extend_threads=extend_threads, fused=fused)
        self._thread = threading.Thread(target=self._loop, name="sgl-nb-engine", daemon=True)
        self._thread.start()
        _live_engines.add(self)

    @property
    def settings(self) -> EngineConfig:
        return self._settings

    @settings.setter
    def settings(self, settings: EngineConfig) -> None:
        """token_alternatives, jump_forward, prompt_lookup and decode_ahead take effect from
        the next request and step (the pool, the model and the scheduler's limits keep what
        they were built with)."""
        self._settings = self.requests.settings = self.picker.settings = settings
        self.scheduler.settings = settings

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ---- called from user threads ---------------------------------------------------------

    def make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Check a request against the model and the pool; raises ValueError naming the problem."""
        return self.requests.make_request(prompt_ids, params)

    def make_score_request(self, ids: list[int], start: int) -> Request:
        """A request that returns the logprob of ids[start:] (each given what precedes it)."""
        return self.requests.make_score_request(ids, start)

    def grammars(self) -> GrammarCompilerCache:
        """Built on first use: reading the vocabulary into xgrammar takes a moment."""
        return self.requests.grammars()

    def submit(self, req: Request, stream: bool = False, on_chunk=None,
               on_done=None) -> RequestHandle:
        if self._stopping:
            raise RuntimeError("the engine has been shut down")
        handle = RequestHandle(req, stream, self, on_chunk, on_done)
        self._post(handle)
        return handle

    def _post(self, item: object) -> None:
        """Hand item to the engine thread, ending a decode ahead in progress after its
        current step so that it is seen between steps, as at a step a token."""
        self._inbox.put(item)
        self.model.interrupt_ahead()

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
        self._post(_WAKE)
        return True

    def abort_program(self, program: int) -> None:
        """Abort every request of program `program` (its Gen and Score instructions), those
        already submitted included, as `abort` does for one."""
        if not self._stopping:
            self._abort_programs.add(program)
            self._post(_WAKE)

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

        self._post(flush)
        return done.result(timeout)

    def shutdown(self) -> None:
        """Stop the engine thread and join it (it finishes the step it is in); requests still
        running or queued fail with an error naming the shutdown."""
        self._stopping = True
        self._post(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def wake(self) -> None:
        """Re-check held work now (a step controller granted a step)."""
        self._post(_WAKE)

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
                    # Its KV was computed (a failed forward is handled in _forward): nothing
                    # to give back by hand. (Freeing slots a finished prefill had already put
                    # into the radix tree freed them twice.)
                    if req.rid in self._handles:
                        self._finish(req, error=e)
        self._fail_all(RuntimeError("the engine was shut down"))

    def _drain(self, timeout: float | None) -> bool:
        """Move submitted requests into the scheduler, waiting up to timeout (None: until
        something arrives) for the first; False once shut down."""
        self._ahead_mark = self.model.ahead_mark()
        try:
            item = self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
            # What is posted from here on and not drained below ends the next decode ahead
            # early (the wake-up that brought item must not).
            self._ahead_mark = self.model.ahead_mark()
            while True:
                if item is None:
                    return False
                if callable(item):  # engine-thread work (flush_cache)
                    item()
                elif item is not _WAKE:
                    self._handles[item.req.rid] = item
                    self.scheduler.add(item.req)
                    if item.req.instruction is None:  # else the executor reports it
                        self._emit_instruction(InstructionStarted, item.req)
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
                req.text = self.decode_text(req.output_ids)
            self.aborted += 1
            self._finish(req)

    def _step(self, batch: ScheduledBatch) -> None:
        """One scheduled batch: forward, pick tokens, postprocess."""
        logits = self._forward(batch)
        if logits is None:
            return  # the forward pass failed: its requests finished with the error
        for pick in self.picker.pick(self._rows_to_pick(batch, logits)):
            self._postprocess(pick)

    def _forward(self, batch: ScheduledBatch) -> StepLogits | None:
        """The model's logits for the batch; None when the forward pass failed (each of
        its requests then finished with the error, the slots of tokens not computed given
        back)."""
        computed = [r.fill_len - n for r, n in zip(batch.reqs, batch.new_lens)]
        if self.device.type == "cpu":
            self.threads.use_for(batch.forward.is_decode)
        t0 = time.perf_counter()
        ahead = batch.forward.ahead
        try:
            if ahead > 1:
                rows = self.model.forward_ahead(batch.forward, self.pool,
                                                self._stop_ids(batch.reqs), self._ahead_mark,
                                                self.settings.token_alternatives)
                logits = StepLogits(rows.rows[-1], None, rows)
                ahead = rows.rows.shape[0]  # the steps it ran
            else:
                out = self.model.forward(batch.forward, self.pool)
                logits = StepLogits(*out) if isinstance(out, tuple) else StepLogits(out, None)
        except Exception as e:
            log.exception("model step failed")
            for req, done in zip(batch.reqs, computed):
                self.scheduler.drop_uncomputed(req, done)
                self._finish(req, error=e)
            return None
        kind = "decode" if batch.is_decode else "extend"
        seconds = time.perf_counter() - t0
        self.steps[kind] += ahead  # a decode ahead is that many decode steps
        self.step_seconds[kind] += seconds
        costs = self.picker.lookup.costs
        if batch.is_decode:
            costs.add_decode(seconds / ahead)
        elif all(r.draft_ids for r in batch.reqs):  # a verify
            costs.add_verify(seconds, sum(batch.new_lens))
        return logits

    def _rows_to_pick(self, batch: ScheduledBatch, logits: StepLogits) -> PickRows:
        """After the forward pass: score rows recorded, computed prompt tokens cached,
        scoring requests finished; the rows that pick a token. A prompt chunk that is not
        the last has nothing to pick; a request with drafts (jump-forward) is picked row by
        row."""
        if logits.ahead is not None:
            return PickRows(logits.last, [], [], self._ahead_rows(batch, logits.ahead))
        if batch.scored:
            self._record_scores(batch, logits.extra)
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
        return PickRows(logits.last, ready, [
            (r, float_cpu(batch.draft_logits(i, logits.last, logits.extra)))
            for i, r in drafted])

    def _stop_ids(self, reqs: list[Request]) -> list[int]:
        """The tokens that end a request of reqs (a decode ahead stops once each picks one)."""
        return sorted(frozenset().union(*(r.stop_tokens for r in reqs)))

    @staticmethod
    def _ahead_rows(batch: ScheduledBatch, ahead: AheadLogits) -> tuple[AheadRows, ...]:
        """A decode ahead: each request's later inputs become its drafts (their KV is
        computed), its rows one per step for the picker to check them (with their
        alternatives, where the step computed them)."""
        tokens = ahead.tokens.t().tolist()
        for r, drafts in zip(batch.reqs, tokens):
            r.draft_ids = drafts
        n = len(batch.reqs)
        alts = ahead.alternatives
        return tuple(AheadRows(r, ahead.rows[:, b], None if alts is None else tuple(
            part[b::n] for part in alts)) for b, r in enumerate(batch.reqs))

    def _postprocess(self, pick: TokenPick) -> None:
        """One pick into its request: text, events, stream, finish."""
        req = pick.req
        if pick.error is not None:
            self._finish(req, error=pick.error)
            return
        try:
            req.append(pick.sampled, self.decode_text)
        except Exception as e:  # noqa: BLE001 - e.g. a grammar that rejects the token
            self._finish(req, error=e)
            return
        self.generated_tokens += 1
        self.forced_tokens += pick.forced
        if pick.choice is not None:
            req.token_choices.append(pick.choice)
        if self.events.active:
            token, choice = pick.sampled.token, pick.choice
            self.events.emit(Token, request=req.rid, program=req.program, node=req.node,
                             token=token, logprob=pick.sampled.logprob,
                             step=self.scheduler.step_no, text=self.picker.token_text(token),
                             forced=pick.forced, drafted=pick.drafted, allowed=pick.allowed,
                             top=[a.to_json() for a in choice.top] if choice is not None else ())
        handle = self._handles.get(req.rid)
        if handle is not None:
            handle.push_text(req.take_delta())
        if req.finished:
            self._finish(req)

    def _record_scores(self, batch: ScheduledBatch, scored_logits: torch.Tensor) -> None:
        n_scored = sum(s.n for s in batch.scored)  # jump-forward's rows come after
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
        self.picker.lookup.forget(req.rid)
        if req.instruction is None:
            self._emit_instruction(InstructionFinished, req)
        handle = self._handles.pop(req.rid, None)
        if handle is not None:
            handle.push_text(req.take_delta())
            handle.mark_done()

    def _emit_instruction(self, cls: type[InstructionStarted | InstructionFinished],
                          req: Request) -> None:
        """A request submitted bare (rt.generate, rt.score: no program's Instruction) is
        reported as the Decode or Score it is."""
        fields = {"op": Op.SCORE if req.logprob_start is not None else Op.DECODE,
                  "index": req.index}
        if cls is InstructionFinished:
            fields["usage"] = req.usage()  # a failure: its "error"
        self.events.emit(cls, request=req.rid, program=req.program, node=req.node, **fields)

    def _fail_all(self, error: BaseException) -> None:
        for handle in list(self._handles.values()):
            self._finish(handle.req, error=error)

    # ---- statistics -----------------------------------------------------------------------

    def metrics(self) -> dict:
        """Scheduler figures; read from any thread (list copies are atomic under the GIL)."""
        sch, jumps, lookups = self.scheduler, self.picker.jumps, self.picker.lookups
        aheads = self.picker.aheads
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
            "forced_tokens": self.forced_tokens,
            "jump_forward_drafted": jumps.drafted,
            "jump_forward_tokens": jumps.accepted,
            "jump_forward_steps_saved": jumps.steps_saved,
            "prompt_lookup_drafted": lookups.drafted,
            "prompt_lookup_accepted": lookups.accepted,
            "prompt_lookup_steps_saved": lookups.steps_saved,
            "decode_ahead_drafted": aheads.drafted,
            "decode_ahead_accepted": aheads.accepted,
            "decode_ahead_steps_saved": aheads.steps_saved,
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
