"""Time travel in the program widget, driven from Python on the real model: a token click's
"why" message answered with the alternatives state.token_info gives, and "Re-run from here"
with an edited value, with new sampling arguments, and with a bad edit (the error shown,
nothing started)."""

from __future__ import annotations

import html
import math
import time

import pytest
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.language.rerun_cursor import MISSING
from sgl_nb.notebook.widgets import ProgramWidget
from sgl_nb.notebook.widgets.rerun_panel import parse_edit
from sgl_nb.runtime.compiler.ir import NodeKind

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]


@sgl.function
def capital(s):
    s += "The capital of France is"
    s += sgl.gen("city", max_tokens=4, ignore_eos=True)
    s += ". Is that right? Answer: "
    s += sgl.gen("ok", regex=r"(yes|no)", max_tokens=3)
    s += " The end."


def watch(runtime, fn, **kwargs):
    """What %%sgl does: the widget subscribes first, then the program starts."""
    w = ProgramWidget(runtime, title=fn.__name__)
    st = fn.run(stream=True, debug=True, **kwargs)
    w.attach(st)
    assert w.wait(WAIT), "the widget never made its final render"
    assert st.error() is None, st.error()
    return w, st


def wire(view) -> list:
    """The custom messages the view's comm publishes from now on (its content)."""
    sent, publish = [], view.comm.publish_msg

    def record(msg_type, data=None, metadata=None, buffers=None, **keys):
        if (data or {}).get("method") == "custom":
            sent.append(data["content"])
        return publish(msg_type, data=data, metadata=metadata, buffers=buffers, **keys)

    view.comm.publish_msg = record
    return sent


def ask(view, **content) -> None:
    """A message from stream.js, as the kernel's comm delivers it."""
    view.comm.handle_msg({"content": {"data": {"method": "custom", "content": content}},
                          "buffers": []})


def node(st, name):
    return next(n for n in st.nodes if n.name == name)


def test_why_this_token_lists_what_token_info_lists(runtime):
    w, st = watch(runtime, capital)
    sent = wire(w.stream)
    for var in ("city", "ok"):
        gen = node(st, var)
        for i in range(len(st.snapshot().tokens[gen.id])):
            ask(w.stream, type="why", node=gen.id, index=i)
            reply, info = sent[-1], st.token_info(var, i)
            assert reply["type"] == "why" and (reply["node"], reply["index"]) == (gen.id, i)
            assert [r[1] for r in reply["top"]][:len(info.top)] == [a.text for a in info.top]
            assert [r[2] for r in reply["top"]][:len(info.top)] == pytest.approx(
                [math.exp(a.logprob) for a in info.top], abs=1e-4)
            assert [r[3] for r in reply["top"]][:len(info.top)] == [a.masked for a in info.top]
            taken = [r for r in reply["top"] if r[4]]
            assert len(taken) == 1 and taken[0][1] == info.text == reply["text"]
            assert reply["token"] == info.token
            assert (reply["forced"], reply["allowed"]) == (info.forced, info.allowed)
            assert reply["line"] == info.line == gen.line
            assert f'sgl.gen("{var}"' in reply["source"]
            assert reply["instruction"] == str(info.instruction)
            assert (reply["cached"], reply["prompt"]) == (info.cached_tokens,
                                                         info.prompt_tokens)
    # The regex gen's grammar: its allowed counts, and what it masked at the first step.
    first = st.token_info("ok", 0)
    assert first.allowed > 0 and sent[-len(st.snapshot().tokens[node(st, "ok").id])]["allowed"] > 0
    assert first.masked, "the regex masked none of the top alternatives"
    # A token the view does not have is answered with why not; nothing else is sent.
    ask(w.stream, type="why", node=node(st, "city").id, index=99)
    assert "no generated token 99" in sent[-1]["error"]
    ask(w.stream, type="why", node="x", index=0)
    assert "error" in sent[-1]


def test_rerun_from_a_token_click_with_an_edited_value(runtime):
    w, st = watch(runtime, capital)
    assert w.rerun_panel is None  # nothing of it is sent before a user selects a Node
    gen = node(st, "city")
    w.stream.clicked_node = gen.id  # a click on one of its tokens
    panel = w.rerun_panel
    assert panel is not None and panel.children[-1] is panel.runs
    assert panel.node.id == gen.id and panel.value.value == st["city"]
    assert panel.sampling.layout.display is None and "Gen city" in panel.heading.value
    panel.value.value = " Lyon"
    panel.button.click()
    assert len(panel.runs_started) == 1 and len(panel.runs.children) == 1
    new = panel.runs_started[0]
    shown, diff = panel.runs.children[0].children
    assert isinstance(shown, ProgramWidget) and "re-run of capital from #" in shown.title.value
    assert shown.wait(WAIT), "the re-run's widget never made its final render"
    assert new.error() is None and new["city"] == " Lyon"
    assert new.text().startswith("The capital of France is Lyon. Is that right?")
    assert shown.stream.text == new.text()  # its widget saw every event from the start
    assert new.rerun_of.id == st.id
    assert diff.value == sgl.diff(new)._repr_html_() and "sgl-diff" in diff.value
    assert "Lyon" in diff.value
    assert f"started program {new.id}" in panel.message.value


def test_rerun_a_gen_with_new_sampling_args(runtime):
    w, st = watch(runtime, capital)
    gen = node(st, "city")
    w.stepper.graph.clicked = f"n{gen.id}"  # a click on its row in the Node list
    panel = w.rerun_panel
    panel.sampling.value = "temperature=0.9 seed=3 max_tokens=2"
    panel.button.click()
    new = panel.runs_started[0]
    shown = panel.runs.children[0].children[0]
    assert shown.wait(WAIT) and new.error() is None
    assert len(new.snapshot().tokens[node(new, "city").id]) == 2  # generated again, new args
    assert new.text().startswith("The capital of France is")


def test_a_bad_edit_shows_the_error_and_starts_nothing(runtime):
    w, st = watch(runtime, capital)
    gen = node(st, "city")
    assert w.select_node(gen.id)
    panel = w.rerun_panel
    subscribers = runtime.events.listeners
    for bad, says in (("temprature=0.8", "unknown sampling arguments ['temprature']"),
                      ("temperature", "sampling arguments are key=value pairs")):
        panel.sampling.value = bad
        panel.button.click()
        assert says in html.unescape(panel.message.value), panel.message.value
        assert "color:#b91c1c" in panel.message.value
    assert panel.runs_started == [] and panel.runs.children == ()
    assert runtime.events.listeners == subscribers  # no re-run widget was made
    # A value and sampling arguments at once: the arguments win (generated again), as in
    # the TUI's dialog; a value alone for a Gen replaces its text (the other tests).
    assert parse_edit(NodeKind.GEN, " Lyon", "seed=1") == (MISSING, {"seed": 1})


def test_parse_edit():
    assert parse_edit(NodeKind.GEN, " Lyon", "") == (" Lyon", {})
    assert parse_edit(NodeKind.GEN, "", "") == (MISSING, {})
    assert parse_edit(NodeKind.GEN, " Lyon", "temperature=0.8 seed=2") == (
        MISSING, {"temperature": 0.8, "seed": 2})
    assert parse_edit(NodeKind.SELECT, "", "ignored=1") == ("", {})
    with pytest.raises(ValueError, match="key=value"):
        parse_edit(NodeKind.GEN, "", "temperature")


def test_rerun_from_a_text_node(runtime):
    w, st = watch(runtime, capital)
    text = next(n for n in st.nodes if n.kind == "Text" and "Is that right" in n.label())
    assert w.select_node(text.id)
    panel = w.rerun_panel
    assert panel.value.value == ". Is that right? Answer: "
    assert panel.sampling.layout.display == "none"  # sampling arguments are a Gen's
    panel.value.value = ". Is that wrong? Answer: "
    panel.button.click()
    new = panel.runs_started[0]
    assert panel.runs.children[0].children[0].wait(WAIT) and new.error() is None
    assert new["city"] == st["city"]  # replayed from the record
    assert f"{st['city']}. Is that wrong? Answer: " in new.text()


@sgl.function
def long_story(s):
    s += "Once upon a time"
    s += sgl.gen("story", max_tokens=4096, ignore_eos=True)


def test_a_running_program_is_not_rerun(runtime):
    """The click returns at once with a message: re-running waits for the program to end,
    which on the kernel's shell thread would hold every widget message meanwhile."""
    w = ProgramWidget(runtime, title="long_story")
    st = long_story.run(stream=True, debug=True)
    w.attach(st)
    try:
        deadline = time.monotonic() + WAIT
        while not any(n.kind == "Gen" for n in st.nodes) or not w.select_node(
                next(n for n in st.nodes if n.kind == "Gen").id):
            assert time.monotonic() < deadline, "the gen never showed in the stepper"
            w.sync()
        w.rerun_panel.button.click()
        assert not st.finished, "the program ended before the click"
        assert "still running" in w.rerun_panel.message.value
        assert w.rerun_panel.runs_started == []
    finally:
        st.cancel()
        assert w.wait(WAIT)
