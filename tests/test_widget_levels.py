"""What a cell shows, through a real IPython shell with the extension, on the real model:
`%config SglMagics.widget = "full" | "compact" | "none"` for every %%sgl cell, a cell's
--widget / --no-widget, and the one summary a cell's run_batch shows however many items."""

from __future__ import annotations

import html
import logging
import re
import threading
import time

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from ipywidgets.widgets.widget import _instances
from support.waits import WAIT

from sgl_nb.notebook.magics import SglMagics
from sgl_nb.notebook.widgets import ProgramWidget
from sgl_nb.notebook.widgets.batch import BatchSummary
from sgl_nb.notebook.widgets.compact import CompactView

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]

VIEW = "application/vnd.jupyter.widget-view+json"
GEN5 = "s += 'The sea is'\ns += gen('x', max_tokens=5, ignore_eos=True)\n"
TINY = ("import sgl_nb as sgl\n"
        "@sgl.function\n"
        "def tiny(s, i):\n"
        "    s += f'Item {i}:'\n"
        "    s += sgl.gen('x', max_tokens=2, ignore_eos=True)\n"
        "    if i == -1 or not isinstance(s['x'], str):\n"  # the read waits for the gen
        "        raise ZeroDivisionError('item -1')\n")


@pytest.fixture(scope="module")
def shell(ipython_shell):
    ipython_shell.run_cell(TINY)
    yield ipython_shell
    ipython_shell.run_line_magic("config", 'SglMagics.widget = "full"')  # the default again


def magics(shell) -> SglMagics:
    return next(c for c in shell.configurables if isinstance(c, SglMagics))


def set_level(shell, level: str) -> None:
    shell.run_line_magic("config", f'SglMagics.widget = "{level}"')
    assert magics(shell).widget == level


def shown(cap) -> list:
    """The widgets a captured cell displayed (the objects, found by their model id); not
    the updates of earlier cells' static copies."""
    return [_instances[o.data[VIEW]["model_id"]] for o in cap.outputs
            if VIEW in o.data and not o.update]


def cell(shell, line: str, body: str = GEN5):
    with capture_output() as cap:
        shell.run_cell_magic("sgl", line, body)
    name = line.split()[0]
    return shell.user_ns[name].wait(WAIT), shown(cap), cap


def plain(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def test_config_lists_and_sets_the_level(shell, capsys):
    shell.run_line_magic("config", "")
    assert "SglMagics" in capsys.readouterr().out  # one of the shell's configurables
    shell.run_line_magic("config", "SglMagics")
    help_text = capsys.readouterr().out
    assert "SglMagics.widget" in help_text and "compact" in help_text
    set_level(shell, "compact")
    assert shell.run_line_magic("config", "SglMagics.widget") == "compact"
    shell.run_line_magic("sgl_widget", "")
    assert "'compact'" in capsys.readouterr().out
    shell.run_line_magic("sgl_widget", "none")
    assert magics(shell).widget == "none"
    set_level(shell, "full")


def test_full_shows_the_program_widget(shell):
    set_level(shell, "full")
    st, widgets, _ = cell(shell, "lvl_full")
    assert len(widgets) == 1 and isinstance(widgets[0], ProgramWidget)
    assert st.widget is widgets[0]


def test_compact_shows_one_line_per_program(shell):
    set_level(shell, "compact")
    start = time.monotonic()
    st, widgets, cap = cell(shell, "lvl_compact")
    assert len(widgets) == 1 and isinstance(widgets[0], CompactView)
    view = st.widget
    assert view is widgets[0] and view.wait(WAIT)
    elapsed = time.monotonic() - start
    generated = st.get_meta_info("x")["completion_tokens"]
    assert generated == 5
    assert view.status == "done" and view.error == ""
    assert view.generated_tokens == generated
    assert view.prompt_tokens > 0 and 0 <= view.cached_tokens <= view.prompt_tokens
    line = plain(view.value)
    assert "\n" not in line and len(view.value) < 600  # one short line
    assert line.startswith("● done · lvl_compact · 5 tokens · ")
    assert re.search(r"\d+\.\d tok/s · cache (\d+% \(\d+/\d+\)|-)", line)
    assert line == "● " + view.text
    assert view._repr_mimebundle_()["text/plain"] == view.text  # the line, as text
    assert view.pump.throttle.renders <= 30 * elapsed + 2  # at most ~30 renders a second
    # A static copy of the line for viewers without widgets, in every display of it.
    first = next(o for o in cap.outputs if VIEW in o.data and not o.update)
    assert first.data["text/html"].startswith('<div class="sgl-compact"')
    assert view._repr_mimebundle_()["text/html"] == view.value
    # Only the line is synced: one short value a render, nothing else.
    assert set(view.keys) & {"status", "generated_tokens", "text", "tok_per_s"} == set()


def test_compact_shows_an_error(shell):
    set_level(shell, "compact")
    st, widgets, _ = cell(shell, "lvl_oops", "s += 'x'\nvalue = 1 / 0\n")
    assert st.widget.wait(WAIT)
    assert st.widget.status == "error" and "ZeroDivisionError" in st.widget.error
    assert "ZeroDivisionError" in plain(st.widget.value)


def test_none_shows_nothing(shell):
    set_level(shell, "none")
    st, widgets, cap = cell(shell, "lvl_none")
    assert widgets == [] and cap.outputs == [] and st.widget is None
    assert st.get_meta_info("x")["completion_tokens"] == 5  # the program ran all the same


@pytest.mark.parametrize(("level", "option", "expected"), [
    ("compact", "--widget full", ProgramWidget),
    ("full", "--widget compact", CompactView),
    ("none", "--widget compact", CompactView),
    ("full", "--widget none", None),
    ("compact", "--no-widget", None),
])
def test_a_cell_option_overrides_the_level(shell, level, option, expected):
    set_level(shell, level)
    st, widgets, _ = cell(shell, f"lvl_opt {option}")
    if expected is None:
        assert widgets == [] and st.widget is None
    else:
        assert [type(w) for w in widgets] == [expected] and st.widget is widgets[0]
    assert magics(shell).widget == level  # the option is for this cell only


def test_a_bad_level_is_an_error_naming_the_levels(shell, caplog):
    set_level(shell, "compact")
    with pytest.raises(UsageError, match=r"invalid choice: 'loud'.*'full', 'compact', 'none'"):
        shell.run_cell_magic("sgl", "lvl_bad --widget loud", "s += 'a'\n")
    with pytest.raises(UsageError, match="one of full, compact, none"):
        shell.run_line_magic("sgl_widget", "loud")
    with pytest.raises(UsageError, match="--no-widget and --widget full"):
        shell.run_cell_magic("sgl", "lvl_bad --no-widget --widget full", "s += 'a'\n")
    # %config reports a bad value (IPython logs what a configurable refuses) and keeps the level.
    with caplog.at_level(logging.ERROR):
        shell.run_line_magic("config", 'SglMagics.widget = "loud"')
    assert "must be one of full, compact, none; got 'loud'" in caplog.text
    assert magics(shell).widget == "compact"
    set_level(shell, "full")


def _batch(shell, items: str, options: str = "", during=None):
    """Run `states = tiny.run_batch(...)` as a cell, sampling the summary's progress;
    `during(view)` is called once, from another thread, when its items are queued."""
    fn = shell.user_ns["tiny"]
    fn.last_batch_view = None
    samples, running = [], threading.Event()
    running.set()

    def sampler():
        while running.is_set():
            view = getattr(fn, "last_batch_view", None)
            if view is not None:
                samples.append(view.progress.value)
                if during is not None and view.pump is not None:
                    during(view)
                    return
            time.sleep(0.005)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    before = {id(w) for w in _instances.values()}
    start = time.monotonic()
    try:
        with capture_output() as cap:
            result = shell.run_cell(
                f"states = tiny.run_batch([{{'i': i}} for i in {items}]{options})")
    finally:
        running.clear()
        thread.join()
    assert result.success, result.error_in_exec
    created = [w for w in _instances.values() if id(w) not in before]
    _batch.outputs = cap.outputs
    return fn.last_batch_view, shown(cap), samples, created, time.monotonic() - start


def test_run_batch_shows_one_summary_that_updates(shell):
    set_level(shell, "full")  # the summary at full and compact alike
    # Ten bodies at a time, each waiting for its gen: the items finish in waves.
    view, widgets, samples, created, elapsed = _batch(shell, "range(100)", ", num_threads=10")
    states = shell.user_ns["states"]
    assert len(states) == 100
    assert widgets == [view] and isinstance(view, BatchSummary)  # one summary, not 100
    assert not [w for w in created if isinstance(w, (ProgramWidget, CompactView))]
    assert view.wait(WAIT)
    assert view.counts() == {"total": 100, "done": 100, "running": 0, "failed": 0,
                             "cancelled": 0}
    assert view.progress.value == 100 and view.progress.bar_style == "success"
    generated = sum(s.get_meta_info("x")["completion_tokens"] for s in states)
    assert generated == 200
    assert view.text.startswith("run_batch tiny · 100/100 · 100 done · 0 running · "
                                "0 failed · 0 cancelled · 200 tokens · ")
    # Progress was seen rising while the items finished, never falling.
    assert samples == sorted(samples), samples
    assert any(0 < s < 100 for s in samples), sorted(set(samples))
    assert view.renders <= 30 * elapsed + 3
    # Items open on demand, and only then: item 7's line and text.
    assert view.item_text.value == "" and view.item.children == ()
    box = view.open_item(7)
    assert box is view.item and view.items.value == 7
    assert states[7].text().startswith("Item 7:")
    assert html.escape(states[7].text()) in view.item_text.value
    assert plain(view.item_line.value).startswith(f"● done · #7 program {states[7].id} · 2 tokens")
    view.items.value = 42  # what picking it in the dropdown does
    assert html.escape(states[42].text()) in view.item_text.value
    assert len(view.items.options) == 101 and view.items.options[43] == ("#42 i=42", 42)
    # A static copy of its line for viewers without widgets (kept up to date in a kernel:
    # test_saved_notebook_shows_the_final_lines).
    first = next(o for o in _batch.outputs if VIEW in o.data and not o.update)
    assert first.data["text/html"].startswith('<div class="sgl-batch">')
    # The full widget of an item, built when asked: its events replayed into it.
    assert view.full == {} and view.item.children[-1] is view.full_button
    view.full_button.click()
    full = view.full[42]
    assert isinstance(full, ProgramWidget) and view.item.children[-1] is full
    assert full.wait(WAIT) and full.status == "done" and full.program_id == states[42].id
    assert full.stream.text == states[42].text()
    assert view.open_full(42) is full and list(view.full) == [42]


def test_run_batch_counts_failed_items(shell):
    view, widgets, _, _, _ = _batch(shell, "[0, -1, 2]")
    assert widgets == [view] and view.wait(WAIT)
    assert view.counts() == {"total": 3, "done": 2, "running": 0, "failed": 1, "cancelled": 0}
    assert view.progress.bar_style == "danger"
    view.open_item(1)
    assert "ZeroDivisionError" in plain(view.item_line.value)


def test_run_batch_counts_cancelled_items(shell):
    def cancel_the_last_five(view):
        for fut in view.futures[-5:]:
            fut.cancel()

    view, widgets, _, _, _ = _batch(shell, "range(20)", ", num_threads=2",
                                    during=cancel_the_last_five)
    states = shell.user_ns["states"]
    assert widgets == [view] and view.wait(WAIT)
    assert [s.cancelled for s in states] == [False] * 15 + [True] * 5
    assert view.counts() == {"total": 20, "done": 15, "running": 0, "failed": 0,
                             "cancelled": 5}
    assert view.progress.value == 20 and view.progress.bar_style == "warning"
    assert "15 done · 0 running · 0 failed · 5 cancelled" in view.text


def test_run_batch_whose_item_fails_to_start(shell):
    fn = shell.user_ns["tiny"]
    with capture_output() as cap:
        result = shell.run_cell("tiny.run_batch([{'i': 0}, {'j': 1}])")  # j: no such argument
    assert isinstance(result.error_in_exec, TypeError)
    view = fn.last_batch_view
    assert shown(cap) == [view]
    assert view.wait(WAIT) and not view.pump.running  # it ended (and unsubscribed) all the same
    assert view.counts() == {"total": 1, "done": 1, "running": 0, "failed": 0, "cancelled": 0}
    view.items.value = 1  # listed, never started
    assert view.item.children == ()


def test_run_batch_at_level_none_shows_nothing(shell):
    set_level(shell, "none")
    view, widgets, _, created, _ = _batch(shell, "range(5)")
    assert view is None and widgets == []
    assert not [w for w in created if isinstance(w, BatchSummary)]
    assert len(shell.user_ns["states"]) == 5
    set_level(shell, "full")


def test_run_batch_outside_a_cell_shows_nothing(shell):
    set_level(shell, "full")
    fn = shell.user_ns["tiny"]
    states = fn.run_batch([{"i": i} for i in range(3)])  # a script's call, not a cell's
    assert fn.last_batch_view is None and len(states) == 3


def test_the_level_from_the_shell_config_and_unloading(shell):
    from sgl_nb.language import function
    from sgl_nb.notebook.magics import load_ipython_extension, unload_ipython_extension

    shell.config.SglMagics.widget = "compact"  # as `c.SglMagics.widget` in ipython_config.py
    try:
        load_ipython_extension(shell)  # a second load replaces the first
        m = magics(shell)
        assert m.widget == "compact"
        assert [c for c in shell.configurables if isinstance(c, SglMagics)] == [m]
        assert shell.find_cell_magic("sgl").__self__ is m
        assert function.batch_view_factory() == m.batch_view
        unload_ipython_extension(shell)
        assert function.batch_view_factory() is None
        view, widgets, *_ = _batch(shell, "range(2)")
        assert view is None and widgets == []  # no summary once unloaded
    finally:
        del shell.config["SglMagics"]
        load_ipython_extension(shell)
    assert magics(shell).widget == "full"
    assert function.batch_view_factory() == magics(shell).batch_view


# ---- a real kernel: what a saved notebook keeps ---------------------------------------------

KERNEL_CELLS = [
    "%load_ext sgl_nb",
    '%config SglMagics.widget = "compact"',
    "%%sgl quiet\ns += 'The sea is'\ns += gen('x', max_tokens=4, ignore_eos=True)",
    TINY,
    # No limit in the cell: the preprocessor's per-cell timeout is the guard against a hang.
    "states = tiny.run_batch([{'i': i} for i in range(20)], num_threads=5)\n"
    "assert tiny.last_batch_view.wait() and quiet.widget.wait()",
    "print(quiet.widget.text)\nprint(tiny.last_batch_view.text)",
]


def test_saved_notebook_shows_the_final_lines(tmp_path):
    """Executed on a real kernel (nbconvert): the compact cell and the run_batch cell each
    saved one widget output whose static text/html copy is the final line."""
    from nbconvert.preprocessors import ExecutePreprocessor
    from nbformat.v4 import new_code_cell, new_notebook

    from sgl_nb.runtime.model.model_loader import cache_dir

    nb = new_notebook(cells=[new_code_cell(c) for c in KERNEL_CELLS], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    mp = pytest.MonkeyPatch()
    mp.setenv("SGL_NB_CACHE", str(cache_dir()))  # the kernel finds the converted model
    try:
        ExecutePreprocessor(timeout=int(WAIT), startup_timeout=int(WAIT),
                            kernel_name="python3").preprocess(
            nb, {"metadata": {"path": str(tmp_path)}})
    finally:
        mp.undo()
    for cell_ in nb.cells:
        for o in cell_.outputs:
            assert o.output_type != "error", f"{o.get('ename')}: {o.get('evalue')}"
    printed = nb.cells[5].outputs[0]["text"].splitlines()
    assert printed[0].startswith("done · quiet · 4 tokens · ")
    assert printed[1].startswith("run_batch tiny · 20/20 · 20 done · 0 running")
    for index, line in ((2, printed[0]), (4, printed[1])):
        views = [o for o in nb.cells[index].outputs if VIEW in o.get("data", {})]
        assert len(views) == 1, nb.cells[index].outputs  # one widget, whatever the count
        # The final line, not the one it was displayed with (updated through its handle).
        assert plain(views[0]["data"]["text/html"]).removeprefix("● ") == line
        assert views[0]["data"]["text/plain"] == line
