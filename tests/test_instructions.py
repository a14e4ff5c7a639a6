"""The Instructions are what runs: a run's instruction events are exactly the Instructions
its listing prints, in order (Init, each Node's, Return), for a program with text, roles, a
gen, a select, fork/join and a nested call; the static listing shows the same kinds; a
run_batch of many programs stays within its pool of body threads."""

from __future__ import annotations

import threading
import time

import pytest
from support.waits import until

import sgl_nb as sgl
from sgl_nb.runtime.compiler.instructions import Decode, Extend, Fork, Join, Op, Return, Score
from sgl_nb.runtime.compiler.ir import ForkNode, GenNode, JoinNode, ReturnNode, SelectNode
from sgl_nb.runtime.compiler.lowering import lower

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]


@sgl.function
def detail(s, topic):
    s += " Detail about " + topic + ":" + sgl.gen("detail", max_tokens=3, ignore_eos=True)


@sgl.function
def everything(s, topic):
    s += sgl.system("You are terse.")
    with s.user():
        s += "Tell me about " + topic + "."
    s += sgl.assistant(sgl.gen("answer", max_tokens=4, ignore_eos=True))
    s += " Mood:" + sgl.select("mood", choices=[" calm", " wild"])
    forks = s.fork(2)
    forks += lambda i: f" Idea {i}:"
    forks += sgl.gen("idea", max_tokens=2, ignore_eos=True)
    forks.join()
    detail(s, topic=topic)  # a nested call: its Nodes are this program's


def _drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get())
    return out


def test_instruction_events_are_the_listed_instructions(runtime):
    q = runtime.events.subscribe()
    try:
        st = everything.run(topic="tides")
    finally:
        runtime.events.unsubscribe(q)
    assert st.error() is None
    family = {st.id, *(c.id for c in st.snapshot().branches())}
    events = [e for e in _drain(q) if e.program in family]
    started = [(e.program, e.node, e.op, e.index) for e in events
               if e.kind == "instruction_started"]
    finished = [(e.program, e.node, e.op, e.index) for e in events
                if e.kind == "instruction_finished"]
    # What ran, as the state holds it: Init, every Node's Instructions, Return.
    ran = [(i.program, i.node, i.kind, i.index) for n in st.nodes for i in n.instructions]
    assert ran[0] == (st.id, None, "Init", 0) and ran[-1] == (st.id, None, "Return", 0)
    assert sorted(started, key=str) == sorted(ran, key=str)
    assert sorted(finished, key=str) == sorted(ran, key=str)
    ours = [x for x in started if x[0] == st.id]  # one program's are in its own order
    assert ours == [x for x in ran if x[0] == st.id]
    kinds = {k for _, _, k, _ in started}
    assert kinds == {"Init", "Extend", "Decode", "Score", "Fork", "Join", "Return"}
    assert all(i.status == "done" for n in st.nodes for i in n.instructions)
    listing = st.listing()
    assert listing.splitlines()[0].strip().startswith("Init")
    assert listing.count("Score") == 2 and "Fork" in listing and "Return" in listing
    assert any(n.name == "detail" and n.stack == ("everything", "detail") for n in st.nodes)
    # The engine requests are named by the Instruction they ran.
    decodes = [e for e in events if e.kind == "instruction_finished"
               and e.op == "Decode"]
    assert all(e.request is not None and e.usage["output_tokens"] > 0 for e in decodes)


def test_the_static_listing_names_what_will_run():
    g = everything.trace(topic="tides")
    assert g.complete, g.ends  # nothing in it reads a generated value
    text = g.listing()
    for kind in ("Extend", "Decode", "Score", "Fork", "Join"):
        assert kind in text
    assert [n.name for n in g.nodes if n.name == "detail"] == ["detail"]  # the nested call's


def test_lowering_gives_one_typed_instruction_per_step():
    gen = GenNode(program=1, name="x", sampling={"max_tokens": 3})
    sel = SelectNode(program=1, name="m", choices=["a", "b"],
                     method="unconditional_likelihood_normalized")
    (d,) = lower(gen)
    assert isinstance(d, Decode) and d.op is Op.DECODE and d.params == {"max_tokens": 3}
    scores = lower(sel)
    assert [type(s) for s in scores] == [Score] * 4
    assert [s.unconditional for s in scores] == [False, False, True, True]
    assert [s.index for s in scores] == [0, 1, 2, 3]
    sel.decided = "a"
    (e,) = lower(sel)
    assert isinstance(e, Extend) and e.text == "a" and e.name == "m"
    assert isinstance(lower(ForkNode(program=1, n=2))[0], Fork)
    (j,) = lower(JoinNode(program=1, branches=(2,)))
    assert isinstance(j, Join) and j.branches == (2,) and j.mode == "gather_variable"
    (r,) = lower(ReturnNode(program=1))
    assert isinstance(r, Return) and r.node is None  # the program's own, like Init


def test_run_batch_stays_within_its_pool(runtime):
    @sgl.function
    def tiny(s, i):
        s += f"Item {i}:" + sgl.gen("x", max_tokens=1)

    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], sum(t.name.startswith("sgl-batch-tiny")
                                       for t in threading.enumerate()))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    before = threading.active_count()
    try:
        states = tiny.run_batch([{"i": i} for i in range(300)], num_threads=8)
    finally:
        stop.set()
        sampler.join()
    assert all(st.error() is None and st["x"] is not None for st in states)
    assert 1 <= peak[0] <= 8
    until(lambda: threading.active_count() <= before + 1, "the batch's threads ending")
