"""Each compiler pass: a program where it applies, the count it reports, and the same
output with the pass off. Also f.trace: the static graph as a listing and as DOT."""

from __future__ import annotations

import pytest

import sgl_nb as sgl
from sgl_nb.runtime.compiler.ir import ForkNode, GenNode, SelectNode, TextNode
from sgl_nb.runtime.compiler.lowering import lower
from sgl_nb.runtime.compiler.passes import (
    decide_selects,
    fuse_text,
    share_fork_prefixes,
    shared_prefix,
)
from sgl_nb.runtime.events import InstructionFinished, InstructionStarted

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]


@sgl.function
def letter(s, name):
    s += "Dear "
    s += name
    s += ",\n"
    s += "Thank you for"
    s += sgl.gen("body", max_tokens=10, stop="\n")
    s += "\nTone: "
    s += sgl.select("tone", [" warm"])


def test_fuse_text_and_static_select_change_nothing_but_the_count():
    on = letter.run(name="Ada")
    off = letter.run(name="Ada", passes=())
    assert on.text() == off.text() and on["tone"] == off["tone"] == " warm"
    assert on.pass_counts == {"fuse_text": 3, "static_select": 1}
    assert off.pass_counts == {}
    kinds_on = [n.kind for n in on.nodes]
    assert kinds_on.count("Text") == 2 and kinds_on.count("Text") < [
        n.kind for n in off.nodes].count("Text")
    assert on.get_meta_info("tone")["resolved"] == "static"


@sgl.function
def ruled(s):
    s += "Pick a number: " + sgl.gen("n", choices=["one", "2", "three"], dtype=int)
    s += "\nPick a colour: " + sgl.gen("c", choices=["red", "green"], regex=r"g\w+")
    s += "\nPick a city: " + sgl.gen("city", choices=["Paris", "Perth", "London"],
                                     regex="P.*")
    s += "\nAgain: " + sgl.select("again", ["yes", "yes"])


def _scores_of(st, name: str) -> list[str]:
    node = next(n for n in st.nodes if n.name == name)
    return [i.choice for i in node.instructions if i.kind == "Score"]


def test_selects_fixed_by_the_gens_grammar_need_no_score():
    on, off = ruled.run(), ruled.run(passes=())
    assert on.text() == off.text()
    assert (on["n"], on["c"], on["again"]) == ("2", "green", "yes")
    assert on.pass_counts["static_select"] == 3  # n and c by grammar, again by repetition
    for name, why in (("n", "grammar"), ("c", "grammar"), ("again", "static")):
        assert _scores_of(on, name) == [] and on.get_meta_info(name)["resolved"] == why
    # Two cities are left: scored, and only those (with the pass or without it).
    assert _scores_of(on, "city") == _scores_of(off, "city") == ["Paris", "Perth"]
    assert on["city"] == off["city"] in ("Paris", "Perth")
    assert on.get_meta_info("city")["choices"] == ["Paris", "Perth"]
    assert _scores_of(off, "n") == ["2"]  # without the pass: one Score of the one left


def test_the_grammar_pass_on_nodes():
    sel = SelectNode(program=1, name="n", choices=["a", "b", "c"], method="m", allowed=[1])
    free = SelectNode(program=1, name="m", choices=["a", "b"], method="m")
    report = decide_selects([sel, free])
    assert report.changed == 1 and report.detail == "1 grammar"
    assert (sel.decided, sel.resolved) == ("b", "grammar") and free.decided is None


def test_a_grammar_that_rules_out_every_choice_fails_at_its_line():
    with pytest.raises(ValueError, match=r"no choice of \['x', 'y'\] matches its regex"):
        sgl.gen("v", choices=["x", "y"], regex="z+")
    with pytest.raises(ValueError, match="invalid regex"):
        sgl.gen("v", choices=["x", "y"], regex="(")


def _events_of(runtime, run):
    q = runtime.events.subscribe()
    try:
        out = run()
    finally:
        runtime.events.unsubscribe(q)
    events = []
    while not q.empty():
        events.append(q.get())
    return out, events


@sgl.function
def review(s, item):
    s += "You are a careful reviewer of household objects, brief and fair. " * 6
    s += f"Review: {item}\n"
    s += sgl.gen("r", max_tokens=3)


def test_batch_items_wait_for_the_first_items_shared_extend(runtime):
    items = [{"item": x} for x in ("kettle", "lamp", "chair")]
    runtime.flush_cache()
    states, events = _events_of(runtime, lambda: review.run_batch(items))
    report = review.last_batch_report
    assert report.name == "shared_prefix" and report.changed == 3
    first = states[0]
    init, shared = first.nodes[0].instructions
    assert shared.kind == "Extend" and shared.shared and shared.status == "done"
    assert shared.text.endswith("brief and fair. Review: ")  # what every item starts with
    assert all(s.text().startswith(shared.text) for s in states)
    assert first.pass_counts["shared_prefix"] == 3
    ours = {s.id for s in states}
    seq = {(e.program, e.kind, e.op, e.index): e.seq for e in events
           if e.program in ours and isinstance(e, InstructionStarted | InstructionFinished)}
    shared_end = seq[(first.id, "instruction_finished", "Extend", 1)]
    for other in states[1:]:  # each later item's Init starts once the prefix is in
        assert other.nodes[0].instructions[0].after is shared
        assert seq[(other.id, "instruction_started", "Init", 0)] > shared_end
    prefix_tokens = len(runtime.tokenizer.encode(shared.text))
    decodes = [e for e in events if e.program in ours and e.kind == "instruction_finished"
               and e.op == "Decode"]
    assert len(decodes) == 3
    assert all(e.usage["cached_tokens"] >= prefix_tokens - 1 for e in decodes)
    runtime.flush_cache()
    off = review.run_batch(items, passes=())
    assert review.last_batch_report is None and off[0].nodes[0].instructions[1:] == []
    assert [s["r"] for s in states] == [s["r"] for s in off]


@sgl.function
def three_ways(s, q):
    s += "Answer the question in three different ways, each short and plain. " * 3
    s += "Question: " + q + "\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Way {i + 1}:" + sgl.gen("a", max_tokens=4)
    forks.join()


def test_a_forks_branches_wait_for_one_shared_extend(runtime):
    runtime.flush_cache()
    st, events = _events_of(runtime, lambda: three_ways.run(q="Why is the sky blue?"))
    assert st.error() is None and st.pass_counts["shared_prefix"] == 1
    fork = next(n for n in st.nodes if n.kind == "Fork")
    shared, _ = fork.instructions
    assert shared.shared and shared.text == st.text()[: len(shared.text)]
    assert shared.text.endswith("Question: Why is the sky blue?\n")
    started = {e.request for e in events if e.kind == "instruction_started"
               and e.op == "Extend" and e.node == fork.id}
    assert started == {shared.request} and shared.request is not None
    prefix_tokens = len(runtime.tokenizer.encode(shared.text))
    branches = {c.id for c in st.snapshot().branches()}
    decodes = [e for e in events if e.program in branches and e.kind == "instruction_finished"
               and e.op == "Decode"]
    assert len(decodes) == 3
    assert all(e.usage["cached_tokens"] >= prefix_tokens - 1 for e in decodes)
    runtime.flush_cache()
    off = three_ways.run(q="Why is the sky blue?", passes=())
    assert off.pass_counts == {} and off["a"] == st["a"]
    assert [i.kind for i in next(n for n in off.nodes if n.kind == "Fork").instructions] \
        == ["Fork"]


def test_a_fork_right_after_a_gen_needs_no_shared_extend(runtime):
    @sgl.function
    def after_gen(s):
        s += "Name a colour:" + sgl.gen("c", max_tokens=3)
        forks = s.fork(2)
        for f in forks:
            f += sgl.gen("more", max_tokens=2)
        forks.join()

    st = after_gen.run()
    fork = next(n for n in st.nodes if n.kind == "Fork")
    shared = fork.instructions[0]
    assert shared.shared and shared.status == "done" and shared.request is None
    assert shared.text == ""  # the gen's request computed the text: nothing to share


def test_programs_in_flight_compute_a_common_prefix_once(runtime):
    """Programs started separately, not a batch: the scheduler admits one request of a group
    that shares an uncached prefix, the others wait a step and find it in the radix tree."""
    @sgl.function
    def helper(s, q):
        s += "You are a helpful assistant who answers in one short sentence. " * 6
        s += "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=3)

    runtime.flush_cache()
    qs = ("Why is grass green?", "What is rain?", "Where is Paris?")
    futs, events = _events_of(runtime, lambda: [
        f.result() and f for f in [helper.run_async(q=q) for q in qs]])
    states = [f.state for f in futs]
    ours = {s.id for s in states}
    prefix_tokens = len(runtime.tokenizer.encode(
        "You are a helpful assistant who answers in one short sentence. " * 6))
    cached = sorted(e.usage["cached_tokens"] for e in events if e.program in ours
                    and e.kind == "instruction_finished" and e.op == "Decode")
    assert len(cached) == 3 and cached[1] >= prefix_tokens - 1  # all but the first
    runtime.flush_cache()
    assert [s["a"] for s in states] == [helper.run(q=q)["a"] for q in qs]


def test_pass_functions_on_nodes():
    a = TextNode(program=1, text="a")
    b = TextNode(program=1, preds=[a.id], text="b")
    g = GenNode(program=1, preds=[b.id], name="x")
    nodes, report = fuse_text([a, b, g])
    assert nodes == [a, g] and (a.text, a.fused) == ("ab", 2) and g.preds == [a.id]
    assert report.changed == 1
    common, rep = shared_prefix(["abcX", "abcY", "abZ"])
    assert common == "ab" and rep.changed == 3
    one, two = ForkNode(program=1, preds=[g.id], n=1), ForkNode(program=1, n=3)
    rep = share_fork_prefixes([one, two])
    assert rep.name == "shared_prefix" and rep.changed == 1
    assert not one.shared_prefix and two.shared_prefix
    assert [i.kind for i in lower(one)] == ["Fork"]
    extend, fork = lower(two)
    assert extend.kind == "Extend" and extend.shared and extend.on_engine and fork.n == 3
    with pytest.raises(ValueError, match="unknown passes"):
        letter.run(name="x", passes=["vectorize"])


def test_trace_shows_the_static_graph():
    @sgl.function
    def react(s, q):
        s += sgl.user(q)
        with s.assistant():
            s += sgl.gen("thought", max_tokens=8)
        if s["thought"].startswith("Yes"):
            s += "done"

    g = react.trace(q="Is water wet?")
    assert not g.complete and "thought" in g.ends
    kinds = [n.kind for n in g.nodes]
    assert kinds == ["RoleBegin", "Text", "RoleEnd", "RoleBegin", "Gen", "RoleEnd"]
    assert "Gen thought" in g.listing() and "Decode" in g.listing()
    dot = g.dot()
    assert dot.startswith('digraph "react"') and dot.count("->") == 5

    full = letter.trace(name="Bo")
    assert full.complete and [n.kind for n in full.nodes].count("Select") == 1
