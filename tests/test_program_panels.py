"""The program widget's debugger panels after real programs on the real model: Variables
(values and each gen's and select's meta), Call stack (nested calls, the current frame
marked), per-Node timing in the stepper, a token click selecting its Node; and the views
that send only what changed (the stepper's Node list, the cache tree)."""

from __future__ import annotations

import pytest
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.notebook.widgets import CacheTreeView, ProgramWidget
from sgl_nb.notebook.widgets.keyed import Item, KeyedView
from sgl_nb.notebook.widgets.timing import Timings
from sgl_nb.runtime.events import CacheHit, InstructionFinished, InstructionStarted, Op, Token

slow = pytest.mark.slow


@sgl.function
def inner(s, topic):
    s += f" One word about {topic}:"
    s += sgl.gen("word", max_tokens=4, ignore_eos=True)
    s["word_len"] = len(s["word"])  # the body reads the value: it waits here, inside inner


@sgl.function
def outer(s):
    s += "Pick an animal: "
    s += sgl.select("pick", choices=["cat", "dog"])
    s += "."
    inner(s, topic="pets")
    s += " The end."


@sgl.function
def radix(s):
    s += "Radix trees share prefixes."
    s += sgl.gen("x", max_tokens=3, ignore_eos=True)


def watch(runtime, fn, **kwargs):
    """What %%sgl does: the widget subscribes first, then the program starts."""
    w = ProgramWidget(runtime, title=fn.__name__)
    st = fn.run(stream=True, debug=True, **kwargs)
    w.attach(st)
    return w, st


def sent_keys(view: KeyedView, since: int) -> set[str]:
    return {item["k"] for patch in list(view.sent)[since:] for item in patch.get("set", [])}


@slow
def test_variables_call_stack_and_timing_of_a_nested_call(default_backend):
    w, st = watch(default_backend, outer, step=True, passes=())
    st.debug.breakpoint(name="word")
    st.debug.continue_()
    assert st.debug.wait_until_held(WAIT), "the program never reached gen word"
    w.sync()

    # Held at gen "word", inside inner: the stack is outer > inner, inner is current.
    gen = next(n for n in st.nodes if n.name == "word")
    assert w.stepper.current_node == gen.id and w.stepper.waiting_at == "node"
    assert w.call_stack.names() == ["outer", "inner"]
    assert [f.current for f in w.call_stack.frames] == [False, True]
    current = w.call_stack.current
    assert current.function == "inner" and current.line == gen.line
    assert current.args == "topic='pets'"  # the body waits inside inner: its frame is live
    assert 'sgl.gen("word"' in current.source
    assert "sgl-frame sgl-current" in w.call_stack.html() and "▶ inner(" in w.call_stack.html()

    # The select ran: its variable and scores are there; word is not bound yet.
    pick = w.variables.get("pick")
    assert pick.kind == "Select" and pick.value == repr(st.snapshot().vars["pick"])
    scores = pick.meta_dict()["scores"]
    assert "'cat': " in scores and "'dog': " in scores
    with pytest.raises(KeyError):
        w.variables.get("word")

    st.debug.continue_()
    assert w.wait(WAIT), "the widget never made its final render"
    assert st.error() is None
    assert [v.name for v in w.variables.variables] == ["pick", "word", "word_len"]
    word = w.variables.get("word")
    meta = word.meta_dict()
    assert word.kind == "Gen" and word.value == repr(st["word"])
    assert meta["finish_reason"] == "length" and meta["completion_tokens"] == "4"
    assert int(meta["prompt_tokens"]) > 0 and "cached_tokens" in meta
    assert w.variables.get("word_len").value == repr(len(st["word"]))
    assert w.variables.get("word_len").kind is None  # set by the program's code
    shown = w.variables.html()
    assert 'data-var="word"' in shown and "finish_reason=length" in shown
    assert w.call_stack.frames == [] and "program finished" in w.call_stack.html()

    # Per-Node timing in the stepper's list: queue, prefill, decode, cached tokens.
    rows = {r.id: r for r in w.stepper.rows}
    t = w.timings.node(gen.id)
    assert t.requests == 1 and t.queue_s is not None and t.queue_s >= 0
    assert t.prefill_s > 0 and t.decode_s > 0 and t.output_tokens == 4
    assert t.prompt_tokens > 0 and 0 <= t.cached_tokens < t.prompt_tokens
    assert "queue " in rows[gen.id].timing and "decode " in rows[gen.id].timing
    assert f"cache {t.cached_tokens}/{t.prompt_tokens} tok" in rows[gen.id].timing
    select = next(n for n in st.nodes if n.name == "pick")
    ts = w.timings.node(select.id)
    assert ts.requests == 2 and ts.prefill_s > 0 and ts.decode_s is None  # two Scores
    assert "sgl-timing" in w.stepper.graph.html()


@slow
def test_a_token_click_selects_its_node_and_line(default_backend):
    w, st = watch(default_backend, outer)
    assert w.wait(WAIT)
    gen = next(n for n in st.nodes if n.name == "word")
    assert w.stream.has_trait("clicked_node"), "the stream view has no clicked_node trait"
    w.stream.clicked_node = gen.id  # what a click on one of its tokens sets
    assert w.stepper.node_choice.value == gen.id
    assert w.stepper.selected_source == f'{gen.line}: s += sgl.gen("word", max_tokens=4, ' \
                                         'ignore_eos=True)'
    assert f'data-node="{gen.id}" data-selected="1"' in w.stepper.graph.html()
    assert "cell line" in w.stepper.source_html.value
    text = next(n for n in st.nodes if n.kind == "Text")
    w.stream.clicked_node = text.id
    assert w.stepper.node_choice.value == text.id
    assert f'data-node="{gen.id}" data-selected' not in w.stepper.graph.html()
    assert not w.select_node(10**9)  # no such Node: nothing moves
    assert w.stepper.node_choice.value == text.id
    w.stepper.graph.clicked = f"n{gen.id}"  # a click on the Node's row in the list
    assert w.stepper.node_choice.value == gen.id and w.stepper.selected_source.startswith(
        f"{gen.line}: ")
    # Displayed, it carries a static copy for viewers that run no widgets.
    bundle = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    static = bundle["text/html"]
    assert 'class="sgl-static-status">done<' in static and st["word"].strip() in static
    assert f'data-node="{gen.id}"' in static and "[done]" in static and 'data-var="pick"' in static


@slow
def test_the_stepper_sends_only_the_nodes_that_changed(default_backend):
    w, st = watch(default_backend, outer, step=True, passes=())
    assert st.debug.wait_until_held(WAIT)
    w.sync()
    graph = w.stepper.graph
    keys = [it.key for it in graph.items if not it.parent]  # a row per Node
    assert len(keys) >= 4  # the body recorded up to gen word before it waits
    mark = len(graph.sent)
    w.sync()
    assert len(graph.sent) == mark, "an unchanged render sent something"
    first, second = keys[0], keys[1]
    w.stepper.step_node.click()
    assert st.debug.wait_until_held(WAIT)
    w.sync()
    changed = {k.split(".")[0] for k in sent_keys(graph, mark)}  # rows of these Nodes
    assert changed and changed <= {first, second}, changed  # the rest was not re-sent
    st.debug.continue_()
    assert w.wait(WAIT)
    assert graph.snapshot and {row["k"] for row in graph.snapshot} == {
        it.key for it in graph.items}  # the final list is in the saved widget state


@slow
def test_the_cache_tree_sends_only_the_subtree_that_changed(default_backend, runtime):
    radix.run()
    view = CacheTreeView(max_nodes=100_000)  # every node of the session's tree shown
    view.update(runtime.engine.cache, runtime.tokenizer)
    before = {it.key: it for it in view.tree.items}
    assert len(before) > 2
    mark = len(view.tree.sent)
    view.update(runtime.engine.cache, runtime.tokenizer)
    assert len(view.tree.sent) == mark  # nothing changed, nothing sent
    runtime.generate("Zebras never queue for the cache.", max_tokens=2)
    view.update(runtime.engine.cache, runtime.tokenizer)
    changed = sent_keys(view.tree, mark)
    new = {k for k in (it.key for it in view.tree.items) if k not in before}
    assert new and new <= changed
    assert changed - new <= {"head"}, changed - new  # the old subtrees were not re-sent
    assert "Zebras" in view.tree.html()


def test_keyed_view_diffs():
    v = KeyedView()
    v.show([Item("a", "A"), Item("b", "B", parent="a")])
    assert v.patches == 1 and v.rows_sent == 2
    assert v.show([Item("a", "A"), Item("b", "B", parent="a")]) == {}
    patch = v.show([Item("a", "A"), Item("b", "B2", parent="a"), Item("c", "C")])
    assert patch["set"] == [{"k": "b", "h": "B2", "p": "a"}, {"k": "c", "h": "C"}]
    assert patch["order"] == {"": ["a", "c"]}
    patch = v.show([Item("c", "C")])
    assert patch == {"del": ["a", "b"], "order": {"": ["c"]}}
    assert '<div class="sgl-item" data-key="c"><div>C</div>' in v.html()
    v.freeze()
    assert v.snapshot == [Item("c", "C").as_dict()]


def test_timings_fold_queue_prefill_decode():
    from sgl_nb.notebook.widgets.timing import Timings
    from sgl_nb.runtime.events import CacheHit, InstructionFinished, InstructionStarted, Op, Token

    def ev(cls, ts, **fields):
        return cls(program=1, node=7, request=3, ts=ts, **fields)

    t = Timings()
    for e in [ev(InstructionStarted, 1_000, op=Op.DECODE),
              ev(CacheHit, 51_000, cached_tokens=3, prompt_tokens=10),
              ev(Token, 2_051_000), ev(Token, 3_000_000),
              ev(CacheHit, 3_500_000, cached_tokens=9, prompt_tokens=12),  # re-admitted
              ev(InstructionFinished, 5_051_000, op=Op.DECODE, usage={
                  "input_tokens": 10, "cached_tokens": 3, "output_tokens": 2})]:
        t.apply(e)
    n = t.node(7)
    assert n.requests == 1 and n.queue_s == pytest.approx(50e-6)
    assert n.prefill_s == pytest.approx(2e-3) and n.decode_s == pytest.approx(3e-3)
    assert (n.prompt_tokens, n.cached_tokens, n.output_tokens) == (10, 3, 2)
    assert n.cache_hit == pytest.approx(0.3)
    assert n.summary() == "queue 0 ms · prefill 2 ms · decode 3 ms · cache 3/10 tok"
    assert t.node(8).requests == 0 and t.node(8).summary() == ""


def test_timing_keeps_engine_events_that_come_before_the_start():
    """The executor reports an Instruction's start once the engine has its request, which
    may have admitted it and decoded already: those events still count, and its queue
    time is 0, not negative."""
    t = Timings()
    t.apply(CacheHit(request=7, ts=1_000, cached_tokens=3, prompt_tokens=10))
    t.apply(Token(request=7, ts=3_000_000))
    t.apply(InstructionStarted(node=2, request=7, op=Op.DECODE, ts=5_000))
    t.apply(InstructionFinished(node=2, request=7, op=Op.DECODE, ts=9_000_000))
    got = t.node(2)
    assert got.requests == 1 and got.queue_s == 0
    assert got.prefill_s == (3_000_000 - 1_000) / 1e9 and got.decode_s == 6_000_000 / 1e9
    assert (got.cached_tokens, got.prompt_tokens) == (3, 10)
