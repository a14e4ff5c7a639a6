"""A real browser on a real JupyterLab: a `%%sgl` cell runs, its stream widget shows the
generated text, and a click on Step node advances the stepper; a nested call held at a
breakpoint shows its Variables and Call stack panels, and a click on a token selects the
Node that produced it.

JupyterLab runs from this venv on 127.0.0.1 with a token; Debian's Chromium is driven by the
playwright package (its own browser download is never used). Screenshots and the server log
go to test-artifacts/browser/."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "browser"
TIMEOUT_MS = 240_000  # the kernel loads the model on 2 CPU cores

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


def _notebook(path: Path) -> None:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[new_code_cell(c) for c in CELLS], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, path)


def _settings(folder: Path) -> None:
    """All cells stay in the page (no windowing), and no news or update checks."""
    tracker = folder / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    news = folder / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))


@pytest.fixture
def lab(tmp_path):
    _need_chromium()
    from sgl_nb.runtime.model.model_loader import cache_dir

    root, settings = tmp_path / "root", tmp_path / "settings"
    root.mkdir()
    _notebook(root / "browser.ipynb")
    _settings(settings)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "SGL_NB_CACHE": str(cache_dir()),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / "jupyterlab.log", "w")  # noqa: SIM115 - closed below
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


def _wait_ready(base: str, token: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.poll() is None, "JupyterLab exited; see test-artifacts/browser/"
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("JupyterLab did not answer within 120 s")


def test_sgl_cell_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, token = lab
    profile = tmp_path / "chromium-profile"  # a fresh --user-data-dir
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1400, "height": 1600})
        page = ctx.new_page()
        try:
            _run(page, f"{base}/lab/tree/browser.ipynb?token={token}", expect)
        finally:
            page.screenshot(path=str(ARTIFACTS / "last.png"), full_page=True)
            ctx.close()


def _run(page, url: str, expect) -> None:
    page.set_default_timeout(TIMEOUT_MS)
    expect.set_options(timeout=TIMEOUT_MS)
    page.goto(url)
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    expect(cells).to_have_count(len(CELLS))
    expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")).to_have_count(
        1, timeout=TIMEOUT_MS)
    page.screenshot(path=str(ARTIFACTS / "1-opened.png"))

    # Make the notebook the current widget (the Run menu acts on it), then run everything.
    cells.nth(0).locator(".jp-InputPrompt").click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    expect(cells.nth(0).locator(".jp-InputPrompt")).to_contain_text("[1]")

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


def _generated(cell) -> int:
    """The generated-token count the stream view's header shows now."""
    m = re.search(r"generated (\d+)", cell.locator(".sgl-head").inner_text())
    return int(m.group(1)) if m else 0


def _pause_a_long_run(page, cell, expect) -> None:
    """A 2,000-token generation streams while the page stays responsive: Pause takes effect
    within a second, the count then stops, and Stop ends the program."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while _generated(cell) < 20:
        assert time.monotonic() < deadline, "the long program never streamed"
        page.wait_for_timeout(200)
    cell.get_by_role("button", name="Pause").click()
    expect(cell.get_by_text(re.compile("held at a (decode|node)")).first).to_be_visible(
        timeout=1000)
    page.wait_for_timeout(500)  # the stream view's last delta (it sends 10 a second)
    held = _generated(cell)
    assert 20 <= held < 2000, held
    page.wait_for_timeout(1500)
    assert _generated(cell) == held  # nothing decodes while it is held
    page.screenshot(path=str(ARTIFACTS / "7-long-paused.png"), full_page=True)
    cell.get_by_role("button", name="Stop").click()
    expect(cell.locator(".sgl-head")).to_contain_text("cancelled", timeout=TIMEOUT_MS)
