"""Both notebooks executed top to bottom on a real Jupyter kernel (this venv's python),
their outputs checked."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from support.waits import WAIT

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def execute(name: str, workdir: Path):
    import nbformat
    from nbclient import NotebookClient

    from sgl_nb.runtime.model.model_loader import cache_dir

    shutil.copy(NOTEBOOKS / name, workdir / name)
    nb = nbformat.read(workdir / name, as_version=4)
    # The kernel (this venv's python: jupyter_client starts a "python" kernelspec with
    # sys.executable) must find the converted model: the same cache folder as this process.
    env = {**os.environ, "SGL_NB_CACHE": str(cache_dir())}
    # Per cell (the first %%sgl cell loads the model in the kernel), and the kernel's start.
    client = NotebookClient(nb, timeout=int(WAIT), startup_timeout=int(WAIT),
                            kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    client.execute(env=env)
    return nb


def text_of(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        assert o.output_type != "error", f"cell failed: {o.get('ename')}: {o.get('evalue')}"
        if o.output_type == "stream":
            out.append(o.text)
        elif "text/plain" in o.get("data", {}):
            out.append(o["data"]["text/plain"])
    return "".join(out)


def cell_with(nb, needle: str):
    return next(c for c in nb.cells if c.cell_type == "code" and needle in c.source)


def test_quickstart(tmp_path, model_path):
    nb = execute("quickstart.ipynb", tmp_path)
    for cell in nb.cells:
        if cell.cell_type == "code":
            text_of(cell)  # no cell failed
    assert "model: " in text_of(cell_with(nb, "%sgl_model"))
    reply = text_of(cell_with(nb, 'print(hello["reply"])')).strip()
    assert len(reply) > 10
    assert len(text_of(cell_with(nb, "text_iter")).strip()) > 10
    assert re.fullmatch(r"sentiment: (positive|negative)\n",
                        text_of(cell_with(nb, 'print("sentiment:"')))
    names = text_of(cell_with(nb, 'enumerate(ideas["name"], 1)')).strip().splitlines()
    assert [line.split(" ")[0] for line in names] == ["1", "2", "3"]
    assert text_of(cell_with(nb, "hello.fn.run")).strip() == reply  # greedy: the same reply
    # The widget followed the program to its end; its final state is in its traits.
    final = text_of(cell_with(nb, "hello.widget.wait()"))
    assert re.match(r"done: [1-9]\d* tokens generated, [1-9]\d* prompt tokens", final)
    assert any(o.get("data", {}).get("application/vnd.jupyter.widget-view+json")
               for o in cell_with(nb, "%%sgl hello").outputs)  # the cell showed its widget


def test_debugging(tmp_path, model_path):
    nb = execute("debugging.ipynb", tmp_path)
    for cell in nb.cells:
        if cell.cell_type == "code":
            text_of(cell)
    held = text_of(cell_with(nb, "trip.debug.step()  #"))
    assert "held before: Text 'A day in Lisbon.\\nMorning:' (cell line 2 )" in held
    assert "now before: Gen morning" in held
    assert "waiting at: decode | tokens so far: 2" in text_of(cell_with(nb, "tokens so far"))
    stopped = text_of(cell_with(nb, 'breakpoint(name="afternoon")'))
    assert "stopped at: Gen afternoon" in stopped and "morning: " in stopped
    assert "Afternoon:" in text_of(cell_with(nb, "print(trip.text())"))
    assert text_of(cell_with(nb, "%sgl_cache --text")).startswith("root  nodes=")
    export = text_of(cell_with(nb, "%sgl_trace export"))
    assert re.search(r"wrote [1-9]\d* spans to haiku_trace.jsonl", export)
    assert (tmp_path / "haiku_trace.jsonl").exists()
    replay = text_of(cell_with(nb, "load(\"haiku_trace.jsonl\")"))
    assert "replayed haiku: done" in replay and "Gen poem done line 3" in replay
