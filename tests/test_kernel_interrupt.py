"""A real Jupyter kernel (jupyter_client) interrupted as the stop button does it, while a cell
waits on a 3,000-token `rt.generate` and, separately, on a `%%sgl` program's `wait()`: the
cell ends with KeyboardInterrupt, the request is aborted where it stood, the engine is idle
after, the next cell answers, and a program started before the interrupt gives the greedy
text it gives alone. (How fast an interrupt acts is measured by `sgl-nb bench cancel`.)"""

from __future__ import annotations

import pytest
from support.waits import WAIT, limit

from sgl_nb.bench.cancel import SETUP, Kernel
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

# announce(call, is_ours), run in a cell just before it blocks in `call` (the bound method
# it calls: a %%sgl program's wait is its own): a thread prints "decoding" once the main
# thread is inside `call` and the engine has sent a token event
# that is_ours accepts. The test interrupts then, not after a fixed delay: on any machine
# the interrupt lands in the blocking call, mid-decode.
ANNOUNCE = """
import sys, threading

def announce(call, is_ours):
    seen = threading.Event()

    def on_event(e):  # on the engine thread: return at once
        if e.kind == "token" and is_ours(e):
            seen.set()

    code = getattr(call, "__func__", call).__code__  # a bound method's function's

    def inside() -> bool:
        f = sys._current_frames().get(threading.main_thread().ident)
        while f is not None and f.f_code is not code:
            f = f.f_back
        return f is not None

    def run():
        while not (seen.wait(0.01) and inside()):
            pass
        rt.events.unsubscribe(on_event)
        print("decoding", flush=True)

    rt.events.subscribe(on_event)
    threading.Thread(target=run, daemon=True).start()
"""

LONG_GENERATE = """
while not events.empty():
    events.get_nowait()
announce(rt.generate, lambda e: e.program is None)  # not bg's tokens
rt.generate("Once upon a time, in a land far away,", max_tokens=3000, ignore_eos=True)
"""

# The aborted request's end (its instruction_finished event) and how many tokens it had.
ABORTED = """
left = None
deadline = time.monotonic() + {limit}
while left is None and time.monotonic() < deadline:
    try:
        e = events.get(timeout=0.05)
    except Exception:
        continue
    if e.kind == "instruction_finished" and e.usage.get("finish_reason") == "abort":
        left = e.usage.get("output_tokens")
print("aborted", left, flush=True)
"""

# Until nothing runs, waits or holds KV (or the limit): busy and locked then.
IDLE = """
def busy_locked():
    m = rt.metrics()
    return (m["running"] + m["waiting"] + m["prefilling"] + m["suspended"],
            rt.cache_stats()["protected_tokens"])

deadline = time.monotonic() + {limit}
while busy_locked() != (0, 0) and time.monotonic() < deadline:
    time.sleep(0.01)
print(*busy_locked(), flush=True)
"""


@pytest.fixture(scope="module")
def kernel(model_path):
    k = Kernel(env={"SGL_NB_CACHE": str(cache_dir())})
    try:
        setup = k.run(SETUP.format(model=str(model_path)) + ANNOUNCE, timeout=limit(600))
        assert "ready" in setup.stdout, setup
        yield k
    finally:
        k.close()


def interrupt_when_decoding(kernel, code: str):
    """Run a cell that calls announce(...); interrupt it once it says "decoding"; its
    reply."""
    msg_id = kernel.send(code)
    kernel.wait_for_output(msg_id, "decoding", timeout=WAIT)
    kernel.interrupt()
    return kernel.reply(msg_id, timeout=WAIT)


def test_interrupt_while_generate_waits(kernel):
    assert "started" in kernel.run(BACKGROUND, timeout=WAIT).stdout
    reply = interrupt_when_decoding(kernel, LONG_GENERATE)
    assert reply.status == "error" and reply.ename == "KeyboardInterrupt", reply
    # The request left the engine aborted, with what it had decoded: cut short.
    aborted = kernel.run(ABORTED.format(limit=WAIT), timeout=2 * WAIT).stdout.split()
    assert aborted[0] == "aborted" and aborted[1] != "None", aborted
    assert 1 <= int(aborted[1]) < 3000, aborted
    # The program started before the interrupt still runs (its own request), as alone.
    same = kernel.run("print(bg.result().text() == alone, flush=True)", timeout=WAIT)
    assert same.stdout.strip() == "True", same  # as alone, token for token
    idle = kernel.run(IDLE.format(limit=WAIT), timeout=2 * WAIT)
    assert idle.stdout.split() == ["0", "0"], idle  # busy, locked
    assert kernel.run("print(1 + 1)").stdout.strip() == "2"  # the next cell answers


def test_interrupt_while_a_program_waits(kernel):
    kernel.run("%load_ext sgl_nb")
    start = kernel.run('%%sgl tale --no-widget\ns += "Once upon a time" + '
                       'gen("t", max_tokens=3000, ignore_eos=True)\n', timeout=WAIT)
    assert start.status == "ok", start
    reply = interrupt_when_decoding(
        kernel, "announce(tale.wait, lambda e: e.program == tale.id)\ntale.wait()")
    assert reply.ename == "KeyboardInterrupt", reply
    idle = kernel.run(IDLE.format(limit=WAIT), timeout=2 * WAIT)
    assert idle.stdout.split() == ["0", "0"], idle  # busy, locked
    check = kernel.run(
        "print(type(tale.error()).__name__, len(tale['t']) > 0,\n"
        "      [n.status for n in tale.nodes], flush=True)\n", timeout=WAIT)
    error, kept, statuses = check.stdout.split(" ", 2)
    assert error == "ProgramCancelled" and kept == "True", check
    assert "'cancelled'" in statuses
    assert kernel.run("print(2 + 2)").stdout.strip() == "4"
