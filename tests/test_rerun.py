"""state.rerun(at=..., value=..., **sampling) with the real model: before the edited Node
the record is replayed (no decoding, the prompt from the radix cache), the edit applies at
it, and what follows runs live."""

import pytest

import sgl_nb as sgl


@sgl.function
def story(s, topic):
    s += sgl.user("Name one animal that lives in " + topic + ". One word.")
    s += sgl.assistant(sgl.gen("animal", max_tokens=6, stop="\n"))
    s += sgl.user("Describe it in one short sentence.")
    s += sgl.assistant(sgl.gen("desc", max_tokens=24, stop="\n"))


@sgl.function
def literal(s, topic, animal):
    """`story` with its first gen replaced by the literal text."""
    s += sgl.user("Name one animal that lives in " + topic + ". One word.")
    s += sgl.assistant(animal)
    s += sgl.user("Describe it in one short sentence.")
    s += sgl.assistant(sgl.gen("desc", max_tokens=24, stop="\n"))


def _gen_usage(state, name):
    node = next(n for n in state.nodes if n.kind == "Gen" and n.name == name)
    return node.instructions[0].usage


def _token_ids(state, name):
    node = next(n for n in state.nodes if n.kind == "Gen" and n.name == name)
    return [t.token for t in state.snapshot().tokens[node.id]]


def test_rerun_with_an_edited_gen_is_the_program_with_that_text(default_backend):
    a = story.run("the sea")
    b = a.rerun(at="animal", value="Camel")
    want = literal.run("the sea", "Camel")
    assert b["animal"] == "Camel"
    assert b.text() == want.text()
    assert b["desc"] == want["desc"]
    assert _token_ids(b, "desc") == _token_ids(want, "desc")  # token for token
    assert b.get_meta_info("animal").get("edited") is True
    # The prompt before the edited gen was computed by the first run: the next gen's
    # request finds all of it in the radix cache.
    prefix = default_backend.tokenizer.encode(a.text()[: a.text().index(a["animal"])])
    assert _gen_usage(b, "desc")["cached_tokens"] >= len(prefix) - 1
    assert b.rerun_report.reached and b.rerun_report.diverged is None


def test_replayed_gens_are_not_decoded(default_backend):
    a = story.run("the desert")
    b = a.rerun(at="desc", max_tokens=4)
    assert b["animal"] == a["animal"]
    assert _gen_usage(b, "animal").get("replayed") is True
    assert _gen_usage(b, "animal")["output_tokens"] == 0
    assert b.get_meta_info("animal").get("replayed") is True
    assert b.rerun_report.replayed >= 4  # the turns and the first gen
    assert _gen_usage(b, "desc")["output_tokens"] <= 4
    assert a["desc"].startswith(b["desc"])  # greedy: the same text, cut at 4 tokens


def test_a_new_seed_changes_only_that_gen_and_what_follows(default_backend):
    a = story.run("the forest", temperature=1.0, seed=1)
    b = a.rerun(at="desc", seed=2)
    assert b["animal"] == a["animal"]  # before the edit: replayed
    assert _gen_usage(b, "animal").get("replayed") is True
    assert b["desc"] != a["desc"]
    c = a.rerun(at="desc", seed=1)  # the same seed again: the same text
    assert c["desc"] == a["desc"]


@sgl.function
def branches(s):
    s += "Two colours of the sky:\n"
    forks = s.fork(2)
    forks += lambda i: f"Colour {i + 1}:" + sgl.gen("colour", max_tokens=4, stop="\n")
    forks.join()
    s += "\nThe best one is" + sgl.gen("best", max_tokens=5, stop="\n")


def test_rerun_inside_a_fork_branch(default_backend):
    a = branches.run()
    (fork,) = a.snapshot().forks.values()
    node = next(n for n in fork[1].nodes if n.kind == "Gen")  # branch 1's gen
    b = a.rerun(at=node, value=" green")
    assert b["colour"] == [a["colour"][0], " green"]  # branch 0: replayed
    colours = [n for n in b.nodes if n.kind == "Gen" and n.name == "colour"]
    assert [bool(n.instructions[0].usage.get("replayed")) for n in colours] == [True, False]
    assert _gen_usage(b, "best").get("replayed") is None  # after the join: live
    assert b.rerun_report.reached


@sgl.function
def inner(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")


@sgl.function
def outer(s):
    s += "Answer briefly.\n"
    inner(s, "What is 2+2?")
    s += "\nQ: And 3+3?\nA:" + sgl.gen("second", max_tokens=8, stop="\n")


def test_rerun_through_a_nested_call(default_backend):
    a = outer.run()
    b = a.rerun(at="answer", value=" 5")
    assert b["answer"] == " 5"
    assert "A: 5\n" in b.text()
    assert _gen_usage(b, "second").get("replayed") is None  # after the edit: live


@sgl.function
def branchy(s):
    s += "Is the sky blue? Answer:"
    s += sgl.select("yes", choices=[" yes", " no"])
    if s["yes"] == " yes":
        s += " Why?" + sgl.gen("why", max_tokens=6)
    else:
        s += " What colour is it then?" + sgl.gen("colour", max_tokens=6)


def test_a_select_answering_otherwise_takes_the_other_branch_live(default_backend):
    a = branchy.run()
    other = " no" if a["yes"] == " yes" else " yes"
    b = a.rerun(at="yes", value=other)
    assert b["yes"] == other
    took = "colour" if other == " no" else "why"
    assert took in b.variables() and took not in a.variables()
    usage = _gen_usage(b, took)  # the branch the first run never took, generated live
    assert usage.get("replayed") is None and usage["output_tokens"] > 0


def test_rerun_errors_name_the_problem(default_backend):
    a = story.run("the sky")
    with pytest.raises(KeyError, match="animal"):
        a.rerun(at="nope", value="x")
    with pytest.raises(TypeError, match="unknown sampling"):
        a.rerun(at="desc", temprature=0.5)
    with pytest.raises(ValueError, match="max_tokens"):
        a.rerun(at="desc", max_tokens=-3)
    with pytest.raises(ValueError, match="regex"):
        a.rerun(at="desc", regex="(unclosed")
    with pytest.raises(TypeError, match="not both"):
        a.rerun(at="desc", value="x", max_tokens=3)
    b = branchy.run()
    with pytest.raises(ValueError, match="not a choice"):
        b.rerun(at="yes", value=" maybe")
    with pytest.raises(TypeError, match="apply to a gen"):
        b.rerun(at="yes", temperature=0.5)


def test_rerun_from_a_trace_file(default_backend, tmp_path):
    from sgl_nb import tracing

    path = tmp_path / "trace.jsonl"
    sgl.enable_tracing(file=path, level="token")
    try:
        a = story.run("the jungle")
    finally:
        sgl.disable_tracing()
    tl = tracing.load(path)
    b = tl.rerun(at="animal", value="Camel")
    want = literal.run("the jungle", "Camel")
    assert b.text() == want.text()
    assert b.rerun_report.replayed >= 2 and b.rerun_report.reached
    c = tl.rerun(at="desc", max_tokens=3)  # the trace's gen text is replayed
    assert c["animal"] == a["animal"] and _gen_usage(c, "animal").get("replayed")


def test_a_trace_whose_function_cannot_be_imported_says_so(default_backend, tmp_path):
    from sgl_nb import tracing

    @sgl.function
    def local(s):
        s += "Hi" + sgl.gen("x", max_tokens=2)

    path = tmp_path / "trace.jsonl"
    sgl.enable_tracing(file=path)
    try:
        local.run()
    finally:
        sgl.disable_tracing()
    with pytest.raises(ImportError, match="local"):
        tracing.load(path).rerun(at="x", value="!")


def test_rerun_of_a_cell_program_and_of_its_trace(ipython_shell, tmp_path):
    from sgl_nb import tracing

    path = tmp_path / "cell.jsonl"
    ipython_shell.run_cell_magic(
        "sgl", f"tale --no-widget --max-tokens 5 --trace {path}",
        "s += 'The fox'\ns += gen('verb', stop=' ')\ns += ' over' + gen('what')\n")
    a = ipython_shell.user_ns["tale"].wait()
    b = a.rerun(at="verb", value=" leapt")
    assert b["verb"] == " leapt" and b.text().startswith("The fox leapt over")
    assert _gen_usage(b, "what").get("replayed") is None
    # The trace names the cell's program; in this kernel the name is bound to its state,
    # whose function the re-run finds.
    c = tracing.load(path).rerun(at="verb", value=" leapt")
    assert c.text() == b.text()


@sgl.function
def long_story(s):
    s += "Once:" + sgl.gen("tale", max_tokens=200, ignore_eos=True)
    s += " Moral:" + sgl.gen("moral", max_tokens=4)


@sgl.function
def parse_number(s):
    s += "Write a word:" + sgl.gen("answer", max_tokens=3)
    s += " so twice that is " + str(2 * int(s["answer"]))


def test_rerun_of_a_failed_program_with_a_value_that_mends_it(default_backend):
    a = parse_number.run()
    assert a.error() is not None  # the model wrote no number
    b = a.rerun(at="answer", value=" 21")
    assert b.error() is None
    assert b.text().endswith(" 21 so twice that is 42")


def test_rerun_of_a_held_and_of_a_cancelled_program(default_backend):
    a = story.run("the mountains", step=True)
    a.debug.step()  # RoleBegin user
    a.debug.wait_until_held()
    try:
        b = a.rerun(at="animal", value="Goat")  # the held run's record reaches no gen yet
        assert b["animal"] == "Goat" and b.error() is None and b["desc"]
    finally:
        a.debug.continue_()
        a.wait()
    c = long_story.run(stream=True)
    next(c.text_iter("tale"))  # it is decoding
    c.cancel()
    c.wait()
    assert [n.status for n in c.nodes if n.kind == "Gen"] == ["cancelled", "cancelled"]
    d = c.rerun(at="tale", value=" A fox slept.")
    assert d.error() is None and d["moral"] and d.text().startswith("Once: A fox slept.")
