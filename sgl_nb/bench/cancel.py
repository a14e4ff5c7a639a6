"""`sgl-nb bench cancel`: how fast an interrupt stops work, in a real Jupyter kernel.

A kernel (this Python, through jupyter_client) runs a cell that waits on a long
`rt.generate`; the kernel is interrupted as a notebook's stop button does (SIGINT); the
figure is the time from the interrupt to the request leaving the engine (its
instruction_finished event, finish_reason "abort"), both read on the machine's monotonic
clock. Also the time until the cell's reply arrives. Median of --rounds interrupts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

from sgl_nb.bench import add_model_argument

SETUP = """
import time
import sgl_nb as sgl
from sgl_nb.runtime.events import InstructionFinished
rt = sgl.Runtime({model!r})
sgl.set_default_backend(rt)
events = rt.events.subscribe()
rt.generate("Hello", max_tokens=4)
print("ready", flush=True)
"""

# The cell that is interrupted: it prints when it has started waiting.
LONG_GENERATE = """
while not events.empty():
    events.get_nowait()
print("waiting", flush=True)
rt.generate("Once upon a time, in a land far away,", max_tokens={tokens}, ignore_eos=True)
"""

# Where the aborted request left the engine, and whether the engine is idle.
AFTER = """
left = None
deadline = time.monotonic() + {within}
while left is None and time.monotonic() < deadline:
    try:
        e = events.get(timeout=0.05)
    except Exception:
        continue
    if isinstance(e, InstructionFinished) and e.usage.get("finish_reason") == "abort":
        left = e.ts / 1e9
m = rt.metrics()
print("left", left, "busy", m["running"] + m["waiting"] + m["prefilling"] + m["suspended"],
      "locked", rt.cache_stats()["protected_tokens"], flush=True)
"""


@dataclass
class Reply:
    status: str  # "ok" | "error" | "timeout"
    stdout: str
    ename: str | None = None


class Kernel:
    """A real IPython kernel of this Python, driven cell by cell."""

    def __init__(self, env: dict | None = None):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env={**os.environ, **(env or {})})
        self.client = self.km.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def send(self, code: str) -> str:
        return self.client.execute(code)

    def reply(self, msg_id: str, timeout: float) -> Reply:
        """The cell's output and reply; status "timeout" if it has not ended by then."""
        out, deadline = [], time.monotonic() + timeout
        status, ename = "timeout", None
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - queue.Empty: nothing yet
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                ename = content["ename"]
            elif kind == "status" and content["execution_state"] == "idle":
                status = "error" if ename else "ok"
                break
        return Reply(status, "".join(out), ename)

    def run(self, code: str, timeout: float = 300) -> Reply:
        return self.reply(self.send(code), timeout)

    def wait_for_output(self, msg_id: str, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=0.1)
            except Exception:  # noqa: BLE001 - nothing yet
                continue
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream"
                    and text in msg["content"]["text"]):
                return
        raise TimeoutError(f"the cell never printed {text!r}")

    def interrupt(self) -> float:
        """Interrupt the running cell (SIGINT, as the stop button); when, on the monotonic
        clock."""
        t = time.monotonic()
        self.km.interrupt_kernel()
        return t

    def close(self) -> None:
        self.client.stop_channels()
        self.km.shutdown_kernel(now=True)


def interrupt_once(kernel: Kernel, tokens: int = 3000, decode_s: float = 1.0) -> dict:
    """Interrupt a cell waiting on a `tokens`-long generate after `decode_s` seconds."""
    msg_id = kernel.send(LONG_GENERATE.format(tokens=tokens))
    kernel.wait_for_output(msg_id, "waiting")
    time.sleep(decode_s)
    t0 = kernel.interrupt()
    reply = kernel.reply(msg_id, timeout=30)
    returned = time.monotonic() - t0
    after = kernel.run(AFTER.format(within=5.0), timeout=30).stdout.split()
    left = None if after[1] == "None" else float(after[1]) - t0
    return {"reply": reply, "returned_s": returned, "left_s": left,
            "busy": int(after[3]), "locked": int(after[5])}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--rounds", type=int, default=3, help="interrupts")
    parser.add_argument("--cancel-tokens", type=int, default=3000,
                        help="max_tokens of the generate that is interrupted")


def run(args: argparse.Namespace) -> int:
    from sgl_nb.runtime.model.model_loader import cache_dir

    kernel = Kernel(env={"SGL_NB_CACHE": str(cache_dir())})
    try:
        setup = kernel.run(SETUP.format(model=args.model), timeout=600)
        if "ready" not in setup.stdout:
            print(f"the kernel could not load the model: {setup}")
            return 1
        rows = []
        for i in range(args.rounds):
            r = interrupt_once(kernel, tokens=args.cancel_tokens)
            rows.append(r)
            print(f"interrupt {i + 1}: request left the engine after "
                  f"{_ms(r['left_s'])}, cell returned after {_ms(r['returned_s'])} "
                  f"({r['reply'].ename}), busy {r['busy']}, locked {r['locked']}", flush=True)
    finally:
        kernel.close()
    left = [r["left_s"] for r in rows if r["left_s"] is not None]
    returned = [r["returned_s"] for r in rows]
    print(f"\nmedian of {len(rows)}: interrupt -> request left the engine "
          f"{_ms(statistics.median(left)) if left else 'never'}; interrupt -> cell returned "
          f"{_ms(statistics.median(returned))}")
    return 0 if len(left) == len(rows) else 1


def _ms(s: float | None) -> str:
    return "never" if s is None else f"{s * 1000:.1f} ms"
