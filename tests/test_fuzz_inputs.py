"""Bad input, fuzzed (hypothesis): trace files (truncated, another format version, random
bytes, mangled spans), `%%sgl` option lines, `--arg` values and program arguments. Each gets
a clear error naming the problem, and the engine and the kernel keep serving."""

from __future__ import annotations

import json
import os
import random
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.notebook.cell_program import parse_args
from sgl_nb.tracing import TraceFormatError, load
from sgl_nb.tracing.timeline import Timeline
from sgl_nb.tui.program_file import load_program

FUZZ = settings(max_examples=int(os.environ.get("SGL_NB_FUZZ_EXAMPLES", 150)), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
# Inputs each property was given (the note reports them).
TRIED: dict[str, int] = {}


def tried(name: str) -> None:
    TRIED[name] = TRIED.get(name, 0) + 1


@sgl.function
def qa(s, q):
    s += "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=4, ignore_eos=True)
    s += sgl.select("v", choices=[" yes", " no"])
    forks = s.fork(2)
    forks += sgl.gen("f", max_tokens=2, ignore_eos=True)
    forks.join()


@pytest.fixture(scope="module")
def trace_lines(default_backend, tmp_path_factory) -> list[str]:
    """A real trace, one span per line (so mangling one line mangles one span)."""
    path = tmp_path_factory.mktemp("fuzz") / "trace.jsonl"
    sgl.enable_tracing(file=path, runtime=default_backend)
    try:
        qa.run(q="Is water wet?")
    finally:
        sgl.disable_tracing()
    lines = []
    for line in path.read_text().splitlines():
        req = json.loads(line)
        for rs in req["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    one = {"resourceSpans": [{**rs, "scopeSpans": [{**ss, "spans": [span]}]}]}
                    lines.append(json.dumps(one))
    assert load_lines(tmp_path_factory.mktemp("ok"), lines).programs  # the intact file loads
    return lines


def load_lines(folder, lines: list[str] | bytes) -> Timeline:
    path = folder / "t.jsonl"
    if isinstance(lines, bytes):
        path.write_bytes(lines)
    else:
        path.write_text("\n".join(lines) + "\n")
    return load(path)


def loads_or_says_why(folder, content) -> None:
    """The property: a Timeline, or a TraceFormatError that names the file."""
    try:
        tl = load_lines(folder, content)
    except TraceFormatError as e:
        assert "t.jsonl" in str(e), e
        return
    assert isinstance(tl, Timeline)


# ---- trace files -----------------------------------------------------------------------


@pytest.mark.slow
@FUZZ
@given(data=st.binary(max_size=2000))
def test_random_bytes_are_a_trace_format_error(tmp_path, data):
    tried("trace: random bytes")
    with pytest.raises(TraceFormatError):
        load_lines(tmp_path, data)


@pytest.mark.slow
@FUZZ
@given(cut=st.floats(0, 1))
def test_a_truncated_trace(trace_lines, tmp_path, cut):
    tried("trace: truncated")
    text = "\n".join(trace_lines)
    loads_or_says_why(tmp_path, text[: int(len(text) * cut)].encode())


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)


def _paths(obj, prefix=()):
    """Every (path, value) inside a decoded JSON document."""
    yield prefix, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, (*prefix, k))


@pytest.mark.slow
@FUZZ
@given(seed=st.integers(0, 2**32 - 1), value=JSON, drop=st.booleans())
def test_a_mangled_span(trace_lines, tmp_path, seed, value, drop):
    """One field anywhere in one span replaced by another JSON value, or removed."""
    tried("trace: mangled span")
    rng = random.Random(seed)
    lines = list(trace_lines)
    i = rng.randrange(len(lines))
    doc = json.loads(lines[i])
    path, _ = rng.choice([p for p in _paths(doc) if p[0]])
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if drop and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    lines[i] = json.dumps(doc)
    loads_or_says_why(tmp_path, lines)


@pytest.mark.slow
@pytest.mark.parametrize("field", ["startTimeUnixNano", "endTimeUnixNano"])
def test_an_infinite_time_is_a_trace_format_error(trace_lines, tmp_path, field):
    """Found by the fuzz above: json reads Infinity, and int() of it overflowed."""
    doc = json.loads(trace_lines[0])
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0][field] = float("inf")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: a malformed span \(Overflow"):
        load_lines(tmp_path, [json.dumps(doc), *trace_lines[1:]])


@pytest.mark.slow
def test_another_format_version_is_named(trace_lines, tmp_path):
    lines = [line.replace('"intValue": "1"}}]', '"intValue": "7"}}]') for line in trace_lines]
    assert lines != trace_lines
    with pytest.raises(TraceFormatError, match="format 7"):
        load_lines(tmp_path, lines)


# ---- --arg values and program arguments ----------------------------------------------------


@FUZZ
@given(pairs=st.lists(st.text(max_size=40), max_size=4))
def test_arg_pairs_parse_or_name_the_pair(pairs):
    tried("--arg pairs")
    try:
        out = parse_args(pairs)
    except ValueError as e:
        assert "--arg" in str(e)
        return
    assert set(out) <= {p.strip("'\"").partition("=")[0].strip() for p in pairs}


PYTHONISH = st.text(alphabet="()[]{}:,'\"0123456789-+.eEjx_ \\abc", max_size=60)


@FUZZ
@given(value=PYTHONISH | st.text(max_size=60))
@example("{[]: 1}")  # found: a literal that cannot be built raised TypeError
@example("(" * 300 + ")" * 300)
@example(" -42")
@example("01")  # found: no Python literal (leading zero), so text, as the rule says
def test_an_arg_value_is_a_literal_or_a_string(value):
    tried("--arg values")
    got = parse_args([f"k={value}"])["k"]
    if got == value:  # kept as text: then it was no number
        assert not INTEGER.fullmatch(value), f"{value!r} is an integer, kept as text"
        return
    compile(value.lstrip(" \t"), "--arg", "eval")  # a literal is a Python expression
    assert is_literal(got), f"{value!r} gave {got!r}, which no Python literal builds"


# Python's decimal integer literals: no leading zero but in 0 itself ("01" is no literal,
# and stays text like any other).
INTEGER = re.compile(r"[ \t]*-?(0+|[1-9][0-9]*)")
LITERAL_ATOMS = (str, bytes, int, float, complex, bool, type(None), type(...))


def is_literal(value) -> bool:
    """What ast.literal_eval can build: atoms, and containers of literals."""
    if isinstance(value, (list, tuple, set)):
        return all(is_literal(v) for v in value)
    if isinstance(value, dict):
        return all(is_literal(k) and is_literal(v) for k, v in value.items())
    return isinstance(value, LITERAL_ATOMS)


@pytest.mark.slow
@FUZZ
@given(pairs=st.lists(st.text(max_size=30), max_size=3))
def test_debug_args_are_checked_before_anything_runs(pairs):
    tried("sgl-nb debug --arg")
    from pathlib import Path

    target = str(Path(__file__).parent / "data" / "tui_program.py") + ":story"
    try:
        program = load_program(target, pairs)
    except ValueError as e:
        assert "--arg" in str(e) or "argument" in str(e)
        return
    assert set(program.args) <= {"topic"}


@pytest.mark.slow
@FUZZ
@given(q=JSON)
def test_program_arguments_of_any_type(default_backend, q):
    """A program given any value: it runs, or its state holds an error naming the problem
    at its line; the engine serves the next program either way."""
    tried("program arguments")
    state = qa.run(q=q, max_new_tokens=1)
    err = state.error()
    if err is not None:
        assert str(err) and state.error_line is not None


@pytest.mark.slow
def test_the_engine_still_serves_after_the_fuzzing(default_backend):
    assert default_backend.generate("The sky is", max_tokens=3).meta["completion_tokens"] == 3


# ---- %%sgl option lines ---------------------------------------------------------------------

OPTIONS = ["--arg", "--step", "--trace", "--priority", "--temperature", "--max-tokens",
           "--seed", "--define", "--no-widget", "--backend", "-x", "--", "name", "a=b", "=",
           "interactive", "batch", "nope", "1e9", "-5", "0.5", "'quoted x'", '"', "{v}"]


@pytest.fixture(scope="module")
def shell(ipython_shell):
    return ipython_shell


@pytest.mark.slow
@FUZZ
@given(words=st.lists(st.sampled_from(OPTIONS) | st.text(max_size=10), max_size=6))
def test_sgl_option_lines(shell, default_backend, words):
    """Any option line: the cell is defined, or the magic raises a UsageError (or the cell a
    SyntaxError at its line) that names the problem; the kernel's next cell runs."""
    tried("%%sgl option lines")
    line = " ".join(words) + " --define"
    try:
        shell.run_cell_magic("sgl", line, "s += 'x'\n")
    except UsageError as e:
        assert str(e)
    except (ValueError, SyntaxError) as e:
        assert str(e)
    assert shell.run_cell("1 + 1").result == 2


@pytest.mark.slow
def test_the_kernel_and_engine_serve_after_the_fuzzing(shell, default_backend):
    shell.run_cell_magic("sgl", "after --no-widget --max-tokens 3", "s += 'Hi' + gen('x')\n")
    assert shell.user_ns["after"].wait(WAIT).error() is None
    print("fuzz inputs tried:", TRIED)
