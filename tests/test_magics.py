"""The %%sgl magics through a real IPython shell, on the real model."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from support.waits import WAIT

from sgl_nb.language.function import SglFunction
from sgl_nb.language.state import ProgramCancelled, ProgramState

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]


@pytest.fixture(scope="module")
def shell(ipython_shell):
    return ipython_shell


def test_cell_binds_the_state_and_the_function(shell):
    shell.user_ns["subject"] = "The sea"  # a notebook variable, read by the program
    out = shell.run_cell_magic("sgl", "poem --max-tokens 6 --no-widget",
                               "s += subject + ' is'\ns += gen('rest', ignore_eos=True)\n")
    assert out is None  # the cell displays nothing else and returns at once
    st = shell.user_ns["poem"]
    assert isinstance(st, ProgramState)
    assert st.wait() is st  # the whole program has ended
    assert isinstance(st.fn, SglFunction)
    assert len(st["rest"]) > 0 and st.text() == "The sea is" + st["rest"]
    assert st.priority == "interactive"  # %%sgl cells outrank batch work by default
    again = st.fn.run(max_new_tokens=6)  # the reusable function: same greedy text
    assert again.text() == st.text()
    lines = [n.line for n in st.nodes if n.kind not in ("Init", "Return")]
    assert lines == [2, 3]  # the cell's own lines; the %%sgl line is line 1


def test_args_and_variable_expansion(shell):
    shell.user_ns["animal"] = "cats"
    shell.run_cell('%%sgl fact --no-widget --arg who={animal} --arg n=3 --arg "tag=x y"\n'
                   's += f"{n} facts about {who} ({tag}):"\n')
    st = shell.user_ns["fact"].wait()
    assert st.text() == "3 facts about cats (x y):"
    assert st.fn.run(who="dogs").text() == "3 facts about dogs (x y):"


def test_define_does_not_run(shell):
    shell.run_cell_magic("sgl", "greet --define --arg name=Ada", "s += 'Hello ' + name\n")
    fn = shell.user_ns["greet"]
    assert isinstance(fn, SglFunction) and fn.fn is fn
    assert fn.run(name="Bob").text() == "Hello Bob"


def test_sampling_options(shell):
    body = "s += 'Once upon a time'\ns += gen('x', ignore_eos=True)\n"
    shell.run_cell_magic("sgl", "a --no-widget --max-tokens 5 --temperature 1.0 --seed 7", body)
    shell.run_cell_magic("sgl", "b --no-widget --max-tokens 5 --temperature 1.0 --seed 7", body)
    a, b = shell.user_ns["a"].wait(), shell.user_ns["b"].wait()
    assert a.get_meta_info("x")["completion_tokens"] == 5
    assert a["x"] == b["x"]  # the same seed samples the same tokens
    shell.run_cell_magic("sgl", "c --no-widget --priority batch", "s += 'x'\n")
    assert shell.user_ns["c"].priority == "batch"


def test_syntax_error_points_at_the_cell_line(shell):
    with pytest.raises(SyntaxError) as err:
        shell.run_cell_magic("sgl", "broken", "s += 'a'\ns += (\n")
    assert err.value.lineno == 3
    assert "%%sgl broken" in err.value.filename
    assert "broken" not in shell.user_ns


def test_exception_points_at_the_cell_line(shell):
    shell.run_cell_magic("sgl", "oops", "s += 'x'\nvalue = 1 / 0\ns += 'never'\n")
    st = shell.user_ns["oops"].wait()
    assert isinstance(st.error(), ZeroDivisionError)
    assert st.error_line == 3
    assert st.widget.wait(WAIT)
    assert "ZeroDivisionError" in st.widget.error
    assert "cell line 3: value = 1 / 0" in st.widget.error


def test_unknown_option_prints_the_usage(shell, capsys):
    with pytest.raises(UsageError, match=r"unrecognized arguments: --bogus(.|\n)*usage: "):
        shell.run_cell_magic("sgl", "x --bogus", "s += 'a'\n")
    result = shell.run_cell("%%sgl y --priority urgent\ns += 'a'\n")
    assert isinstance(result.error_in_exec, UsageError)
    printed = capsys.readouterr()
    assert "usage: %%sgl [--arg KEY=VALUE]" in printed.out + printed.err
    with pytest.raises(UsageError, match="key=value"):
        shell.run_cell_magic("sgl", "x --arg novalue", "s += 'a'\n")


def test_help_lists_the_options(shell):
    doc = shell.find_cell_magic("sgl").__doc__
    for option in ("--arg", "--step", "--trace", "--priority", "--temperature",
                   "--max-tokens", "--seed", "--define", "--no-widget"):
        assert option in doc


def test_step_starts_paused(shell):
    shell.run_cell_magic("sgl", "stepped --step --no-widget",
                         "s += 'One,'\ns += ' two'\ns += gen('n', max_tokens=2)\n")
    st = shell.user_ns["stepped"]
    assert st.debug.wait_until_held(WAIT)
    assert st.debug.current.kind == "Text" and st.nodes[1].status == "pending"
    assert st.nodes[0].kind == "Init" and st.nodes[0].status == "done"
    st.debug.continue_()
    assert len(st["n"]) > 0


def test_trace_file_option(shell, tmp_path):
    from sgl_nb.tracing import load
    from sgl_nb.tracing.session import current

    path = tmp_path / "cell.jsonl"
    shell.run_cell_magic("sgl", f"traced --no-widget --trace {path}",
                         "s += 'Traced'\ns += gen('t', max_tokens=3)\n")
    st = shell.user_ns["traced"].wait()  # with --trace: also until the file is written
    assert current() is None  # the cell turned tracing off when it ended
    tl = load(path)
    assert st.id in tl.programs and tl.programs[st.id].function == "traced"


def test_trace_magic_start_export_stop(shell, tmp_path, capsys):
    from sgl_nb.tracing import load

    shell.run_line_magic("sgl_trace", "start")
    shell.run_cell_magic("sgl", "recorded --no-widget", "s += 'Hi'\ns += gen('g', max_tokens=2)\n")
    st = shell.user_ns["recorded"].wait()
    out = tmp_path / "t.jsonl"
    shell.run_line_magic("sgl_trace", f"export {out}")
    shell.run_line_magic("sgl_trace", "stop")
    assert "spans to" in capsys.readouterr().out
    assert st.id in load(out).programs
    with pytest.raises(UsageError, match="not on"):
        shell.run_line_magic("sgl_trace", "stop")


def test_model_and_cache_magics(shell, capsys, runtime):
    shell.run_line_magic("sgl_model", "")
    assert str(runtime.model_path) in capsys.readouterr().out
    runtime.generate("The cache tree shows this sentence.", max_tokens=2)
    shell.run_line_magic("sgl_cache", "--text")
    printed = capsys.readouterr().out
    assert printed.startswith("root  nodes=") and "cache tree shows" in printed
    shell.run_line_magic("sgl_cache", "")  # the live widget (shown as its repr here)
    assert "LiveCacheTree" in capsys.readouterr().out



def test_backend_option_runs_the_cell_on_a_server(shell, runtime):
    from sgl_nb.server.serve import start_in_thread

    server = start_in_thread(runtime)
    try:
        body = "s += 'The capital of France is'\ns += gen('city', max_tokens=4)\n"
        shell.run_cell_magic("sgl", f"remote --backend {server.url} --no-widget", body)
        remote = shell.user_ns["remote"]
        assert remote.wait() is remote and remote.error() is None
        assert type(remote.backend).__name__ == "RuntimeEndpoint"
        shell.user_ns["my_rt"] = runtime  # a variable holding a backend works too
        shell.run_cell_magic("sgl", "local --backend my_rt --no-widget", body)
        local = shell.user_ns["local"]
        assert local.wait() is local and local.backend is runtime
        assert remote["city"] == local["city"]  # greedy, same weights
        with pytest.raises(UsageError, match="--backend nothing"):
            shell.run_cell_magic("sgl", "x --backend nothing --no-widget", body)
    finally:
        server.shutdown()
        server.server_close()


def test_rerunning_a_cell_cancels_its_previous_run(shell, capsys):
    body = "s += 'A long tale:' + gen('t', max_tokens=2000, ignore_eos=True)\n"
    shell.run_cell_magic("sgl", "tale --no-widget", body)
    first = shell.user_ns["tale"]
    next(first.text_iter("t"))
    capsys.readouterr()
    short = "s += 'A short tale:' + gen('t', ignore_eos=True)\n"  # --max-tokens applies
    shell.run_cell_magic("sgl", "tale --no-widget --max-tokens 3", short)
    assert f"cancelled the previous run (program {first.id})" in capsys.readouterr().out
    assert isinstance(first.wait(WAIT).error(), ProgramCancelled) and first["t"]
    second = shell.user_ns["tale"]
    assert second is not first and second.wait(WAIT).error() is None
    shell.run_cell_magic("sgl", "tale --no-widget --max-tokens 3", short)
    assert "cancelled" not in capsys.readouterr().out  # the previous run had ended
