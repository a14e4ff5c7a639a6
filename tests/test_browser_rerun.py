"""A real browser on a real JupyterLab (test_browser.py's server and Chromium): in a
running notebook a click on a generated token shows its alternatives under the stream, and
"Re-run from here" with an edited value shows the new run's widget with the edit, then its
diff against the original."""

from __future__ import annotations

import re

import pytest
from test_browser import ARTIFACTS, TIMEOUT_MS, chromium_page, notebook, run_all, serve_lab

pytestmark = pytest.mark.slow

CELLS = [
    "%load_ext sgl_nb",
    '%%sgl capital\ns += "The capital of France is"\n'
    's += gen("city", max_tokens=4, ignore_eos=True)\ns += ". It is famous for"\n'
    's += gen("known", max_tokens=4, ignore_eos=True)',
    'capital.wait()\nprint("CITY<<" + capital["city"] + ">>")',
]


@pytest.fixture
def lab(tmp_path):
    with serve_lab(tmp_path, {"rerun.ipynb": notebook(CELLS)}) as served:
        yield served


def test_why_this_token_and_rerun_from_here(lab, tmp_path):
    from playwright.sync_api import expect

    base, token = lab
    with chromium_page(tmp_path, "rerun-last.png") as page:
        cells = run_all(page, f"{base}/lab/tree/rerun.ipynb?token={token}", len(CELLS),
                        expect)
        printed = cells.nth(2).locator(".jp-OutputArea-output", has_text="CITY<<")
        expect(printed).to_be_visible(timeout=TIMEOUT_MS)
        city = re.search(r"CITY<<(.*)>>", printed.inner_text(), re.S).group(1)
        cell = cells.nth(1)
        _why(page, cell, city, expect)
        _rerun(page, cell, expect)


def _why(page, cell, city: str, expect) -> None:
    """A click on gen city's first token: its alternatives, its Node and line; closable."""
    stream = cell.locator(".sgl-stream").first
    expect(stream).to_contain_text(city.strip())
    stream.locator('[data-var="city"][data-tok]').first.click()
    why = cell.locator(".sgl-why").first
    expect(why).to_be_visible()
    expect(why).to_contain_text("token 0 of Gen city")
    expect(why).to_contain_text('gen("city", max_tokens=4')  # its source line
    expect(why).to_contain_text("Decode #")
    expect(why).to_contain_text("no grammar")
    rows = why.locator("tr")
    expect(rows.first).to_contain_text("rank")
    assert rows.count() >= 3, "fewer than two alternatives shown"
    expect(why.locator("tr.sgl-why-taken")).to_have_count(1)
    expect(why.locator("td", has_text="%").first).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "rerun-1-why.png"), full_page=True)
    why.locator(".sgl-why-close").click()
    expect(why).to_be_hidden()


def _rerun(page, cell, expect) -> None:
    """The token click selected gen city: edit its value, re-run, see the new run."""
    panel = cell.locator(".sgl-rerun")
    expect(panel).to_contain_text("Re-run from #")
    expect(panel).to_contain_text("Gen city")
    box = panel.locator(".sgl-rerun-value textarea")
    box.fill(" Lyon")
    panel.get_by_role("button", name="Re-run from here").click()
    run = panel.locator(".sgl-reruns")
    expect(run).to_contain_text("re-run of capital from #")
    new_stream = run.locator(".sgl-stream").first
    expect(new_stream).to_contain_text("The capital of France is Lyon")  # then its var mark
    expect(new_stream.locator('[data-var="city"]')).to_have_text(" Lyon")
    expect(new_stream).to_contain_text(". It is famous for")
    expect(run.locator(".sgl-head").first).to_contain_text("done")
    expect(run.locator(".sgl-rerun-diff .sgl-diff")).to_be_visible()
    expect(run.locator(".sgl-rerun-diff")).to_contain_text("Lyon")
    page.screenshot(path=str(ARTIFACTS / "rerun-2-new-run.png"), full_page=True)
