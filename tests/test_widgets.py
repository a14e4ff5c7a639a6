"""The notebook widgets after real programs on the real model: the stream view, the stepper
(driven by its own buttons' click()), the cache tree; and the throttle that keeps them at
~30 updates a second."""

from __future__ import annotations

import html
import json
import re

import pytest
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.notebook.widgets import CacheTreeView, EventPump, ProgramWidget, Throttle
from sgl_nb.notebook.widgets.stepper import parse_breakpoint
from sgl_nb.runtime.compiler.step_controller import Breakpoint
from sgl_nb.runtime.events import EventBus, ProgramFinished, Token

slow = pytest.mark.slow


@sgl.function
def qa(s, q):
    s += sgl.user(q)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, ignore_eos=True))


@sgl.function
def pick_and_fork(s):
    s += "Pick a colour for the logo: "
    s += sgl.select("colour", choices=["red", "blue"])
    s += ". Two slogans:"
    forks = s.fork(2)
    forks += lambda i: f"\nSlogan {i + 1}:"
    forks += sgl.gen("slogan", max_tokens=4, ignore_eos=True)
    forks.join()


@sgl.function
def story(s):
    s += "Once upon a time"
    s += ", in a small town,"
    s += sgl.gen("a", max_tokens=4, ignore_eos=True)
    s += " Then"
    s += sgl.gen("b", max_tokens=3, ignore_eos=True)


@sgl.function
def verdict(s):
    s += "Is the sky blue? Reply in JSON.\n"
    s += sgl.gen("json", max_tokens=16, regex=r'\{"answer": "(yes|no)"\}')


def plain(markup: str) -> str:
    """The text a browser shows for the stream view's HTML (the style block dropped)."""
    body = markup.split("</style>", 1)[-1]
    return html.unescape(re.sub(r"<[^>]+>", "", body))


def watch(runtime, fn, **kwargs):
    """What %%sgl does: the widget subscribes first, then the program starts."""
    w = ProgramWidget(runtime, title=fn.__name__)
    st = fn.run(stream=True, debug=True, **kwargs)
    w.attach(st)
    return w, st


@slow
def test_stream_view_after_a_program(default_backend):
    w, st = watch(default_backend, qa, q="Name a fruit.")
    assert w.wait(WAIT), "the widget never made its final render"
    view = w.stream
    assert view.text == st.text() and st.text().endswith(st["answer"] + "<|im_end|>\n")
    assert w.status == view.status == "done"
    assert view.generated_tokens == 8 and view.prompt_tokens > 0 and view.tok_per_s > 0
    markup = view.static_html()  # what the front end draws, as HTML
    assert 'data-var="answer"' in markup and '<span class="sgl-role">user</span>' in markup
    assert markup.count(
        '<span class="sgl-generated" style="background:#dcfce7" title=') == 8
    assert "tok/s" in view.header.value
    state = json.loads(json.dumps(view.get_state()))  # the final state lives in the traits
    assert state["text"] == st.text() and state["generated_tokens"] == 8


@sgl.function
def fruits(s):
    s += "Three fruits, one per line:\n1."
    s += sgl.gen("first", max_tokens=12, stop="\n")
    s += "\n2."
    s += sgl.gen("second", max_tokens=12, stop="\n")


@slow
def test_stop_string_is_cut_and_the_path_found(default_backend, runtime):
    w, st = watch(default_backend, fruits)
    assert w.wait(WAIT)
    assert w.stream.text == st.text()  # the tokens of a matched stop string are not shown
    assert "\n" not in st["first"] and "\n" not in st["second"]
    # The cache path follows the engine's own tokens down to the second gen's leaf.
    cache = runtime.engine.cache
    by_id = {n.id: n for n in cache.nodes()}
    path = [by_id[i] for i in w.cache.path]
    assert path and all(b.parent is a for a, b in zip(path, path[1:]))
    assert path[-1].is_leaf()
    cached = runtime.tokenizer.decode([t for node in path for t in node.key])
    # The tree holds every token but the last sampled one (its KV is never computed),
    # unless that one was a prompt-lookup draft the model took (computed when checked).
    second = next(n for n in w.timeline.nodes.values() if n.name == "second")
    tokens = second.tokens if second.tokens[-1].drafted else second.tokens[:-1]
    kept = "".join(t.text for t in tokens)
    assert st.text().startswith(cached) and cached.endswith("2." + kept)


@slow
def test_token_probability_on_hover(default_backend):
    """Token events carry each token's logprob (runtime/events.py): its probability shows
    as the token's HTML title."""
    w, st = watch(default_backend, qa, q="Name a tree.")
    assert w.wait(WAIT)
    titles = re.findall(r'<span class="sgl-generated" style="background:#dcfce7" '
                        r'title="p=([0-9.]+) token \d+" '
                        r'data-node="(\d+)">', w.stream.static_html())
    gen = next(n for n in st.nodes if n.kind == "Gen")
    assert len(titles) == 8 and all(0.0 < float(p) <= 1.0 for p, _ in titles)
    assert {int(node) for _, node in titles} == {gen.id}  # a click selects the gen


@slow
def test_cached_prompt_is_marked(default_backend):
    first, st1 = watch(default_backend, qa, q="Name a colour of the rainbow.")
    assert first.wait(WAIT)
    second, st2 = watch(default_backend, qa, q="Name a colour of the rainbow.")
    assert second.wait(WAIT)
    assert second.stream.cached_tokens > 0
    assert 'class="sgl-cached"' in second.stream.static_html()
    assert st2.text() == st1.text()


@slow
def test_grammar_forced_tokens(default_backend):
    w, st = watch(default_backend, verdict)
    assert w.wait(WAIT)
    assert st["json"] in ('{"answer": "yes"}', '{"answer": "no"}')
    assert w.stream.forced_tokens > 0
    assert 'class="sgl-forced"' in w.stream.static_html()
    assert "forced by the grammar" in w.stream.static_html()


@slow
def test_select_and_fork_in_the_stream(default_backend):
    w, st = watch(default_backend, pick_and_fork)
    assert w.wait(WAIT)
    markup = w.stream.static_html()
    assert st["colour"] in ("red", "blue") and 'data-var="colour"' in markup
    assert "branch 0" in markup and "branch 1" in markup
    assert markup.count('data-var="slogan"') == 2
    for i, slogan in enumerate(st["slogan"]):
        assert f"Slogan {i + 1}:{slogan}" in plain(markup) and len(slogan) > 0
    assert w.stream.generated_tokens == 8  # two branches of 4 (a select scores, samples none)
    assert re.search(f'title="chosen by select" data-node="\\d+">{st["colour"]}<', markup)
    listed = [node_id for _label, node_id in w.stepper.node_choice.options]
    assert sorted(listed) == sorted(n.id for n in st.nodes if n.kind not in ("Init", "Return"))


@slow
def test_stepper_buttons(default_backend):
    w, st = watch(default_backend, story, step=True, passes=())
    stepper, debug = w.stepper, st.debug

    def settle():
        assert debug.wait_until_held(WAIT), "the program never paused"
        w.sync()

    settle()
    nodes = [n for n in st.nodes if n.kind not in ("Init", "Return")]
    assert stepper.waiting_at == "node" and stepper.current_node == nodes[0].id
    assert stepper.current_instruction == "Extend (next)"
    assert f'sgl-node sgl-current" data-node="{nodes[0].id}"' in stepper.graph.html()

    stepper.step_node.click()
    settle()
    assert stepper.current_node == nodes[1].id and nodes[0].status == "done"
    stepper.step_node.click()
    settle()
    gen_a = nodes[2]
    assert stepper.current_node == gen_a.id and gen_a.kind == "Gen"

    stepper.step_instruction.click()  # the prefill: the first token, then it holds
    settle()
    assert stepper.waiting_at == "decode" and stepper.current_instruction == "Decode (token 2)"
    stepper.step_instruction.click()
    settle()
    assert stepper.current_instruction == "Decode (token 3)"
    assert w.stream.generated_tokens == 2

    # A breakpoint on Gen b from the node list, one more by spec; then Continue.
    gen_b = nodes[-1]
    stepper.node_choice.value = gen_b.id
    stepper.toggle_bp.click()
    assert Breakpoint("b", "Gen", gen_b.line) in debug.breakpoints
    stepper.bp_spec.value = "kind=Bogus line=x"
    stepper.add_bp.click()
    assert "line= takes a number" in stepper.message
    stepper.continue_button.click()
    settle()
    assert stepper.current_node == gen_b.id and stepper.waiting_at == "node"
    assert any(bp.startswith("name=b kind=Gen") for bp in stepper.breakpoints)
    assert f'<span class="sgl-bp">●</span> #{gen_b.id}' in stepper.graph.html()

    stepper.pause_button.click()
    assert debug.paused
    stepper.continue_button.click()
    assert w.wait(WAIT)
    assert st.error() is None and w.status == "done"
    assert stepper.controls.display == "none"  # a finished program has nothing to step


def test_parse_breakpoint():
    assert parse_breakpoint("answer") == Breakpoint(name="answer")
    assert parse_breakpoint("kind=Gen line=3") == Breakpoint(kind="Gen", line=3)
    for bad in ("", "colour=red", "line=three"):
        with pytest.raises(ValueError):
            parse_breakpoint(bad)


@slow
def test_cache_tree_view(default_backend, runtime):
    w, st = watch(default_backend, qa, q="What is a radix tree?")
    assert w.wait(WAIT)
    view = w.cache
    assert view.nodes > 0 and view.cached_tokens > 0 and len(view.path) > 0
    tree = view.tree.html()
    assert "radix tree" in tree and "evictable" in tree and "hits" in tree
    # this program's path is highlighted
    assert re.search(r'class="sgl-item [^"]*\bsgl-onpath\b', tree)
    small = CacheTreeView(max_nodes=1)
    small.update(runtime.engine.cache, runtime.tokenizer)
    if small.nodes > 1:
        assert "more nodes" in small.tree.html()


@slow
def test_cache_tree_shows_locked_nodes_while_a_request_runs(default_backend):
    w, st = watch(default_backend, story, step=True, passes=())
    st.debug.breakpoint(name="a")
    st.debug.continue_()
    assert st.debug.wait_until_held(WAIT)
    st.debug.step_instruction()  # prefill the Gen: its request now holds its prefix
    assert st.debug.wait_until_held(WAIT)
    other = qa.run(q="Another program, run while this one is held.")
    w.sync()
    assert w.cache.locked_tokens > 0 and "locked×" in w.cache.tree.html()
    assert other.id not in w.timeline.programs  # the widget folds its own program's events
    st.debug.continue_()
    assert w.wait(WAIT)


def test_a_cut_tree_shows_the_path_and_the_nodes_in_use(model_path):
    """Past max_nodes the view cuts what no one uses: this program's path and the locked
    nodes come first, whatever order the tree holds its children in."""
    import torch
    from transformers import AutoTokenizer

    from sgl_nb.runtime.radix_cache import RadixCache

    tok = AutoTokenizer.from_pretrained(str(model_path))
    cache = RadixCache(None)
    texts = [f"Document number {i} says something else." for i in range(40)]
    for text in texts:
        ids = tok.encode(text)
        cache.insert(ids, torch.arange(len(ids)))
    _, node = cache.match_prefix(tok.encode(texts[-1]))
    cache.inc_lock_ref(node)
    view = CacheTreeView(max_nodes=4)
    view.update(cache, tok, program_tokens=tok.encode(texts[-2]))
    tree = html.unescape(view.tree.html())
    assert "more nodes" in tree and "locked×1" in tree
    # Digits split the edges: "Document number ", "3", then "8 ..." (the program's) before
    # "9 ..." (the locked one).
    edges = re.findall(r'class="sgl-edge" title="([^"]*)"', tree)
    assert edges == ["Document number ", "3", "8 says something else.",
                     "9 says something else."]


def test_throttle_limits_the_rate():
    now = [100.0]
    t = Throttle(rate=30, clock=lambda: now[0])
    assert t.due()
    t.mark()
    now[0] += 0.01
    assert not t.due() and 0.02 < t.wait_s() < 0.03
    now[0] += 0.03
    assert t.due()
    with pytest.raises(ValueError, match="rate"):
        Throttle(rate=0)


def test_pump_coalesces_events_and_renders_the_final_state():
    bus = EventBus()
    q = bus.subscribe()
    seen, renders = [], []
    done = lambda: any(isinstance(e, ProgramFinished) for e in seen)  # noqa: E731
    pump = EventPump(q, seen.extend, lambda: renders.append(len(seen)), done, rate=30).start()
    for i in range(2000):
        bus.emit(Token, program=1, node=1, token=i, text="x")
    bus.publish(ProgramFinished(program=1))
    assert pump.join(WAIT)
    assert len(seen) == 2001 and renders[-1] == 2001  # lossless, and the last render saw all
    assert len(renders) < 2001  # many events per render


@slow
def test_stepper_on_a_remote_backend_steps_by_node_only(runtime):
    from sgl_nb.backends.runtime_endpoint import RuntimeEndpoint
    from sgl_nb.server.serve import start_in_thread

    server = start_in_thread(runtime)
    try:
        ep = RuntimeEndpoint(server.url)
        w = ProgramWidget(ep, title="remote story")
        st = story.run(stream=True, step=True, backend=ep, passes=())
        w.attach(st)
        assert st.debug.wait_until_held(WAIT)
        w.sync()
        assert w.stepper.step_instruction.disabled and not w.stepper.step_node.disabled
        assert "Node only" in w.stepper.message
        before = st.debug.current
        w.stepper.step_node.click()
        assert st.debug.wait_until_held(WAIT) and st.debug.current is not before
        st.debug.continue_()
        assert st.text().startswith("Once") and st.error() is None
    finally:
        server.shutdown()
        server.server_close()


@slow
def test_stop_button_cancels_the_program(default_backend):
    @sgl.function
    def tale(s):
        s += "A long tale:" + sgl.gen("t", max_tokens=2000, ignore_eos=True)

    w, st = watch(default_backend, tale)
    assert w.stop_button.layout.display is None and not w.stop_button.disabled  # shown
    next(st.text_iter("t"))
    w.stop_button.click()  # what the browser's click does on the kernel side
    st.wait(WAIT)
    assert w.wait(WAIT)
    assert isinstance(st.error(), sgl.ProgramCancelled) and st["t"]
    assert w.status == "cancelled" and w.stop_button.layout.display == "none"
    assert w.stream.text.endswith(st["t"])  # what it produced stays in the view


def test_a_frozen_keyed_view_sends_its_changes_as_the_snapshot():
    from sgl_nb.notebook.widgets.keyed import Item, KeyedView

    v = KeyedView(items=[Item("none", "nothing yet")])  # opened with it: no patch sent
    assert v.patches == 0 and v.snapshot == [{"k": "none", "h": "nothing yet"}]
    v.show([Item("a", "A")])
    assert v.patches == 1
    v.freeze()
    assert v.snapshot == [{"k": "a", "h": "A"}]
    with v.hold_sync():  # the owner's render: the final rows and the snapshot, one message
        assert v.show([Item("a", "A2"), Item("b", "B")]) != {}
    assert v.patches == 1 and v.snapshot == [{"k": "a", "h": "A2"}, {"k": "b", "h": "B"}]
    assert v.show([Item("a", "A2"), Item("b", "B")]) == {} and v.patches == 1
