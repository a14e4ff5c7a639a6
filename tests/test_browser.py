"""A real browser on a real JupyterLab: a `%%sgl` cell runs, its stream widget shows the
generated text, and a click on Step node advances the stepper; a nested call held at a
breakpoint shows its Variables and Call stack panels, and a click on a token selects the
Node that produced it.

JupyterLab runs from this venv on 127.0.0.1 with a token; Debian's Chromium is driven by the
playwright package (its own browser download is never used). Screenshots and the server log
go to test-artifacts/browser/."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waits import WAIT, limit

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "browser"
# A limit on each wait for the page (a cell's output, a widget's state): the slowest is the
# kernel loading the model (~10 s here, alone); only a hang reaches it.
TIMEOUT_MS = int(WAIT * 1000)

CELLS = [
    "%load_ext sgl_nb",
    '%%sgl colours --max-tokens 10\ns += "The three primary colours are"\n'
    's += gen("answer", ignore_eos=True)',
    'colours.wait()\nprint("GENERATED<<" + colours["answer"] + ">>")',
    '%%sgl stepped --step\ns += "One, two,"\ns += gen("n", max_tokens=3)',
    'import sgl_nb as sgl\n\n@sgl.function\ndef inner(s, topic):\n'
    '    s += f" One word about {topic}:"\n'
    '    s += sgl.gen("word", max_tokens=3, ignore_eos=True)\n'
    '    s["n"] = len(s["word"])',
    '%%sgl nested --step\ns += "Pick an animal: "\n'
    's += select("pick", choices=["cat", "dog"])\ninner(s, topic="pets")',
    '%%sgl long --max-tokens 2000\ns += "Once upon a time"\ns += gen("story", ignore_eos=True)',
]


def _need_chromium() -> None:
    if Path(CHROMIUM).exists():
        return
    message = f"{CHROMIUM} is missing (make test installs Debian's chromium)"
    if os.environ.get("SGL_NB_CI") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def notebook(cells: list[str], kernel: bool = True):
    """A notebook of these code cells; kernel=False: without a kernelspec (JupyterLab then
    asks which kernel to start, and "No Kernel" starts none)."""
    from nbformat.v4 import new_code_cell, new_notebook

    meta = {"kernelspec": {"name": "python3", "display_name": "Python 3",
                           "language": "python"}} if kernel else {}
    return new_notebook(cells=[new_code_cell(c) for c in cells], metadata=meta)


def _settings(folder: Path) -> None:
    """All cells stay in the page (no windowing), and no news or update checks."""
    tracker = folder / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    news = folder / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))


@contextlib.contextmanager
def serve_lab(tmp_path: Path, notebooks: dict) -> Iterator[tuple[str, str]]:
    """JupyterLab on 127.0.0.1 serving these notebooks (file name -> notebook node), with a
    token; yields (base URL, token). A notebook whose metadata says "trusted" is signed:
    JupyterLab renders the widgets of a notebook it did not run only when it is trusted
    (an untrusted one shows each output's static text/html)."""
    _need_chromium()
    import nbformat
    from nbformat.sign import NotebookNotary

    from sgl_nb.runtime.model.model_loader import cache_dir

    root, settings, data = tmp_path / "root", tmp_path / "settings", tmp_path / "data"
    root.mkdir()
    data.mkdir()
    for name, nb in notebooks.items():
        trusted = nb.metadata.pop("trusted", False)
        nbformat.write(nb, root / name)
        if trusted:  # as JupyterLab signs a notebook its user saved
            NotebookNotary(data_dir=str(data)).sign(nb)
    _settings(settings)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "SGL_NB_CACHE": str(cache_dir()),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_DATA_DIR": str(data)}  # its notebook signatures
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / f"jupyterlab-{tmp_path.name}.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly", "--allow-root"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, token, server)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@contextlib.contextmanager
def chromium_page(tmp_path: Path, last_shot: str = "last.png"):
    """A page of Debian's Chromium (a fresh profile); a full-page screenshot at the end."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=FLAGS, viewport={"width": 1400, "height": 1600}, timeout=TIMEOUT_MS)
        page = ctx.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        try:
            yield page
        finally:
            page.screenshot(path=str(ARTIFACTS / last_shot), full_page=True)
            ctx.close()


@pytest.fixture
def lab(tmp_path):
    with serve_lab(tmp_path, {"browser.ipynb": notebook(CELLS)}) as served:
        yield served


def _wait_ready(base: str, token: str, server: subprocess.Popen) -> None:
    timeout = limit(300)  # ~3 s here, alone
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, "JupyterLab exited; see test-artifacts/browser/"
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"JupyterLab did not answer within {timeout:.0f} s")


def test_sgl_cell_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import expect

    base, token = lab
    with chromium_page(tmp_path) as page:
        _run(page, f"{base}/lab/tree/browser.ipynb?token={token}", expect)


def _run(page, url: str, expect) -> None:
    cells = run_all(page, url, len(CELLS), expect)
    page.screenshot(path=str(ARTIFACTS / "1-opened.png"))

    # The program's output, printed by the kernel, and the same text in the stream widget.
    printed = cells.nth(2).locator(".jp-OutputArea-output", has_text="GENERATED<<")
    expect(printed).to_be_visible(timeout=TIMEOUT_MS)
    answer = re.search(r"GENERATED<<(.*)>>", printed.inner_text(), re.S).group(1)
    assert answer.strip(), "the program generated nothing"
    stream = cells.nth(1).locator(".sgl-stream")
    expect(stream).to_contain_text(answer.strip(), timeout=TIMEOUT_MS)
    expect(stream).to_contain_text("The three primary colours are")
    expect(cells.nth(1).locator(".sgl-generated[title]").first).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "2-streamed.png"), full_page=True)

    # The stepped program waits before its first Node; Step node moves it on by one.
    stepper = cells.nth(3)
    current = stepper.locator(".sgl-node.sgl-current")
    expect(current).to_have_count(1, timeout=TIMEOUT_MS)
    expect(current).to_contain_text("One,")
    first = current.get_attribute("data-node")
    page.screenshot(path=str(ARTIFACTS / "3-held.png"), full_page=True)
    stepper.get_by_role("button", name="Step node").click()
    expect(current).not_to_have_attribute("data-node", first, timeout=TIMEOUT_MS)
    expect(current).to_contain_text("Gen n")
    expect(stepper.locator(f'.sgl-node[data-node="{first}"]')).to_contain_text("[done]")
    page.screenshot(path=str(ARTIFACTS / "4-stepped.png"), full_page=True)

    # A nested call: break at inner's gen, then read the Variables and Call stack panels.
    nested = cells.nth(5)
    nested.get_by_placeholder("answer | kind=Gen | line=3").fill("word")
    nested.get_by_role("button", name="Add breakpoint").click()
    nested.get_by_role("button", name="Continue").click()
    frames = nested.locator(".sgl-stack .sgl-frame")
    expect(frames).to_have_count(2, timeout=TIMEOUT_MS)
    expect(frames.nth(0)).to_contain_text("nested()")
    expect(frames.nth(1)).to_contain_text("inner(topic='pets')")
    expect(nested.locator(".sgl-stack .sgl-frame.sgl-current")).to_contain_text("inner(")
    expect(nested.locator(".sgl-stack")).to_contain_text('sgl.gen("word"')
    pick = nested.locator('.sgl-vars [data-var="pick"]')
    expect(pick).to_contain_text("Select")
    expect(nested.locator(".sgl-vars")).to_contain_text("scores='cat': ")
    expect(nested.locator(".sgl-node.sgl-current")).to_contain_text("Gen word")
    page.screenshot(path=str(ARTIFACTS / "5-nested-held.png"), full_page=True)

    nested.get_by_role("button", name="Continue").click()
    expect(nested.locator('.sgl-vars [data-var="word"]')).to_be_visible(timeout=TIMEOUT_MS)
    expect(nested.locator(".sgl-vars")).to_contain_text("finish_reason=length")
    expect(nested.locator(".sgl-stack")).to_contain_text("program finished")
    # A click on one of gen word's tokens selects its Node and shows its line.
    nested.locator('.sgl-stream [data-var="word"][title]').first.click()
    expect(nested.locator(".sgl-node[data-selected]")).to_contain_text("Gen word")
    expect(nested.locator(".sgl-node-source")).to_contain_text('sgl.gen("word"')
    page.screenshot(path=str(ARTIFACTS / "6-token-clicked.png"), full_page=True)
    # A click on a row of the Node list selects that Node.
    nested.locator(".sgl-node", has_text="Pick an animal").click()
    expect(nested.locator(".sgl-node[data-selected]")).to_contain_text("Pick an animal")
    expect(nested.locator(".sgl-node-source")).to_contain_text('s += "Pick an animal: "')
    _pause_a_long_run(page, cells.nth(6), expect)


def open_notebook(page, url: str, n_cells: int, expect, kernel: bool = True):
    """Open a notebook and wait until it is ready (its kernel idle); its code cells."""
    page.set_default_timeout(TIMEOUT_MS)
    expect.set_options(timeout=TIMEOUT_MS)
    page.goto(url)
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    expect(cells).to_have_count(n_cells)
    if kernel:
        # The status bar's kernel status says Idle once the session has a kernel and it is
        # idle. The toolbar's execution indicator is no such state: it says idle from the
        # moment the notebook opens, before the session has a kernel, and a cell run then
        # is cleared back to `[ ]` unrun (CodeCell.execute without a kernel) - the window
        # is short on an idle machine and seconds long on a busy one.
        status = page.locator("#jp-main-statusbar").get_by_title(
            re.compile("^Change kernel"))
        expect(status).to_have_text(re.compile(r"\| Idle$"), timeout=TIMEOUT_MS)
    return cells


def run_all(page, url: str, n_cells: int, expect):
    """Open a notebook, run all its cells (they queue; the first has run when this
    returns); its code cells."""
    cells = open_notebook(page, url, n_cells, expect)
    # Make the notebook the current widget (the Run menu acts on it), then run everything.
    cells.nth(0).locator(".jp-InputPrompt").click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    expect(cells.nth(0).locator(".jp-InputPrompt")).to_contain_text("[1]")
    return cells


def _generated(cell) -> int:
    """The generated-token count the stream view's header shows now."""
    m = re.search(r"generated (\d+)", cell.locator(".sgl-head").inner_text())
    return int(m.group(1)) if m else 0


def _pause_a_long_run(page, cell, expect) -> None:
    """A 2,000-token generation streams while the page stays responsive: Pause holds it,
    the count then settles, and Stop ends the program. (That a held program decodes nothing
    is checked exactly on the kernel's side: test_tui_live, test_widgets.)"""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while _generated(cell) < 20:
        assert time.monotonic() < deadline, "the long program never streamed"
        page.wait_for_timeout(200)
    # The click event itself, not a mouse click at the button's place: the text streaming
    # above it moves the button down a line now and then, and a mouse click whose press
    # and release straddle such a move clicks nothing (seen on a busy machine: the program
    # ran to its end unpaused).
    cell.get_by_role("button", name="Pause").dispatch_event("click")
    expect(cell.get_by_text(re.compile("held at a (decode|node)")).first).to_be_visible(
        timeout=TIMEOUT_MS)
    held = _settled(page, cell)
    assert 20 <= held < 2000, held
    page.screenshot(path=str(ARTIFACTS / "7-long-paused.png"), full_page=True)
    cell.get_by_role("button", name="Stop").click()
    expect(cell.locator(".sgl-head")).to_contain_text("cancelled", timeout=TIMEOUT_MS)
    assert held <= _generated(cell) < 2000  # the final state, synced once it ended


def _settled(page, cell, window_ms: int = 3000) -> int:
    """The generated count once it has stopped changing: the header says "held" as soon as
    the step controller holds, while tokens decoded just before may still be on their way
    (the kernel's event pump, the view's 10 deltas a second). A held program's count
    settles; one that still decoded would not, and fails here. A busy machine can only make
    a stall look like settling, never make a held program fail."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    count, since = _generated(cell), time.monotonic()
    while time.monotonic() - since < window_ms / 1000:
        assert time.monotonic() < deadline, f"the count never settled: {count}"
        page.wait_for_timeout(250)
        now = _generated(cell)
        if now != count:
            count, since = now, time.monotonic()
    return count


SAVED_CELLS = [
    "%load_ext sgl_nb",
    '%%sgl menu --max-tokens 6\ns += "Lunch today: "\n'
    's += select("dish", choices=["soup", "salad"])\ns += ". The reason:"\n'
    's += gen("why", ignore_eos=True)',
    # No limit in the cell: nbclient's per-cell timeout is the one guard against a hang.
    'menu.wait()\nassert menu.widget.wait()\n'
    'print("WHY<<" + menu["why"] + ">>DISH<<" + menu["dish"] + ">>")',
]


def _executed(tmp_path: Path, monkeypatch):
    """SAVED_CELLS run by nbclient on a real kernel, the widget state stored in the
    notebook's metadata (as JupyterLab's saveState setting, `make install`, stores it)."""
    from nbclient import NotebookClient

    from sgl_nb.runtime.model.model_loader import cache_dir

    nb = notebook(SAVED_CELLS)
    monkeypatch.setenv("SGL_NB_CACHE", str(cache_dir()))  # the kernel finds the model
    work = tmp_path / "work"
    work.mkdir()
    NotebookClient(nb, timeout=int(WAIT), startup_timeout=int(WAIT), kernel_name="python3",
                   store_widget_state=True,
                   resources={"metadata": {"path": str(work)}}).execute()
    printed = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    why, dish = re.search(r"WHY<<(.*)>>DISH<<(.*)>>", printed, re.S).groups()
    assert "application/vnd.jupyter.widget-state+json" in nb.metadata.get("widgets", {})
    return nb, why, dish


def _no_kernel(nb):
    """The notebook without a kernelspec or language: JupyterLab opens it asking which
    kernel to start, and "No Kernel" starts none."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("kernelspec")
    nb.metadata.pop("language_info", None)  # else it starts a kernel of that language
    return nb


def _trusted(nb):
    nb = copy.deepcopy(nb)
    nb.metadata["trusted"] = True  # serve_lab signs it, as JupyterLab signs what it saves
    return nb


def test_a_saved_notebook_shows_its_programs(tmp_path, monkeypatch):
    """Opened with no kernel, a notebook JupyterLab did not sign itself (nbclient's, or
    one received) shows each program's static copy (JupyterLab renders only the safe
    text/html of an untrusted output; its sanitizer drops the <style> block, so the origin
    colours are inline too): the final text coloured by origin, the Node list and the
    statuses. Signed and opened on a kernel that has not run it, the widgets come back
    from the saved widget state. Signed and opened with no kernel, the outputs stay at
    "Loading widget...": @jupyter-widgets/jupyterlab-manager 5.0 (WidgetManager.
    restoreWidgets) waits for sessionContext.ready, which "No Kernel" never resolves, and
    its _loadFromKernel throws "Kernel not set" before _loadFromNotebook reads the saved
    state (jupyter-widgets/ipywidgets#3773, open): nothing a widget can change."""
    from playwright.sync_api import expect

    nb, why, dish = _executed(tmp_path, monkeypatch)
    notebooks = {"bare.ipynb": _no_kernel(nb), "signed.ipynb": _trusted(nb)}
    with serve_lab(tmp_path, notebooks) as (base, token), \
            chromium_page(tmp_path, "saved-last.png") as page:
        cells = open_notebook(page, f"{base}/lab/tree/bare.ipynb?token={token}",
                              len(SAVED_CELLS), expect, kernel=False)
        page.locator(".jp-Dialog").get_by_role("button", name="No Kernel", exact=True).click()
        expect(page.locator(".jp-Toolbar-kernelName").first).to_contain_text("No Kernel")
        static = cells.nth(1).locator(".sgl-static")
        expect(static.locator(".sgl-static-status")).to_have_text("done")
        _shows_the_program(static, why, dish, expect)
        expect(static.locator(".sgl-generated").first).to_have_css(
            "background-color", "rgb(220, 252, 231)")  # the inline colour survived
        with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=WAIT) as r:
            assert json.load(r) == [], "a kernel was started"
        page.screenshot(path=str(ARTIFACTS / "saved-no-kernel.png"), full_page=True)

        # Its own workspace: the default one would open bare.ipynb again beside it.
        cells = open_notebook(page, f"{base}/lab/workspaces/signed/tree/signed.ipynb"
                              f"?token={token}", len(SAVED_CELLS), expect)
        program = cells.nth(1)
        expect(program.locator(".sgl-static")).to_have_count(0)  # the widgets, not the copy
        expect(program.locator(".sgl-head").first).to_contain_text("done")
        _shows_the_program(program, why, dish, expect)
        page.screenshot(path=str(ARTIFACTS / "saved-fresh-kernel.png"), full_page=True)


def _shows_the_program(where, why: str, dish: str, expect) -> None:
    stream = where.locator(".sgl-stream").first
    expect(stream).to_contain_text("Lunch today: ")
    expect(stream.locator(".sgl-generated").first).to_be_visible()  # coloured by origin
    expect(stream).to_contain_text(dish)
    expect(stream).to_contain_text(why.strip())
    nodes = where.locator(".sgl-node")
    for label in ("Lunch today", "Select dish", "The reason", "Gen why"):
        expect(nodes.filter(has_text=label)).to_contain_text("[done]")
    expect(nodes).to_have_count(4)
