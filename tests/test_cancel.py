"""Cancelling on the real model: a request (handle.cancel(), rt.abort, a stream left early,
an interrupt while waiting), a program (state.cancel(), fut.cancel(), an interrupt in each
blocking read, fork branches), and that nothing produced is lost and nothing else moves."""

from __future__ import annotations

import gc
import threading

import pytest
from support.interrupts import interrupt_main_inside
from support.waits import WAIT, until

import sgl_nb as sgl
from sgl_nb.language.state import ProgramState
from sgl_nb.runtime.engine import RequestHandle

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend", "python_sigint")]

PROMPT = "Once upon a time, in a faraway land,"
LONG = 2000  # tokens a cancelled request would otherwise run for


def idle(rt) -> bool:
    m = rt.metrics()
    return m["running"] == m["waiting"] == m["prefilling"] == m["suspended"] == 0


def locked_tokens(rt) -> int:
    return rt.cache_stats()["protected_tokens"]


def decoding(runtime):
    """A condition: the engine has generated a token since this call."""
    before = runtime.metrics()["generated_tokens"]
    return lambda: runtime.metrics()["generated_tokens"] > before


# ---- requests ---------------------------------------------------------------------------


def test_handle_cancel_keeps_the_tokens_and_frees_the_kv(runtime):
    until(lambda: idle(runtime), "an idle engine")
    aborted = runtime.metrics()["aborted"]
    want = runtime.generate(PROMPT, max_tokens=24, ignore_eos=True)
    h = runtime.submit(PROMPT, stream=True, max_tokens=LONG, ignore_eos=True)
    chunks = h.chunks()
    next(chunks)
    until(lambda: len(h.req.output_ids) >= 8, "a few tokens")
    assert h.cancel()
    out = h.result(timeout=WAIT)
    assert out.meta["finish_reason"] == "abort"
    n = len(out.token_ids)
    assert 8 <= n < LONG
    # What it produced is kept: the greedy tokens so far and their exact text.
    assert out.token_ids[:24] == want.token_ids[: min(n, 24)]
    assert out.text == runtime.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    until(lambda: idle(runtime), "the request leaving the engine")
    assert locked_tokens(runtime) == 0
    assert runtime.metrics()["aborted"] == aborted + 1
    assert not h.cancel()  # already finished
    # Its tokens stay in the radix tree as evictable cache: the same prompt hits them.
    again = runtime.generate(PROMPT, max_tokens=1)
    assert again.meta["cached_tokens"] == again.meta["prompt_tokens"] - 1


def test_abort_by_request_id_leaves_other_requests_alone(runtime):
    other_alone = runtime.generate("The capital of France is", max_tokens=32, ignore_eos=True)
    victim = runtime.submit(PROMPT, max_tokens=LONG, ignore_eos=True)
    other = runtime.submit("The capital of France is", max_tokens=32, ignore_eos=True)
    until(lambda: len(victim.req.output_ids) >= 4, "the victim decoding")
    assert runtime.abort(victim.req.rid)
    assert victim.result(timeout=WAIT).meta["finish_reason"] == "abort"
    out = other.result(timeout=WAIT)
    assert out.token_ids == other_alone.token_ids and out.meta["finish_reason"] == "length"


def test_breaking_out_of_a_stream_aborts_it(runtime):
    stream = runtime.generate(PROMPT, max_tokens=LONG, ignore_eos=True, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # what a for loop's end does when the generator is collected
    until(lambda: idle(runtime), "the request leaving the engine")


def test_dropping_a_stream_aborts_it(runtime):
    stream = runtime.generate(PROMPT, max_tokens=LONG, ignore_eos=True, stream=True)
    next(stream)
    del stream
    gc.collect()
    until(lambda: idle(runtime), "the request leaving the engine")
    assert locked_tokens(runtime) == 0


def test_interrupt_while_generate_waits_aborts_and_reraises(runtime):
    until(lambda: idle(runtime), "an idle engine")
    off = interrupt_main_inside(runtime.generate, decoding(runtime))
    try:
        with pytest.raises(KeyboardInterrupt):
            runtime.generate(PROMPT, max_tokens=LONG, ignore_eos=True)
    finally:
        off.set()
    until(lambda: idle(runtime), "the request leaving the engine")
    assert locked_tokens(runtime) == 0


def test_interrupt_while_streaming_aborts(runtime):
    got = []
    # Inside the stream's next(), once a chunk has come out of it.
    off = interrupt_main_inside(RequestHandle.chunks, lambda: len(got) > 0)
    try:
        with pytest.raises(KeyboardInterrupt):
            for chunk in runtime.generate(PROMPT, max_tokens=LONG, ignore_eos=True,
                                          stream=True):
                got.append(chunk)
    finally:
        off.set()
    assert got
    until(lambda: idle(runtime), "the request leaving the engine")


# ---- programs ---------------------------------------------------------------------------


@sgl.function
def story(s, topic):
    s += f"A story about {topic}:" + sgl.gen("tale", max_tokens=LONG, ignore_eos=True)
    s += " The end. Moral:" + sgl.gen("moral", max_tokens=16)
    s += sgl.select("mood", choices=["happy", "sad"])


@sgl.function
def short(s):
    s += "The three primary colours are" + sgl.gen("c", max_tokens=24, ignore_eos=True)


@sgl.function
def branches(s):
    s += "Two ideas for a story:"
    forks = s.fork(2)
    forks += lambda i: f"\nIdea {i}:"
    forks += sgl.gen("idea", max_tokens=LONG, ignore_eos=True)
    forks.join()
    s += "\nBest:" + sgl.gen("best", max_tokens=8)


def started(state, name: str, chars: int = 20):
    until(lambda: len(state.snapshot().vars.get(name, "")) > 0
          or len(state.snapshot().text) > chars + 40,
          f"{name} generating")


def test_state_cancel_keeps_text_and_variables(runtime):
    alone = short.run().text()
    state = story.run(topic="a lighthouse", stream=True)
    other = short.run_async()
    until(lambda: len(state.snapshot().text) > 60, "the tale generating")
    assert state.cancel()
    assert state.wait(timeout=WAIT) is state
    err = state.error()
    assert isinstance(err, sgl.ProgramCancelled)
    kinds = [(n.kind, n.name, n.status) for n in state.nodes]
    assert ("Gen", "tale", "cancelled") in kinds
    assert ("Gen", "moral", "cancelled") in kinds and ("Select", "mood", "cancelled") in kinds
    assert state.nodes[-1].kind == "Return" and state.nodes[-1].status == "cancelled"
    tale = state["tale"]  # the partial output is the variable's value
    assert tale and state.text() == "A story about a lighthouse:" + tale
    assert state.get_meta_info("tale")["finish_reason"] == "abort"
    with pytest.raises(sgl.ProgramCancelled, match="moral"):
        state["moral"]
    assert not state.cancel()  # already ended
    assert other.result().text() == alone  # the program beside it gave what it gives alone
    until(lambda: idle(runtime), "nothing left running")
    assert locked_tokens(runtime) == 0


def test_future_cancel_and_events_say_cancelled(runtime):
    q = runtime.events.subscribe()
    try:
        fut = story.run_async(topic="a fox")
        until(lambda: len(fut.state.snapshot().text) > 40, "the tale generating")
        assert fut.cancel() and fut.cancelled()
        state = fut.result(timeout=WAIT)
        pid = state.id
        events = []
        until(lambda: events.extend(_drain(q)) or any(
            e.kind == "program_finished" and e.program == pid for e in events), "the end")
    finally:
        runtime.events.unsubscribe(q)
    ours = [e for e in events if e.program == pid]
    end = next(e for e in ours if e.kind == "program_finished")
    assert end.status == "cancelled" and "ProgramCancelled" in end.error
    finished = [e.status for e in ours if e.kind == "node_finished"]
    # The Gen cut short, then the Text, Gen and Select queued after it.
    assert finished == ["done", "cancelled", "cancelled", "cancelled", "cancelled"]
    decode = [e for e in ours if e.kind == "instruction_finished" and e.op == "Decode"]
    assert decode[-1].usage["finish_reason"] == "abort"


def _drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_cancel_reaches_fork_branches(runtime):
    state = branches.run(stream=True)
    def both_going(snap) -> bool:
        kids = list(snap.branches())
        return len(kids) == 2 and all(len(c.text) > len(snap.text) + 12 for c in kids)

    until(lambda: both_going(state.snapshot()), "both branches")
    state.cancel()
    state.wait(timeout=WAIT)
    assert all(isinstance(c.error, sgl.ProgramCancelled) for c in state.snapshot().branches())
    ideas = state["idea"]  # both branches' partial ideas, gathered
    assert len(ideas) == 2 and all(ideas)
    join = next(n for n in state.nodes if n.kind == "Join")
    assert join.status == "cancelled"
    assert not any(n.name == "best" and n.status == "done" for n in state.nodes)
    until(lambda: idle(runtime), "nothing left running")


def test_the_programs_python_stops_at_its_next_line(runtime):
    reached, ended = [], threading.Event()

    @sgl.function
    def loop(s):
        try:
            for i in range(1000):
                s += f"\nStep {i}:" + sgl.gen(f"s{i}", max_tokens=4, ignore_eos=True)
                s[f"s{i}"]  # reads wait for the value: the Python follows the model
                reached.append(i)
        finally:
            ended.set()

    state = loop.run(stream=True)
    until(lambda: len(reached) >= 2, "a few steps")
    before = len(reached)
    state.cancel()
    state.wait(timeout=WAIT)
    assert ended.wait(WAIT), "the body never ended"
    # It raised ProgramCancelled at its next read (one read may have returned just before).
    assert before <= len(reached) <= before + 1


@pytest.mark.parametrize("how", ["wait", "getitem", "text_iter", "run"])
def test_interrupt_while_waiting_cancels_the_program(runtime, how):
    call = {"run": story.run, "wait": ProgramState.wait, "getitem": ProgramState.__getitem__,
            "text_iter": ProgramState.text_iter}[how]
    off = interrupt_main_inside(call, decoding(runtime))
    state = None
    try:
        with pytest.raises(KeyboardInterrupt):
            if how == "run":
                story.run(topic="a storm")
            else:
                state = story.run(topic="a storm", stream=True)
                if how == "wait":
                    state.wait()
                elif how == "getitem":
                    state["moral"]
                else:
                    for _ in state.text_iter():
                        pass
    finally:
        off.set()
    until(lambda: idle(runtime), "the program's requests leaving the engine")
    if state is not None:
        state.wait(timeout=WAIT)
        assert isinstance(state.error(), sgl.ProgramCancelled)
        assert state["tale"]  # what it produced before the interrupt is kept
