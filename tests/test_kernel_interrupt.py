"""A real Jupyter kernel (jupyter_client) interrupted as the stop button does it, while a cell
waits on a 3,000-token `rt.generate` and, separately, on a `%%sgl` program's `wait()`: the
cell returns at once, the engine is idle right after, the next cell answers, and a program
started before the interrupt gives the greedy text it gives alone."""

from __future__ import annotations

import time

import pytest

from sgl_nb.bench.cancel import AFTER, SETUP, Kernel, interrupt_once
from sgl_nb.runtime.model.model_loader import cache_dir

pytestmark = pytest.mark.slow

BACKGROUND = """
@sgl.function
def side(s):
    s += "A list of ten fruits:" + sgl.gen("fruits", max_tokens=120, ignore_eos=True)

alone = side.run().text()
bg = side.run_async()
print("started", flush=True)
"""


@pytest.fixture(scope="module")
def kernel(model_path):
    k = Kernel(env={"SGL_NB_CACHE": str(cache_dir())})
    try:
        setup = k.run(SETUP.format(model=str(model_path)), timeout=600)
        assert "ready" in setup.stdout, setup
        yield k
    finally:
        k.close()


def test_interrupt_while_generate_waits(kernel):
    assert "started" in kernel.run(BACKGROUND, timeout=300).stdout
    r = interrupt_once(kernel, tokens=3000, decode_s=1.5)
    assert r["reply"].status == "error" and r["reply"].ename == "KeyboardInterrupt"
    assert r["returned_s"] < 3.0  # the cell returns within 3 s of the interrupt
    # Within one more second nothing of it runs or waits and its KV is unlocked; the
    # program started before the interrupt still runs (its own request) and is not counted.
    assert r["left_s"] is not None and r["left_s"] < 4.0
    same = kernel.run("print(bg.result().text() == alone, flush=True)", timeout=120)
    assert same.stdout.strip() == "True", same  # as alone, token for token
    idle = kernel.run(AFTER.format(within=0.1), timeout=30).stdout.split()
    assert idle[3] == "0" and idle[5] == "0"  # busy, locked
    assert kernel.run("print(1 + 1)").stdout.strip() == "2"  # the next cell answers


def test_interrupt_while_a_program_waits(kernel):
    kernel.run("%load_ext sgl_nb")
    start = kernel.run('%%sgl tale --no-widget\ns += "Once upon a time" + '
                       'gen("t", max_tokens=3000, ignore_eos=True)\n', timeout=60)
    assert start.status == "ok", start
    msg_id = kernel.send('print("waiting", flush=True)\ntale.wait()')
    kernel.wait_for_output(msg_id, "waiting")
    time.sleep(1.5)
    t0 = kernel.interrupt()
    reply = kernel.reply(msg_id, timeout=30)
    assert reply.ename == "KeyboardInterrupt" and time.monotonic() - t0 < 3.0
    check = kernel.run(
        "import time\n"
        "deadline = time.monotonic() + 1.0\n"
        "while rt.metrics()['running'] + rt.metrics()['waiting'] and "
        "time.monotonic() < deadline:\n    time.sleep(0.01)\n"
        "m = rt.metrics()\n"
        "print(m['running'], m['waiting'], rt.cache_stats()['protected_tokens'],\n"
        "      type(tale.error()).__name__, len(tale['t']) > 0,\n"
        "      [n.status for n in tale.nodes], flush=True)\n", timeout=30)
    running, waiting, locked, error, kept, statuses = check.stdout.split(" ", 5)
    assert (running, waiting, locked) == ("0", "0", "0"), check
    assert error == "ProgramCancelled" and kept == "True"
    assert "'cancelled'" in statuses
    assert kernel.run("print(2 + 2)").stdout.strip() == "4"
