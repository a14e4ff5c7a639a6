"""sgl.diff(a, b) with the real model: the first Node and token where two runs part (checked
against the states' own tokens), their probabilities and alternatives, the arguments that
differ, aligned fork branches and added Nodes; `sgl-nb diff` on trace files (plain text,
exit codes) and its Textual screen; `%sgl_diff`."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import pytest
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.language.diff import Change
from sgl_nb.language.run_record import record_of_state
from sgl_nb.tracing import load

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]


@sgl.function
def story(s, topic):
    s += sgl.user("Name one animal that lives in " + topic + ". One word.")
    s += sgl.assistant(sgl.gen("animal", max_tokens=5, stop="\n"))
    s += sgl.user("Describe it in one short sentence.")
    s += sgl.assistant(sgl.gen("desc", max_tokens=8, stop="\n"))


@sgl.function
def branches(s):
    s += "Two colours of the sky:\n"
    forks = s.fork(2)
    forks += lambda i: f"Colour {i + 1}:" + sgl.gen("colour", max_tokens=3, stop="\n")
    forks.join()


@sgl.function
def items(s, n):
    s += "A list of fruits:\n"
    for i in range(n):
        s += f"{i + 1}." + sgl.gen(f"item{i}", max_tokens=3, stop="\n") + "\n"


def _gens(state):
    return [n for n in state.nodes if n.kind == "Gen"]


def _first_token_diff(x, y) -> int:
    return next(i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p.token != q.token)


@pytest.fixture(scope="module")
def seeded():
    """Two runs at temperature 1.0 with different seeds."""
    return (story.run("the sea", temperature=1.0, seed=1),
            story.run("the sea", temperature=1.0, seed=2))


def test_different_seeds_part_at_the_first_differing_token(seeded):
    a, b = seeded
    d = sgl.diff(a, b)
    assert d and d.first.op == "changed"
    # The states' own tokens say where: the first gen whose outputs differ, its first
    # token that differs.
    ga, gb = next((x, y) for x, y in zip(_gens(a), _gens(b), strict=True)
                  if x.output != y.output)
    ta, tb = a.snapshot().tokens[ga.id], b.snapshot().tokens[gb.id]
    i = _first_token_diff(ta, tb)
    assert (d.first.a.id, d.first.b.id) == (ga.id, gb.id)
    dv = d.divergence
    assert dv.token == i and dv.a.index == dv.b.index == i
    assert dv.a.choice.token == ta[i].token and dv.b.choice.token == tb[i].token
    assert math.isclose(dv.a.probability, math.exp(ta[i].logprob))
    assert math.isclose(dv.b.probability, math.exp(tb[i].logprob))
    assert dv.a.choice.top and dv.a.choice.top == ta[i].top
    assert dv.char == len("".join(t.text for t in ta[:i])) + _common(ta[i].text, tb[i].text)
    report = str(d)
    assert f"differ at Gen {ga.name}" in report and f"at token {i}:" in report
    assert repr(ta[i].text) in report and repr(tb[i].text) in report
    assert "top (" in report and repr(ta[i].top[0].text) in report
    assert d.sampling == [Change("seed", 1, 2)] and d.inputs == []
    assert not d.params  # the gens' seeds follow the run's default: said once


def _common(x: str, y: str) -> int:
    return next((k for k, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                min(len(x), len(y)))


def test_identical_greedy_runs(default_backend):
    a, b = story.run("the sea"), story.run("the sea")
    d = sgl.diff(a, b)
    assert not d and d.first is None and d.divergence is None
    assert all(p.op == "same" for p in d.pairs)
    assert len(d.pairs) == len(record_of_state(a).nodes)
    assert "identical" in str(d) and "identical" in d._repr_html_()
    assert not sgl.diff(a, a)


def test_a_rerun_with_an_edited_gen_parts_at_that_node(seeded):
    a = seeded[0]
    b = a.rerun(at="animal", value="Camel")
    d = sgl.diff(a, b)
    assert d.first.a.name == "animal" and d.first.b.text == "Camel"
    assert all(p.op == "same" for p in d.pairs[: d.pairs.index(d.first)])
    dv = d.divergence
    assert dv.char == _common(a["animal"], "Camel")
    assert dv.a.choice is not None and dv.b.choice is None and "edited" in dv.b.note
    assert sgl.diff(b).first.b.text == "Camel"  # a re-run alone: against its original
    assert "edited" in str(sgl.diff(b))


def test_differing_inputs_and_sampling_arguments(seeded):
    a = story.run("the lake", max_tokens=4)
    b = story.run("the desert", temperature=0.5, seed=3)
    d = sgl.diff(a, b)
    assert d.inputs == [Change("topic", "the lake", "the desert")]
    assert {c.name for c in d.sampling} == {"max_tokens", "temperature", "seed"}
    assert d.first.node.kind == "Text" and "desert" in d.first.b.text  # the input's Text
    report = str(d)
    assert "topic: 'the lake' | 'the desert'" in report
    assert "max_tokens: 4 | (absent)" in report
    # A re-run with a new temperature at one gen: that Node's parameters differ.
    c = seeded[0].rerun(at="desc", temperature=0.3)
    d = sgl.diff(seeded[0], c)
    (pair,) = d.params
    assert pair.a.name == "desc" and Change("temperature", 1.0, 0.3) in pair.params
    assert "Gen desc" in str(d).split("Node parameters differ:")[1]


def test_fork_branches_and_added_nodes_align(default_backend):
    a = branches.run()
    (fork,) = a.snapshot().forks.values()
    b = a.rerun(at=_gens(fork[1])[0], value=" green")
    d = sgl.diff(a, b)
    assert [p.op for p in d.pairs].count("changed") == 1
    assert d.first.branch == ((0, 1),) and d.first.b.text == " green"
    assert "in branch 1" in d.summary()
    x, y = items.run(2), items.run(3)
    d = sgl.diff(x, y)
    assert d.inputs == [Change("n", 2, 3)]
    added = [p for p in d.pairs if p.op == "added"]
    assert [(p.b.kind, p.b.name) for p in added] == [("Text", None), ("Gen", "item2")]
    assert d.first is added[0] and "only in b" in str(d)
    assert all(p.op == "same" for p in d.pairs if p.op != "added")


def test_records_without_tokens_compare_their_text(seeded):
    a, b = (record_of_state(s) for s in seeded)
    for _, _, n in b.walk():
        n.tokens = []  # as a Gen from a backend that reports no tokens
    dv = sgl.diff(a, b).divergence
    assert dv.char is not None and dv.b.choice is None
    assert "not recorded" in dv.b.note
    assert dv.a.choice is not None  # a's token at that character


# ---- trace files: sgl-nb diff -------------------------------------------------------------

@pytest.fixture(scope="module")
def traces(tmp_path_factory, default_backend):
    d = tmp_path_factory.mktemp("diff")
    runs = {"a": ("token", 1), "b": ("token", 2), "same": ("token", 1), "node": ("node", 2)}
    for name, (level, seed) in runs.items():
        sgl.enable_tracing(file=str(d / f"{name}.jsonl"), level=level, runtime=default_backend)
        try:
            story.run("the sea", temperature=1.0, seed=seed)
        finally:
            sgl.disable_tracing()
    sgl.enable_tracing(file=str(d / "two.jsonl"), level="token", runtime=default_backend)
    try:
        story.run("the sea", max_tokens=2), story.run("the lake", max_tokens=2)
    finally:
        sgl.disable_tracing()
    return d


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sgl_nb.cli", "diff", *map(str, args)],
                          capture_output=True, text=True, timeout=WAIT)


def test_sgl_nb_diff_on_trace_files(traces):
    r = _cli(traces / "a.jsonl", traces / "b.jsonl")
    assert r.returncode == 1, r.stderr
    assert r.stdout.startswith("runs a.jsonl and b.jsonl: differ at Gen ")
    assert r.stdout.strip() == str(sgl.diff(traces / "a.jsonl", traces / "b.jsonl",
                                            names=("a.jsonl", "b.jsonl")))
    assert "top (" in r.stdout and "seed: 1 | 2" in r.stdout
    r = _cli(traces / "a.jsonl", traces / "same.jsonl")
    assert r.returncode == 0 and "identical" in r.stdout
    # A trace at the default level keeps each token's alternatives too (on the Node's span).
    r = _cli(traces / "a.jsonl", traces / "node.jsonl")
    assert r.returncode == 1 and "top (" in r.stdout
    assert "alternatives not recorded" not in r.stdout


def test_sgl_nb_diff_bad_input(traces, tmp_path):
    r = _cli(traces / "a.jsonl", tmp_path / "missing.jsonl")
    assert r.returncode == 2 and "no such trace file" in r.stderr
    r = _cli(traces / "two.jsonl", traces / "a.jsonl")
    assert r.returncode == 2 and "2 top-level programs" in r.stderr
    assert "--program-a" in r.stderr
    pid = min(p.id for p in load(traces / "two.jsonl").programs.values() if p.parent is None)
    r = _cli(traces / "two.jsonl", traces / "a.jsonl", "--program-a", pid, "--text")
    assert r.returncode == 1 and "max_tokens: 2 | (absent)" in r.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    r = _cli(bad, traces / "a.jsonl")
    assert r.returncode == 2 and "bad.jsonl" in r.stderr


# ---- the Textual screen and the notebook magic ---------------------------------------------

def test_diff_screen_keys(default_backend):
    from sgl_nb.tui.diff_app import DiffApp

    a = branches.run(temperature=1.0, seed=1)
    b = branches.run(temperature=1.0, seed=2)
    d = sgl.diff(a, b)
    assert len(d.differing) >= 2, str(d)

    async def run() -> None:
        app = DiffApp(d)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            first, second = d.differing[:2]
            assert app.selected == first  # the first divergence, selected
            assert f"difference 1/{len(d.differing)}" in app.status_text
            assert "top (" in app.detail_text and "at token" in app.detail_text
            assert repr(d.divergence.a.choice.text) in app.detail_text
            await pilot.press("n")
            assert app.selected == second and "difference 2/" in app.status_text
            await pilot.press("N")
            assert app.selected == first
            await pilot.press("N")
            assert "no earlier difference" in app.status_text
            await pilot.press("up")
            assert app.selected == first - 1 and "the same in both runs" in app.detail_text
            await pilot.press("q")
        assert not app.is_running

    asyncio.run(run())


def test_sgl_diff_magic(ipython_shell, seeded, traces, capsys):
    ipython_shell.user_ns.update(run_a=seeded[0], run_b=seeded[1])
    ipython_shell.run_line_magic("sgl_diff", "run_a run_b --text")
    out = capsys.readouterr().out
    assert out.startswith("runs run_a and run_b: differ at Gen")
    ipython_shell.run_line_magic("sgl_diff", f"{traces / 'a.jsonl'} {traces / 'same.jsonl'} "
                                 "--text")
    assert "identical" in capsys.readouterr().out
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="neither a notebook variable nor a trace file"):
        ipython_shell.run_line_magic("sgl_diff", "run_a nothing_here")
