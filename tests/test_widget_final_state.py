"""A saved notebook keeps each program widget's final state, on a real Jupyter kernel run
by nbclient as `jupyter nbconvert --execute` runs it.

A notebook runner records only the messages of the cell it is running. A program that ends
between two cells sends its final state under the request of a cell that has finished:
the widget sends it again after the next cell (ProgramWidget._after_cell). One that ends
while a cell runs was recorded with that cell: it is not sent twice."""

from __future__ import annotations

import os
import time

import pytest
from support.waits import WAIT

pytestmark = pytest.mark.slow

PROGRAM = 's += "Name three colours:" + gen("c", max_tokens=6, ignore_eos=True)'


def _client(nb, workdir):
    from nbclient import NotebookClient

    class Recorder(NotebookClient):
        """nbclient itself, keeping the comm messages it handled for each cell."""

        def handle_comm_msg(self, outs, msg, cell_index):
            self.comm_msgs.setdefault(cell_index, []).append(msg["content"])
            super().handle_comm_msg(outs, msg, cell_index)

    client = Recorder(nb, timeout=int(WAIT), startup_timeout=int(WAIT), kernel_name="python3",
                      resources={"metadata": {"path": str(workdir)}})
    client.comm_msgs = {}
    return client


def _states(msgs: list[dict], comm: str) -> list[dict]:
    """The widget states one comm's messages carried (its opening, then its updates)."""
    return [m["data"]["state"] for m in msgs
            if m.get("comm_id") == comm and "state" in m.get("data", {})]


def _program_widget(msgs: list[dict]) -> str:
    """The comm of the ProgramWidget a cell opened (its state has a program id)."""
    return next(m["comm_id"] for m in msgs if "program_id" in m.get("data", {}).get("state", {}))


def _wait_between_cells(client, program_comm: str) -> None:
    """No cell runs: read the kernel's output channel (as nbclient would, dropping what
    belongs to a finished cell) until the program widget has sent its final status and the
    final static copy has been displayed."""
    from nbclient.util import run_sync

    get = run_sync(client.kc.get_iopub_msg)
    deadline = time.monotonic() + WAIT
    done = displayed = False
    while not (done and displayed):
        assert time.monotonic() < deadline, "the program never ended between the cells"
        try:
            msg = get(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty: nothing yet
            continue
        content = msg["content"]
        if msg["msg_type"] == "comm_msg" and content.get("comm_id") == program_comm:
            done |= content["data"].get("state", {}).get("status") == "done"
        displayed |= done and msg["msg_type"] == "update_display_data"


def test_the_final_state_is_recorded_once_whether_a_program_ends_between_or_in_cells(
        tmp_path, model_path):
    from nbformat.v4 import new_code_cell, new_notebook

    from sgl_nb.runtime.model.model_loader import cache_dir

    nb = new_notebook(cells=[
        new_code_cell("%load_ext sgl_nb"),
        new_code_cell(f"%%sgl between\n{PROGRAM}"),  # 1: returns at once
        new_code_cell("between.widget.wait()"),  # 2: it ended before this cell started
        new_code_cell(f"%%sgl within\n{PROGRAM}"),  # 3
        new_code_cell("within.widget.wait()"),  # 4: it ends while this cell runs
        new_code_cell("pass"),  # 5
    ])
    client = _client(nb, tmp_path)
    env = {**os.environ, "SGL_NB_CACHE": str(cache_dir())}
    with client.setup_kernel(env=env):
        for i in (0, 1):
            client.execute_cell(nb.cells[i], i)
        between = _program_widget(client.comm_msgs[1])
        _wait_between_cells(client, between)
        for i in range(2, len(nb.cells)):
            client.execute_cell(nb.cells[i], i)
        client.set_widgets_metadata()
    for cell in nb.cells:
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.source

    # Ended between cells: what it sent then was dropped, and went again after cell 2.
    assert not any(s.get("status") == "done" for s in _states(client.comm_msgs[1], between))
    assert any(s.get("status") == "done" for s in _states(client.comm_msgs[2], between))
    saved = nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
    assert saved[between]["state"]["status"] == "done"
    snapshots = [m["data"].get("state", {}).get("snapshot") for m in client.comm_msgs[2]]
    assert any(isinstance(s, dict) and s.get("final") for s in snapshots), \
        "the stream view's final snapshot was not sent again"
    static = next(o for o in nb.cells[1].outputs if "text/html" in o.get("data", {}))
    assert '<span class="sgl-static-status">done</span>' in static["data"]["text/html"]

    # Ended within cell 4: recorded there, once; nothing of it goes again after cell 5.
    within = _program_widget(client.comm_msgs[3])
    dones = [s for s in _states(client.comm_msgs[4], within) if s.get("status") == "done"]
    assert len(dones) == 1
    assert not _states(client.comm_msgs.get(5, []), within)
    assert saved[within]["state"]["status"] == "done"
