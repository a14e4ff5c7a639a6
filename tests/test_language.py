"""SGLang-style programs on our engine: roles, select, fork/join, var_scope, streaming,
async, batches and errors. Uses the session's real Runtime as the default backend."""

from __future__ import annotations

import asyncio

import pytest
import torch

import sgl_nb as sgl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]


@sgl.function
def qa(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=16))


def test_roles_follow_the_chat_template(runtime):
    st = qa.run(question="What is the capital of France?")
    want = runtime.apply_chat_template([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ])
    assert st.text().startswith(want)
    assert st.messages()[:2] == [{"role": "system", "content": "You are terse."},
                                 {"role": "user", "content": "What is the capital of France?"}]
    assert st.messages()[2] == {"role": "assistant", "content": st["answer"]}
    # Same tokens as asking the engine directly with the same prompt.
    assert st["answer"] == runtime.generate(want, max_tokens=16).text


def test_with_blocks_and_default_system_prompt(runtime):
    @sgl.function
    def chat(s):
        with s.user():
            s += "Say hi."
        with s.assistant():
            s += sgl.gen("reply", max_tokens=8)

    st = chat.run()
    want = runtime.apply_chat_template([{"role": "user", "content": "Say hi."}])
    assert st.text().startswith(want)  # the template's own default system prompt first
    assert [m["role"] for m in st.messages()] == ["user", "assistant"]


def test_nested_roles_are_rejected():
    @sgl.function
    def nested(s):
        with s.user():
            with s.assistant():
                s += "x"

    st = nested.run()
    assert isinstance(st.error(), ValueError) and "nested roles" in str(st.error())


def test_select_scores_equal_transformers(runtime, hf_model):
    @sgl.function
    def pick(s):
        s += "Q: What colour is a ripe banana?\nA: It is"
        s += sgl.select("colour", [" yellow", " blue", " bright purple"])

    st = pick.run()
    meta = st.get_meta_info("colour")
    tok = runtime.tokenizer
    pre = tok.encode("Q: What colour is a ripe banana?\nA: It is")
    for choice, got in zip(meta["choices"], meta["normalized_prompt_logprobs"]):
        ids = pre + tok.encode(choice)
        with torch.inference_mode():
            lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
        want = sum(lp[p - 1, ids[p]].item() for p in range(len(pre), len(ids)))
        assert abs(got - want / (len(ids) - len(pre))) < 1e-4
    best = max(range(3), key=lambda i: meta["normalized_prompt_logprobs"][i])
    assert st["colour"] == meta["choices"][best]
    assert st.text().endswith(st["colour"])


@pytest.mark.parametrize("method", ["greedy_token_selection",
                                    "unconditional_likelihood_normalized"])
def test_other_select_methods(method):
    @sgl.function
    def pick(s):
        s += "The opposite of hot is"
        s += sgl.select("x", [" cold", " warm", " banana"], choices_method=method)

    st = pick.run()
    assert st["x"] in (" cold", " warm", " banana") and st.error() is None
    assert len(st.get_meta_info("x")["scores"]) == 3


def test_fork_gather_and_concatenate(runtime):
    @sgl.function
    def ideas(s):
        s += "Three hobbies, one per line:\n"
        forks = s.fork(3)
        forks += lambda i: f"{i + 1}."
        forks += sgl.gen("hobby", max_tokens=6, stop="\n")
        forks.join()
        with s.var_scope("summary"):
            s += "Chosen: " + ", ".join(h.strip() for h in s["hobby"])

    st = ideas.run()
    assert isinstance(st["hobby"], list) and len(st["hobby"]) == 3
    assert st["summary"].startswith("Chosen: ") and st.text().endswith(st["summary"])

    @sgl.function
    def encode_parallel(s):
        s += "Notes:"
        forks = s.fork(2)
        forks[0] += " alpha"
        forks[1] += " beta"
        forks.join(mode="concate_and_append")
        s += " end"

    assert encode_parallel.run().text() == "Notes: alpha beta end"


def test_fork_of_eight_holds_the_prefix_once(runtime):
    runtime.flush_cache()
    prefix = "The history of the lighthouse on the northern cape. " * 50

    @sgl.function
    def fan(s):
        s += prefix
        forks = s.fork(8)
        forks += lambda i: f" Chapter {i}:"
        forks += sgl.gen("c", max_tokens=4)
        forks.join()

    n_prefix = len(runtime.tokenizer.encode(prefix))
    assert n_prefix >= 500
    st = fan.run()
    assert st.error() is None and len(st["c"]) == 8
    # Eight branches, but the pool holds the prefix's KV once (plus small suffixes).
    assert runtime.engine.pool.used() < n_prefix + 8 * 20


def test_streaming_and_async(runtime):
    st = qa.run(question="Name a colour.", stream=True)
    chunks = list(st.text_iter("answer"))
    assert "".join(chunks) == st["answer"] and len(chunks) > 1

    fut = qa.run_async(question="Name an animal.")
    streamed = "".join(fut.stream("answer"))
    state = fut.result()
    assert fut.done() and streamed == state["answer"]

    async def main():
        return await qa.run_async(question="Name a fruit.")

    assert asyncio.run(main())["answer"]


def test_run_batch_shares_the_prefix(runtime):
    runtime.flush_cache()
    before = runtime.engine.scheduler.cached_prompt_tokens
    states = qa.run_batch([{"question": f"What is {i} plus {i}?"} for i in range(6)],
                          progress_bar=False)
    assert all(s.error() is None and s["answer"] for s in states)
    # The shared system turn is computed once, then read from the cache.
    assert runtime.engine.scheduler.cached_prompt_tokens - before >= 5 * 10


def test_exception_inside_program_keeps_its_line():
    @sgl.function
    def broken(s):
        s += "Hello"
        raise RuntimeError("boom in the program")

    st = broken.run()
    assert isinstance(st.error(), RuntimeError)
    assert st.error_line == broken.func.__code__.co_firstlineno + 3
    assert qa.run(question="Still fine?")["answer"]  # others unaffected


def test_unknown_variable_and_bad_expressions():
    st = qa.run(question="Hi")
    with pytest.raises(KeyError, match="unknown variable 'nope'"):
        st["nope"]
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", [])
    with pytest.raises(ValueError, match="choices_method"):
        sgl.select("x", ["a"], choices_method="vibes")


def test_constrained_gen_int_regex_and_json():
    import json
    import re

    @sgl.function
    def facts(s):
        s += "Q: How many legs does a spider have?\nA: "
        s += sgl.gen_int("legs", max_tokens=4)
        s += "\nQ: Write a date as YYYY-MM-DD.\nA: "
        s += sgl.gen("date", regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}", max_tokens=16)
        s += "\nQ: Describe a city as JSON.\nA: "
        s += sgl.gen("city", max_tokens=80, json_schema={
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24},
                           "population": {"type": "integer", "maximum": 10**9}},
            "required": ["name", "population"],
        })

    st = facts.run()
    assert st.error() is None, st.error()
    assert isinstance(st["legs"], int)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", st["date"])
    city = json.loads(st["city"])
    assert isinstance(city["name"], str) and isinstance(city["population"], int)


def test_invalid_regex_fails_before_any_token():
    @sgl.function
    def bad(s):
        s += "Number:"
        s += sgl.gen("n", regex="[0-9")

    st = bad.run()
    assert isinstance(st.error(), ValueError) and "[0-9" in str(st.error())
    assert st.text() == "Number:"


def test_graph_lists_nodes_and_instructions():
    st = qa.run(question="Hi")
    g = st.graph()
    for kind in ("RoleBegin system", "Text 'Hi'", "Gen answer", "Extend", "Decode", "Init",
                 "Return"):
        assert kind in g
    assert st.dot().count("->") == len(st.nodes) - 1


def test_expressions_concatenate_like_sglang(default_backend):
    @sgl.function
    def qa(s, q):
        s += "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=4, temperature=0) + "\n"
        s += sgl.user("Name a fruit: " + sgl.gen("f", max_tokens=3, temperature=0))

    st = qa.run(q="What is 1 + 1?")
    kinds = [n.kind for n in st.nodes]
    assert kinds[:4] == ["Init", "Text", "Gen", "Text"] and "RoleBegin" in kinds
    assert st.text().startswith("Q: What is 1 + 1?\nA:" + st["a"] + "\n")
    assert st["f"] in st.text()
    with pytest.raises(TypeError, match="cannot add int"):
        _ = sgl.gen("x") + 3


@sgl.function
def two_colours(s):
    s += "Two colours:"
    s += sgl.gen("first", max_tokens=3)
    forks = s.fork(2)
    forks += lambda i: f" {i}:" + sgl.gen("colour", max_tokens=2)
    forks.join()


def test_snapshot_is_a_read_only_copy_of_the_run():
    st = two_colours.run()
    snap = st.snapshot()
    assert snap.id == st.id and snap.function == "two_colours" and snap.finished
    assert snap.status.value == "done"
    assert snap.text == st.text() and snap.error is None and not snap.held
    assert dict(snap.vars) == st.variables() and snap.meta["first"] == st.get_meta_info("first")
    first = next(n for n in snap.own_nodes() if n.name == "first")
    assert [t.text for t in snap.tokens[first.id]] and len(snap.tokens[first.id]) == 3
    (branches,) = snap.forks.values()
    assert [b.parent for b in branches] == [st.id, st.id]
    assert [b.vars["colour"] for b in branches] == st["colour"]
    assert list(snap.branches()) == list(branches)
    with pytest.raises(TypeError):
        snap.vars["first"] = "x"  # read-only
    st["later"] = 1
    assert "later" not in snap.vars and st.snapshot().vars["later"] == 1  # a copy


def test_on_end_runs_before_wait_returns_and_at_once_after_the_end():
    st = two_colours.run(stream=True)
    seen = []
    st.on_end(lambda: seen.append(("first", st.finished)))
    assert st.wait() is st and seen == [("first", True)] and st.ended
    st.on_end(lambda: seen.append(("late", st.finished)))
    assert seen == [("first", True), ("late", True)]


def test_a_view_is_attached_and_named_and_the_stepper_is_debug():
    class Seen:
        def __init__(self):
            self.states = []

        def attach(self, state):
            self.states.append(state)

    st = two_colours.run(stream=True, debug=True)
    view = Seen()
    st.add_view(view)
    assert view.states == [st] and st.widget is view and st.views == [view]
    assert st.stepper is not None and st.stepper is st.debug
    assert st.fn is two_colours and st.fn.fn is two_colours
    st.wait()


def test_the_static_graph_ends_at_a_read():
    @sgl.function
    def reads(s):
        s += "a" + sgl.gen("x", max_tokens=2)
        s += s["x"]

    g = reads.trace()
    assert [n.kind.value for n in g.nodes] == ["Text", "Gen"]
    assert all(n.status.value == "traced" for n in g.nodes)
    assert not g.complete and g.ends == "reads s['x']"
