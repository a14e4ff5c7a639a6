"""A notebook saved after its run shows each program's result: executed on a real kernel
(nbconvert's ExecutePreprocessor), then converted to HTML (HTMLExporter). Viewers that run
no widgets (GitHub, nbviewer, nbconvert without widget state) show the static text/html of
the same output; the saved widget state holds the final traits and Node list."""

from __future__ import annotations

import copy
import html
import re

import pytest
from support.waits import WAIT

pytestmark = pytest.mark.slow

CELLS = [
    "%load_ext sgl_nb",
    '%%sgl menu --max-tokens 6\ns += "Lunch today: "\n'
    's += select("dish", choices=["soup", "salad"])\ns += ". The reason:"\n'
    's += gen("why", ignore_eos=True)',
    # No limit in the cell: the preprocessor's per-cell timeout is the guard against a hang.
    'menu.wait()\nassert menu.widget.wait()\n'
    'print("WHY<<" + menu["why"] + ">>DISH<<" + menu["dish"] + ">>")',
]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def visible(markup: str) -> str:
    """The text a browser shows (style blocks and tags dropped, entities decoded)."""
    markup = re.sub(r"<style.*?</style>", "", markup, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    from nbconvert.preprocessors import ExecutePreprocessor
    from nbformat.v4 import new_code_cell, new_notebook

    from sgl_nb.runtime.model.model_loader import cache_dir

    nb = new_notebook(cells=[new_code_cell(c) for c in CELLS], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    workdir = tmp_path_factory.mktemp("export")
    mp = pytest.MonkeyPatch()
    # The kernel (this venv's python) must find the converted model: the same cache folder.
    mp.setenv("SGL_NB_CACHE", str(cache_dir()))
    try:
        ExecutePreprocessor(timeout=int(WAIT), startup_timeout=int(WAIT),
                            kernel_name="python3").preprocess(
            nb, {"metadata": {"path": str(workdir)}})
    finally:
        mp.undo()
    for cell in nb.cells:
        for o in cell.outputs:
            assert o.output_type != "error", f"{o.get('ename')}: {o.get('evalue')}"
    printed = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    why, dish = re.search(r"WHY<<(.*)>>DISH<<(.*)>>", printed, re.S).groups()
    assert dish in ("soup", "salad") and why
    return nb, why, dish


def _export(nb) -> str:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nb)
    return body


def test_html_without_widgets_shows_text_and_nodes(executed):
    nb, why, dish = executed
    shown = nb.cells[1].outputs
    assert any(WIDGET_VIEW in o.get("data", {}) for o in shown)  # the widget is there too
    bare = copy.deepcopy(nb)
    bare.metadata.pop("widgets", None)  # a viewer that runs no widgets
    page = _export(bare)
    static = page[page.index('class="sgl-static"'):]
    text = visible(static)
    assert "%%sgl menu" in text and "done" in visible(
        re.search(r'<span class="sgl-static-status">(.*?)</span>', static).group(1))
    # The program's final text, coloured by origin (the generated part marked so).
    assert "Lunch today: " in text and ". The reason:" in text and why in text
    assert 'class="sgl-generated"' in static
    # Its Node list with statuses, and its variables.
    for label in ("Text 'Lunch today: '", "Select dish choices=['soup', 'salad']", "Gen why"):
        assert re.search(re.escape(label) + r"\s+line \d+\s+\[done\]", text), label
    assert f"dish Select = {dish!r}" in text and f"why Gen = {why!r}" in text
    assert "finish_reason=length" in text and "scores='soup': " in text


def test_saved_widget_state_holds_the_final_view(executed):
    nb, why, dish = executed
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    models = [m["state"] for m in state.values()]
    stream = [m for m in models if m.get("text", "").startswith("Lunch today")
              or "Lunch today" in m.get("text", "")]
    assert stream and stream[0]["text"].endswith(f"{dish}. The reason:{why}")
    snapshots = [m["snapshot"] for m in models if m.get("root_class") == "sgl-graph"]
    assert snapshots and snapshots[0], "the Node list is not in the saved state"
    rows = " ".join(visible(r["h"]) for r in snapshots[0])
    assert "Gen why" in rows and "[done]" in rows and "[pending]" not in rows
    # The exported page embeds that state for the widget manager to draw.
    assert "sgl-graph" in _export(nb)
