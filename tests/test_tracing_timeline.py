"""The Timeline fold: real Events from real programs, and hand-made ones for edge cases."""

from __future__ import annotations

import pytest

import sgl_nb as sgl
from sgl_nb.runtime.events import (
    CacheEvict,
    CacheHit,
    CacheInsert,
    Event,
    Forked,
    Hold,
    InstructionFinished,
    InstructionStarted,
    NodeFinished,
    NodeKind,
    NodeQueued,
    NodeStarted,
    Op,
    Paused,
    Preempted,
    ProgramFinished,
    ProgramStarted,
    Resumed,
    Retracted,
    Status,
    Token,
)
from sgl_nb.tracing.timeline import Family, Timeline


def ev(cls: type[Event], seq: int, program=None, node=None, request=None, /,
       **fields) -> Event:
    return cls(program=program, node=node, request=request, ts=1000 * seq, seq=seq, **fields)


def test_hand_made_program_folds():
    events = [
        ev(ProgramStarted, 1, 1, function="f", priority="normal", model="m"),
        ev(NodeStarted, 2, 1, 10, node_kind=NodeKind.TEXT, line=3, file="f.py",
           label="Text 'Hi'"),
        ev(InstructionStarted, 3, 1, 10, op=Op.EXTEND),
        ev(InstructionFinished, 4, 1, 10, op=Op.EXTEND),
        ev(NodeFinished, 5, 1, 10, text="Hi"),
        ev(NodeStarted, 6, 1, 11, node_kind=NodeKind.GEN, name="x", line=4, preds=(10,)),
        ev(InstructionStarted, 7, 1, 11, 99, op=Op.DECODE),
        ev(CacheHit, 8, 1, 11, 99, cached_tokens=2, prompt_tokens=5),
        ev(Token, 9, 1, 11, 99, token=7, text=" a", logprob=-0.5),
        ev(Preempted, 10, 1, 11, 99, reason="priority", priority="batch"),
        ev(Resumed, 11, 1, 11, 99, reason="scheduler"),
        ev(Token, 12, None, None, 99, token=8, text="b", logprob=-0.1),  # node by request
        ev(CacheInsert, 13, 1, 11, 99, tokens=4),
        ev(InstructionFinished, 14, 1, 11, 99, op=Op.DECODE, usage={
            "input_tokens": 5, "cached_tokens": 2, "new_tokens": 3, "output_tokens": 2,
            "batch_size": 1, "preempted": 1, "finish_reason": "length"}),
        ev(NodeFinished, 15, 1, 11),
        ev(CacheEvict, 16, tokens=3),
        ev(ProgramFinished, 17, 1),
    ]
    tl = Timeline(events)
    p = tl.programs[1]
    assert (p.function, p.status, p.nodes, p.model) == ("f", Status.DONE, [10, 11], "m")
    text, gen = tl.nodes[10], tl.nodes[11]
    assert (text.kind, text.line, text.file, text.status) == \
        (NodeKind.TEXT, 3, "f.py", Status.DONE)
    assert gen.preds == [10] and gen.start_ns == 6000 and gen.end_ns == 15000
    (dec,) = gen.instructions
    assert (dec.kind, dec.request, dec.status, dec.index) == (Op.DECODE, 99, Status.DONE, 0)
    assert dec.attrs["output_tokens"] == 2 and dec.attrs["finish_reason"] == "length"
    assert [type(m) for m in dec.marks] == [Preempted, Resumed]
    assert [(t.token, t.text, t.seq) for t in gen.tokens] == [(7, " a", 9), (8, "b", 12)]
    assert tl.cache == {"hits": 1, "cached_tokens": 2, "prompt_tokens": 5, "inserted": 4,
                        "evicted": 3}
    assert [type(e) for e in tl.cache_events] == [CacheHit, CacheInsert, CacheEvict]
    assert tl.program_text(1) == "Hi a" + "b"
    assert tl.node_steps() == [2, 6] and tl.instruction_steps() == [3, 7]

    back = tl.upto(9)
    assert back.programs[1].status is Status.RUNNING
    assert back.nodes[11].status is Status.RUNNING
    assert len(back.nodes[11].tokens) == 1 and back.nodes[11].instructions[0].end_ns is None
    assert back.cache["inserted"] == 0


def test_preempted_program_is_suspended_until_resumed():
    tl = Timeline([ev(ProgramStarted, 1, 1, function="f"),
                   ev(NodeStarted, 2, 1, 5, node_kind=NodeKind.GEN),
                   ev(InstructionStarted, 3, 1, 5, 42, op=Op.DECODE),
                   ev(Retracted, 4, 1, 5, 42, reason="memory")])
    assert tl.programs[1].status is Status.SUSPENDED
    assert isinstance(tl.nodes[5].instructions[0].marks[0], Retracted)
    tl.apply(ev(Resumed, 5, 1, 5, 42, reason="scheduler"))
    assert tl.programs[1].status is Status.RUNNING


def test_fork_children_and_out_of_order_events():
    tl = Timeline()
    tl.apply(ev(ProgramStarted, 1, 1, function="f"))
    tl.apply(ev(Forked, 3, 1, 20, n=2, children=(2, 3)))
    tl.apply(ev(NodeStarted, 2, 1, 20, node_kind=NodeKind.FORK))  # published earlier
    tl.apply(ev(ProgramStarted, 4, 2, function="f", parent=1))
    tl.apply(ev(NodeStarted, 5, 3, 30, node_kind=NodeKind.GEN))  # branch 3 never announced
    assert [e.seq for e in tl.events] == [1, 2, 3, 4, 5]
    assert tl.programs[1].children == [2, 3]
    assert tl.programs[2].parent == 1 and tl.programs[3].parent == 1
    assert tl.programs[3].nodes == [30]


def test_queued_nodes_are_pending_until_they_start_and_skipped_if_they_never_do():
    tl = Timeline([
        ev(NodeQueued, 1, 1, 10, node_kind=NodeKind.GEN, name="a", line=3, label="Gen a",
           stack=("f", "g"), stack_args=("x=1", "y='b'"), ops=(Op.DECODE,)),
        ev(NodeQueued, 2, 1, 11, node_kind=NodeKind.TEXT, label="Text", ops=(Op.EXTEND,)),
        ev(ProgramStarted, 3, 1, function="f"),
    ])
    a, text = tl.nodes[10], tl.nodes[11]
    assert (a.status, a.start_ns, a.ops, a.stack_args) == (Status.PENDING, None, [Op.DECODE],
                                                           ["x=1", "y='b'"])
    assert tl.programs[1].nodes == [10, 11] and tl.programs[1].function == "f"
    tl.apply(ev(NodeStarted, 4, 1, 10, node_kind=NodeKind.GEN, name="a", stack=("f", "g"),
                stack_args=("", "")))  # the body had returned from both calls by then
    assert a.status is Status.RUNNING and a.start_ns == 4000
    assert a.stack_args == ["x=1", "y='b'"]  # what the frames were as it was queued
    tl.apply(ev(NodeFinished, 5, 1, 10, value="'red'", meta='{"finish_reason": "stop"}'))
    assert (a.value, a.meta) == ("'red'", {"finish_reason": "stop"})
    tl.apply(ev(ProgramFinished, 6, 1, status=Status.ERROR, error="E()", line=7))
    assert text.status is Status.SKIPPED and tl.programs[1].error_line == 7


def test_a_held_program_says_where_until_it_goes_on():
    tl = Timeline([ev(ProgramStarted, 1, 1),
                   ev(Paused, 2, 1, 10, at=Hold.NODE, reason="step controller")])
    p = tl.programs[1]
    assert (p.status, p.held, p.held_node) == (Status.SUSPENDED, Hold.NODE, 10)
    tl.apply(ev(Resumed, 3, 1, 10, reason="step controller"))
    assert (p.status, p.held, p.held_node) == (Status.RUNNING, None, None)
    tl.apply(ev(Paused, 4, 1, 10, at=Hold.DECODE, reason="step controller"))
    assert p.held is Hold.DECODE
    tl.apply(ev(Resumed, 5, 1, None, 7, reason="scheduler"))  # a request's: not the hold
    assert p.held is Hold.DECODE


def test_a_family_keeps_a_branchs_early_events_until_its_fork():
    family = Family(1)
    queued = ev(NodeQueued, 2, 5, 20, node_kind=NodeKind.GEN)  # branch 5, queued first
    assert family.take(ev(ProgramStarted, 1, 1)) != []
    assert family.take(queued) == [] and family.take(ev(NodeQueued, 3, 9, 30)) == []
    fork = ev(Forked, 4, 1, 11, n=1, children=(5,))
    assert family.take(fork) == [fork, queued]
    assert family.programs == {1, 5} and family.take(ev(NodeStarted, 5, 5, 20)) != []


def test_unknown_program_text_is_a_clear_error():
    with pytest.raises(KeyError, match="no program 5"):
        Timeline().program_text(5)


@sgl.function
def _qa(s, q):
    s += "Q: " + q + "\nA:"
    s += sgl.gen("a", max_tokens=5, ignore_eos=True)
    s += " Verdict:"
    s += sgl.select("v", choices=[" yes", " no"])


@sgl.function
def _forked(s):
    s += "List two colors."
    forks = s.fork(2)
    forks += lambda i: f" Color {i}:"
    forks += sgl.gen("c", max_tokens=3, ignore_eos=True)
    forks.join()


@pytest.mark.slow
def test_real_program_events_fold(default_backend):
    rt = default_backend
    q = rt.events.subscribe()
    st = _qa.run(q="What is 2+2?", passes=())
    rt.events.unsubscribe(q)
    events = []
    while not q.empty():
        events.append(q.get())
    tl = Timeline(events)
    p = tl.programs[st.id]
    assert p.status == "done" and p.function == "_qa"
    ran = [n for n in st.nodes if n.kind not in ("Init", "Return")]
    assert p.nodes == [n.id for n in ran]
    for n in ran:
        view = tl.nodes[n.id]
        assert view.kind == n.kind and view.status == "done" and view.line == n.line
        assert len(view.instructions) >= 1 and view.end_ns >= view.start_ns
    gen = tl.nodes[ran[1].id]
    assert len(gen.tokens) == 5 and "".join(t.text for t in gen.tokens) == st["a"]
    assert len(tl.node_steps()) == len(ran)
    assert tl.upto(tl.node_steps()[1]).nodes[ran[1].id].status == "running"


@pytest.mark.slow
def test_real_fork_events_fold(default_backend):
    rt = default_backend
    q = rt.events.subscribe()
    st = _forked.run()
    rt.events.unsubscribe(q)
    events = []
    while not q.empty():
        events.append(q.get())
    tl = Timeline(events)
    assert tl.programs[st.id].status == "done"
    fork = next(n for n in tl.nodes.values() if n.kind == "Fork" or n.program == st.id)
    assert fork is not None
    branch_nodes = [n for n in tl.nodes.values() if n.program != st.id and n.kind == "Gen"]
    assert len(branch_nodes) == 2
    assert all(len(n.tokens) == 3 for n in branch_nodes)
