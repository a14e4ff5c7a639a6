"""The step controller from code: step a Node, step an Instruction (one token), a
breakpoint by name, continue; only the stepped program waits."""

from __future__ import annotations

import pytest
from support.waits import WAIT

import sgl_nb as sgl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]


@sgl.function
def story(s):
    s += "Once upon a time"
    s += ", in a small town,"
    s += sgl.gen("a", max_tokens=6, ignore_eos=True)
    s += " Then"
    s += sgl.gen("b", max_tokens=4, ignore_eos=True)


def held(st):
    assert st.debug.wait_until_held(timeout=WAIT), "the program never paused"
    return st.debug.current


def test_step_node_then_instruction_then_continue(runtime):
    st = story.run(step=True, passes=())  # no fusion: each `s +=` is its own Node
    node = held(st)
    assert node.kind == "Text" and node.status == "pending" and st.debug.waiting_at == "node"
    st.debug.step()
    assert held(st).text == ", in a small town,"
    assert st.nodes[0].kind == "Init"  # the program's own; the debugger does not hold there
    assert st.nodes[1].status == "done" and st.nodes[2].status == "pending"
    st.debug.step()
    gen_node = held(st)
    assert gen_node.kind == "Gen" and gen_node.name == "a"

    tokens = runtime.events.subscribe()
    st.debug.step_instruction()  # the Gen's prefill: its first token, then it holds
    assert held(st) is gen_node and st.debug.waiting_at == "decode"
    st.debug.step_instruction()  # one Decode: one more token
    assert held(st) is gen_node
    mine = [e for e in _drain(tokens) if e.kind == "token"]
    assert len(mine) == 2

    # Another program runs to completion while this one is held.
    other = story.run()
    assert other.error() is None and len(other["b"]) > 0
    assert "a" not in st.snapshot().vars

    st.debug.continue_()
    assert st["b"] and st.error() is None
    assert st["a"] == other["a"]  # stepping does not change greedy output
    runtime.events.unsubscribe(tokens)


def test_breakpoint_by_name(runtime):
    st = story.run(step=True)
    held(st)
    st.debug.breakpoint(name="b")
    st.debug.continue_()
    node = held(st)
    assert node.kind == "Gen" and node.name == "b"
    assert st["a"]  # everything before the breakpoint ran
    st.debug.pause()
    st.debug.continue_()
    assert st["b"]


def test_breakpoint_needs_a_target():
    from sgl_nb.runtime.compiler.step_controller import StepController

    with pytest.raises(ValueError, match="breakpoint needs"):
        StepController().breakpoint()


def _drain(q):
    out = []
    while not q.empty():
        out.append(q.get())
    return out


def test_events_follow_the_program(runtime):
    events = runtime.events.subscribe()
    st = story.run(passes=())
    runtime.events.unsubscribe(events)
    got = [e for e in _drain(events) if e.program in (st.id, None)]
    kinds = [e.kind for e in got if e.program == st.id]
    assert kinds[0] == "program_started" and kinds[-1] == "program_finished"
    # Return is the program's, as Init is: an Instruction, no Node in the views.
    ran = [n for n in st.nodes if n.kind not in ("Init", "Return")]
    assert kinds.count("node_started") == kinds.count("node_finished") == len(ran)
    started = [e.op for e in got if e.kind == "instruction_started"]
    assert started == [i.kind for n in st.nodes for i in n.instructions]
    assert started[0] == "Init"
    assert started[-1] == "Return" and len(started) == len(ran) + 2  # one per Node
    tokens = [e for e in got if e.kind == "token"]
    assert len(tokens) == 6 + 4  # the two gens' tokens
    seqs = [e.seq for e in got]
    assert seqs == sorted(seqs) and all(a.ts <= b.ts for a, b in zip(got, got[1:]))


def test_cache_events(runtime):
    runtime.flush_cache()
    events = runtime.events.subscribe()
    prompt = "A sentence about caching, repeated to be cached. " * 4
    runtime.generate(prompt, max_tokens=2)
    runtime.generate(prompt, max_tokens=2)
    runtime.events.unsubscribe(events)
    got = _drain(events)
    hits = [e.cached_tokens for e in got if e.kind == "cache_hit"]
    assert hits[0] == 0 and hits[1] > 0
    assert any(e.kind == "cache_insert" and e.tokens > 0 for e in got)


def test_continue_forgets_a_step_whose_node_has_not_ended():
    """A step granted to one fork branch while another is held, then continue: the stepped
    Node's end must not pause the program again."""
    from sgl_nb.runtime.compiler.ir import GenNode
    from sgl_nb.runtime.compiler.step_controller import StepController

    a, b = GenNode(program=1, name="a"), GenNode(program=2, name="b")
    c = StepController(paused=True)
    assert not c.enter_node(a)  # held before a
    c.step()
    assert c.enter_node(a)  # a runs (its end would pause again) ...
    c.continue_()  # ... but the user continued before it ended
    c.after_node(a)
    assert c.enter_node(b) and not c.paused
