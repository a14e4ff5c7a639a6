"""The preemptive scheduler on the real model: priorities, time slices, suspend/resume,
memory pressure, cache-aware order, fairness, bad input. Checks order of events, not times."""

from __future__ import annotations

import threading

import pytest
from support.waits import WAIT, until

import sgl_nb as sgl
from sgl_nb import Runtime

pytestmark = pytest.mark.slow

BATCH_PROMPTS = [f"Write a long story about a {w}." for w in
                 ("cat", "dog", "ship", "tree", "robot", "river", "castle", "violin")]


def _drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get())
    return out


def _start_batch_jobs(rt: Runtime, max_tokens: int) -> list:
    return [rt.submit(p, max_tokens=max_tokens, ignore_eos=True, priority="batch")
            for p in BATCH_PROMPTS]


def _wait_running(rt: Runtime, n: int) -> None:
    """Until n requests decode (so the interactive one arrives into a full batch)."""
    until(lambda: rt.metrics()["running"] >= n and rt.metrics()["steps"]["decode"] >= 6,
          f"{n} requests decoding")


def _interactive_under_load(model_path, preemption: bool):
    with Runtime(model_path, kv_pool_tokens=4096, max_running=8, time_slice=4,
                 preemption=preemption) as rt:
        q = rt.events.subscribe()
        batch = _start_batch_jobs(rt, max_tokens=48)
        _wait_running(rt, 8)
        steps_at_submit = rt.metrics()["steps"]
        handle = rt.submit("Quick: what is 2 + 2?", max_tokens=8, ignore_eos=True,
                           priority="interactive")
        out = handle.result(timeout=WAIT)
        batch_outs = [h.result(timeout=WAIT) for h in batch]
        return out, batch_outs, _drain(q), steps_at_submit, rt.metrics(), handle.req.rid


def test_interactive_preempts_batch_and_waits_without_preemption(model_path, runtime):
    out, batch_outs, events, _, metrics, rid = _interactive_under_load(model_path, True)
    batch_rids = {o.meta["id"] for o in batch_outs}
    finished = [e for e in events if e.kind == "instruction_finished"]
    first_batch_done = next(i for i, e in enumerate(finished) if e.request in batch_rids)
    assert finished[0].request == rid, "the interactive request finished after a batch job"
    assert first_batch_done > 0
    # Admitted within one time slice: at most time_slice decode steps of the batch between
    # the interactive request arriving (instruction_started) and its cache lookup.
    seq_start = next(e.seq for e in events if e.kind == "instruction_started" and
                     e.request == rid)
    seq_admit = next(e.seq for e in events if e.kind == "cache_hit" and e.request == rid)
    batch_steps = {e.step for e in events if e.kind == "token" and
                   e.request in batch_rids and seq_start < e.seq < seq_admit}
    assert len(batch_steps) <= 4, batch_steps
    preempted = [e for e in events if e.kind == "preempted"]
    assert preempted and all(e.request in batch_rids for e in preempted)
    assert all(e.reason and e.priority == "batch" for e in preempted)
    assert metrics["preemptions"] == len(preempted) > 0
    assert metrics["resumes"] > 0

    # Suspend and resume: no recomputation (no prompt token computed twice) and the greedy
    # output equals an uninterrupted run's.
    for o in batch_outs:
        assert o.meta["preemptions"] > 0 and o.meta["retractions"] == 0
        assert o.meta["prefill_tokens"] == o.meta["prompt_tokens"] - o.meta["cached_tokens"]
    alone = runtime.generate(BATCH_PROMPTS, max_tokens=48, ignore_eos=True)
    assert [o.token_ids for o in batch_outs] == [o.token_ids for o in alone]
    assert out.token_ids == runtime.generate("Quick: what is 2 + 2?", max_tokens=8,
                                             ignore_eos=True).token_ids

    # Preemption off: the interactive request waits for a free place in the batch.
    _, batch_outs, events, _, metrics, rid = _interactive_under_load(model_path, False)
    finished = [e.request for e in events if e.kind == "instruction_finished"]
    assert finished.index(rid) > 0, "without preemption it should have waited"
    first_token = next(e.seq for e in events if e.kind == "token" and e.request == rid)
    first_done = next(e.seq for e in events if e.kind == "instruction_finished")
    assert first_token > first_done
    assert metrics["preemptions"] == 0


def test_memory_pressure_quarter_pool_same_outputs(model_path, runtime):
    prompts = [f"List ten facts about the number {i}." for i in range(8)]
    n_new = 48
    need = sum(len(runtime.tokenizer.encode(p)) + n_new for p in prompts)
    expected = runtime.generate(prompts, max_tokens=n_new, ignore_eos=True)
    with Runtime(model_path, kv_pool_tokens=need // 4, time_slice=4) as small:
        outs = small.generate(prompts, max_tokens=n_new, ignore_eos=True, priority="batch")
        metrics = small.metrics()
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert metrics["retractions"] > 0
    assert metrics["running"] == metrics["waiting"] == metrics["suspended"] == 0


def _prefix_workload(tokenizer) -> list[str]:
    topics = ["the ocean", "mountains", "old castles", "deep space"]
    prefixes = [(f"Here are some notes about {t}. " * 30) for t in topics]
    # Interleaved: FIFO keeps switching prefixes, which a small cache cannot all hold.
    return [prefixes[i % 4] + f"Question {i}: say something." for i in range(16)]


def _run_policy(model_path, policy: str, prompts: list[str]):
    with Runtime(model_path, kv_pool_tokens=640, max_running=2,
                 schedule_policy=policy) as rt:
        q = rt.events.subscribe()
        outs = rt.generate(prompts, max_tokens=4, ignore_eos=True)
        hits = [e for e in _drain(q) if e.kind == "cache_hit"]
        return outs, rt.metrics()["cache_hit_rate"], hits


def test_cache_aware_order_beats_fifo(model_path, runtime):
    prompts = _prefix_workload(runtime.tokenizer)
    lpm_outs, lpm_rate, lpm_hits = _run_policy(model_path, "lpm", prompts)
    fifo_outs, fifo_rate, fifo_hits = _run_policy(model_path, "fifo", prompts)
    assert [o.token_ids for o in lpm_outs] == [o.token_ids for o in fifo_outs]
    assert lpm_rate > fifo_rate, (lpm_rate, fifo_rate)

    # Admitted together: the order of first admissions switches prefix less often.
    def switches(hits, outs):
        prefix_of = {o.meta["id"]: i % 4 for i, o in enumerate(outs)}
        seen, order = set(), []
        for e in hits:
            if e.request not in seen:
                seen.add(e.request)
                order.append(prefix_of[e.request])
        return sum(a != b for a, b in zip(order, order[1:]))

    assert switches(lpm_hits, lpm_outs) < switches(fifo_hits, fifo_outs)


def test_batch_job_progresses_under_constant_interactive_work(model_path):
    starvation = 12
    with Runtime(model_path, kv_pool_tokens=4096, time_slice=2,
                 starvation_steps=starvation) as rt:
        q = rt.events.subscribe()
        stop = threading.Event()

        def interactive_stream() -> None:
            while not stop.is_set():
                rt.generate("Say hi.", max_tokens=6, ignore_eos=True, priority="interactive")

        threads = [threading.Thread(target=interactive_stream) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            batch = rt.submit("Count slowly:", max_tokens=24, ignore_eos=True,
                              priority="batch")
            out = batch.result(timeout=WAIT)
        finally:
            stop.set()
            for t in threads:
                t.join()
        events = _drain(q)
    assert out.meta["completion_tokens"] == 24
    assert out.meta["preemptions"] > 0, "the interactive stream never preempted the batch job"
    steps = [e.step for e in events if e.kind == "token" and e.request == batch.req.rid]
    assert max(b - a for a, b in zip(steps, steps[1:])) <= starvation + 2 * 2 + 4
    interactive_done = [e for e in events if e.kind == "instruction_finished"
                        and e.request != batch.req.rid]
    assert len(interactive_done) >= 3, "the interactive stream was not constant"


def test_bad_scheduler_input(model_path, default_backend):
    @sgl.function
    def prog(s):
        s += "Hi" + sgl.gen("x", max_tokens=2)

    with pytest.raises(ValueError, match="unknown priority 'urgent'.*interactive"):
        prog.run(priority="urgent")
    with pytest.raises(ValueError, match="unknown priority"):
        prog.run_batch([{}], priority="later")
    with pytest.raises(ValueError, match="unknown priority"):
        default_backend.generate("Hi", max_tokens=2, priority="high")
    with pytest.raises(ValueError, match="time_slice must be a positive"):
        Runtime(model_path, time_slice=0)
    with Runtime(model_path, kv_pool_tokens=16) as tiny:
        with pytest.raises(ValueError, match="can never fit the KV pool"):
            tiny.generate("A prompt that is longer than sixteen tokens, surely, yes it is.",
                          max_tokens=4)
    assert default_backend.generate("Hi", max_tokens=2).meta["completion_tokens"] == 2


def test_program_priority_reaches_engine_and_metrics(default_backend):
    @sgl.function
    def prog(s):
        s += "Name a colour:" + sgl.gen("c", max_tokens=3)
        forks = s.fork(2)
        forks += sgl.gen("d", max_tokens=2)
        forks.join()

    before = default_backend.metrics()
    q = default_backend.events.subscribe()
    try:
        state = prog.run(priority="interactive")
    finally:
        default_backend.events.unsubscribe(q)
    events = _drain(q)
    started = [e for e in events if e.kind == "program_started"]
    assert started[0].priority == "interactive"
    decodes = [e for e in events if e.kind == "instruction_finished" and
               e.op == "Decode" and e.program == state.id]
    assert decodes and all(e.node is not None for e in decodes)
    after = default_backend.metrics()
    assert after["forks"] == before["forks"] + 1 and after["joins"] == before["joins"] + 1
    assert after["generated_tokens"] > before["generated_tokens"]
    assert after["tokens_per_second"] > 0


def test_stepping_and_events_under_preemption(model_path):
    """A stepped batch program is preempted by interactive work: its events say so (with
    the reason), stepping by Instruction still gives one token per step, and its greedy
    output is unchanged."""

    @sgl.function
    def story(s):
        s += "Tell me a long story about a lighthouse keeper."
        s += sgl.gen("story", max_tokens=256, ignore_eos=True)

    with Runtime(model_path, kv_pool_tokens=4096, time_slice=2) as rt:
        reference = story.run(backend=rt)["story"]
        q = rt.events.subscribe()
        st = story.run(backend=rt, step=True, priority="batch", passes=())
        assert st.debug.wait_until_held(timeout=WAIT)
        st.debug.continue_()
        for _ in range(3):  # interactive work arrives while the story decodes
            rt.generate("Say hi.", max_tokens=6, ignore_eos=True, priority="interactive")
        st.debug.pause()
        assert st.debug.wait_until_held(timeout=WAIT) and st.debug.waiting_at == "decode"
        log = _drain(q)
        st.debug.step_instruction()
        assert st.debug.wait_until_held(timeout=WAIT)
        step = _drain(q)
        assert len([e for e in step if e.kind == "token" and e.program == st.id]) == 1
        st.debug.continue_()
        assert st["story"] == reference
        log += step
        while not any(e.kind == "program_finished" and e.program == st.id for e in log):
            log.append(q.get(timeout=WAIT))  # the program's last event follows its result
    mine = [e for e in log if e.program == st.id]
    preempted = [e for e in mine if e.kind == "preempted"]
    assert preempted and "interactive" in preempted[0].reason
    resumed = [e for e in mine if e.kind == "resumed" and e.reason == "scheduler"]
    assert len(resumed) == len(preempted)
    assert {e.node for e in preempted} == {n.id for n in st.nodes if n.kind == "Gen"}
    assert st.get_meta_info("story")["preemptions"] == len(preempted)

    # The views' fold of the events shows the program suspended, with the reason.
    from sgl_nb.tracing.timeline import Timeline

    tl = Timeline()
    for e in sorted(log, key=lambda e: e.seq):
        tl.apply(e)
        if e is preempted[0]:
            view = tl.programs[st.id]
            assert view.status == "suspended" and view.reason.startswith("preempted: ")
    assert tl.programs[st.id].status == "done"
