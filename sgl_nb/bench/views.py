"""`sgl-nb bench views`: the widget traffic of one `%%sgl` cell, in a real Jupyter kernel.

A kernel (this Python, through jupyter_client; `Kernel` of sgl_nb/bench/cancel.py) loads
the extension and the model, then for each N of --tokens runs

    %%sgl long --max-tokens N
    s += "Once upon a time"
    s += gen("story", ignore_eos=True)

and waits for the widget's final render (`long.widget.wait()`). Every `comm_open` and
`comm_msg` on iopub from the cell's start to the wait's end is counted. A message's bytes
are its content as JSON in UTF-8 (what jupyter_client's packer writes: default separators,
ensure_ascii off) plus its binary buffers; the envelope (header, parent header, metadata,
signature) is not counted. Bytes a token are comm_msg bytes over the generated tokens (the
comm_open messages, sent once when the widgets are made, are counted apart). Messages a
second are comm_msg over the program's time (first to last comm_msg), and the most comm_msg
in any one second, with what those were (`peak_by_widget`: the widget's class or model
name and the state keys of an update, or "custom"). The stream view's own share (its comm
ids, asked from the kernel) is shown apart.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from sgl_nb.bench import add_json_argument, add_model_argument
from sgl_nb.bench.cancel import Kernel

SETUP = """
%load_ext sgl_nb
import json as _json
import sgl_nb as sgl
rt = sgl.Runtime({model!r})
sgl.set_default_backend(rt)
rt.generate("Hello", max_tokens=4)
print("ready", flush=True)
"""

CELL = """%%sgl long --max-tokens {tokens}
s += "Once upon a time"
s += gen("story", ignore_eos=True)
"""

WAIT = """
_ok = long.widget.wait({timeout})
print("RESULT" + _json.dumps({{
    "rendered": _ok, "status": long.widget.status,
    "generated": long.widget.stream.generated_tokens,
    "stream_comms": [w.model_id for w in long.widget.stream.widgets()],
    "renders": long.widget.pump.throttle.renders if long.widget.pump else 0,
}}), flush=True)
"""


def message_bytes(msg: dict) -> int:
    """A message's content as JSON in UTF-8, plus its binary buffers."""
    content = json.dumps(msg["content"], ensure_ascii=False).encode()
    return len(content) + sum(len(memoryview(b)) for b in msg.get("buffers") or [])


def peak_per_second(times: list[float]) -> int:
    """The most of `times` (sorted) within any one-second window."""
    lo, hi = peak_window(times)
    return hi - lo


def peak_window(times: list[float]) -> tuple[int, int]:
    """Indices [lo, hi) of `times` (sorted) in the one-second window holding the most."""
    best, lo = (0, 0), 0
    for hi, t in enumerate(times):
        while t - times[lo] > 1.0:
            lo += 1
        if hi - lo + 1 > best[1] - best[0]:
            best = (lo, hi + 1)
    return best


def describe(msg: dict, models: dict[str, str]) -> str:
    """A comm_msg in short: its widget's model name and what it carries (the state keys of
    an update, or "custom")."""
    content = msg["content"]
    data = content.get("data", {})
    name = models.get(content["comm_id"], "?")
    if data.get("method") == "update":
        return f"{name} update {','.join(sorted(data.get('state', {})))}"
    return f"{name} {data.get('method', '?')}"


def measure(kernel: Kernel, tokens: int, timeout: float) -> dict:
    """Run the cell for `tokens` and count its comm traffic until the final render."""
    client = kernel.client
    while True:  # what earlier cells left on iopub
        try:
            client.get_iopub_msg(timeout=0.2)
        except Exception:  # noqa: BLE001 - queue.Empty: drained
            break
    opens = msgs = open_bytes = msg_bytes = 0
    per_comm: Counter = Counter()
    per_comm_msgs: Counter = Counter()
    per_comm_msg_bytes: Counter = Counter()
    per_comm_times: dict[str, list[float]] = {}
    models: dict[str, str] = {}
    times: list[float] = []
    kinds: list[str] = []  # what each comm_msg of `times` was (describe)
    t0 = time.monotonic()
    cell_id = kernel.send(CELL.format(tokens=tokens))
    wait_id = kernel.send(WAIT.format(timeout=timeout))
    result, out, error = None, [], None
    deadline = t0 + timeout + 60
    while time.monotonic() < deadline:
        try:
            msg = client.get_iopub_msg(timeout=1.0)
        except Exception:  # noqa: BLE001 - nothing yet
            continue
        kind, content = msg["msg_type"], msg["content"]
        parent = msg["parent_header"].get("msg_id")
        if kind == "comm_open":
            opens += 1
            size = message_bytes(msg)
            open_bytes += size
            per_comm[content["comm_id"]] += size
            state = content.get("data", {}).get("state", {})
            # An anywidget's model is "AnyModel": its class name says which view it is.
            models[content["comm_id"]] = (state.get("_anywidget_id", "").rpartition(".")[2]
                                          or state.get("_model_name", "?"))
        elif kind == "comm_msg":
            msgs += 1
            size = message_bytes(msg)
            msg_bytes += size
            per_comm[content["comm_id"]] += size
            per_comm_msgs[content["comm_id"]] += 1
            per_comm_msg_bytes[content["comm_id"]] += size
            times.append(time.monotonic())
            kinds.append(describe(msg, models))
            per_comm_times.setdefault(content["comm_id"], []).append(times[-1])
        elif kind == "stream" and parent in (cell_id, wait_id):
            out.append(content["text"])
        elif kind == "error" and parent in (cell_id, wait_id):
            error = f"{content['ename']}: {content['evalue']}"
        elif kind == "status" and parent == wait_id and content["execution_state"] == "idle":
            break
    text = "".join(out)
    for line in text.splitlines():
        if line.startswith("RESULT"):
            result = json.loads(line[len("RESULT"):])
    if result is None:
        raise RuntimeError(f"the cell for {tokens} tokens did not end well: {error or text!r}")
    span = (times[-1] - times[0]) if len(times) > 1 else 0.0
    stream = set(result["stream_comms"])
    stream_bytes = sum(v for k, v in per_comm_msg_bytes.items() if k in stream)
    stream_times = sorted(t for k, v in per_comm_times.items() if k in stream for t in v)
    stream_msgs = sum(v for k, v in per_comm_msgs.items() if k in stream)
    generated = result["generated"] or 0
    total = open_bytes + msg_bytes
    by_model: Counter = Counter()
    for comm, size in per_comm.items():
        by_model[models.get(comm, "?")] += size
    return {
        "tokens": tokens,
        "generated": generated,
        "status": result["status"],
        "renders": result["renders"],
        "seconds": round(span, 2),
        "comm_open": opens,
        "comm_open_bytes": open_bytes,
        "comm_msg": msgs,
        "comm_msg_bytes": msg_bytes,
        "total_bytes": total,
        "bytes_per_token": round(msg_bytes / generated, 1) if generated else None,
        "msgs_per_s": round(msgs / span, 1) if span > 0 else None,
        "peak_msgs_in_1s": peak_per_second(times),
        "peak_by_widget": dict(Counter(kinds[slice(*peak_window(times))]).most_common()),
        "stream_bytes": stream_bytes,
        "stream_msgs": stream_msgs,
        "stream_bytes_per_token": round(stream_bytes / generated, 1) if generated else None,
        "stream_msgs_per_s": round(stream_msgs / span, 1) if span > 0 else None,
        "stream_peak_msgs_in_1s": peak_per_second(stream_times),
        "bytes_by_model": dict(by_model.most_common()),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--tokens", type=int, nargs="+", default=[250, 1000, 4000],
                        help="max_tokens of the cell's gen, one run each")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds one run may take before the bench gives up on it")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from sgl_nb.runtime.model.model_loader import cache_dir

    kernel = Kernel(env={"SGL_NB_CACHE": str(cache_dir())})
    rows = []
    try:
        setup = kernel.run(SETUP.format(model=args.model), timeout=600)
        if "ready" not in setup.stdout:
            print(f"the kernel could not load the model: {setup}")
            return 1
        for n in args.tokens:
            row = measure(kernel, n, args.timeout)
            rows.append(row)
            print(f"{n} tokens: {_line(row)}", flush=True)
    finally:
        kernel.close()
    print()
    head = ("tokens", "comm_msg bytes", "bytes/token", "comm_msg", "msg/s", "peak msg/1s",
            "stream bytes/token", "stream msg/s", "stream peak msg/1s", "seconds")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(str(x) for x in (
            r["generated"], r["comm_msg_bytes"], r["bytes_per_token"], r["comm_msg"],
            r["msgs_per_s"], r["peak_msgs_in_1s"], r["stream_bytes_per_token"],
            r["stream_msgs_per_s"], r["stream_peak_msgs_in_1s"], r["seconds"])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["status"] == "done" and r["generated"] == r["tokens"] for r in rows) else 1


def _line(r: dict) -> str:
    top = ", ".join(f"{n} {what}" for what, n in list(r["peak_by_widget"].items())[:3])
    return (f"{r['comm_msg_bytes']:,} comm_msg bytes ({r['bytes_per_token']} a token; stream "
            f"view {r['stream_bytes']:,}), {r['comm_msg']} comm_msg in {r['seconds']} s "
            f"({r['msgs_per_s']}/s, peak {r['peak_msgs_in_1s']} in 1 s: {top}), "
            f"{r['renders']} renders, {r['comm_open']} comm_open "
            f"({r['comm_open_bytes']:,} bytes)")
