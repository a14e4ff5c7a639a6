"""Each compiler pass: a program where it applies, the count it reports, and the same
output with the pass off. Also f.trace: the static graph as a listing and as DOT."""

from __future__ import annotations

import pytest

import sgl_nb as sgl
from sgl_nb.runtime.compiler.ir import Node
from sgl_nb.runtime.compiler.passes import fuse_text, shared_prefix

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


def test_shared_prefix_pass_computes_the_batch_prefix_once(runtime):
    @sgl.function
    def review(s, item):
        s += "You are a careful reviewer of household objects. " * 8
        s += f"Review: {item}\n"
        s += sgl.gen("r", max_tokens=4)

    items = [{"item": x} for x in ("kettle", "lamp", "chair", "rug")]
    runtime.engine.cache.reset()
    on = review.run_batch(items)
    report = review.last_batch_report
    assert report.name == "shared_prefix" and report.changed == 4
    runtime.engine.cache.reset()
    off = review.run_batch(items, passes=())
    assert review.last_batch_report is None
    assert [s["r"] for s in on] == [s["r"] for s in off]


def test_pass_functions_on_nodes():
    a = Node("Text", 1, [], None, {"text": "a"})
    b = Node("Text", 1, [a.id], None, {"text": "b"})
    g = Node("Gen", 1, [b.id], "x", {})
    nodes, report = fuse_text([a, b, g])
    assert [n.kind for n in nodes] == ["Text", "Gen"] and nodes[0].detail["text"] == "ab"
    assert report.changed == 1
    common, rep = shared_prefix(["abcX", "abcY", "abZ"])
    assert common == "ab" and rep.changed == 3
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
