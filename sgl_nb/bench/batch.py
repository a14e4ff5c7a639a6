"""`sgl-nb bench batch`: `run_batch` of many programs. Live threads and resident memory are
sampled during the run; time per program is compared with the same program run one at a
time, in the same process."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import sgl_nb as sgl
from sgl_nb.bench import add_json_argument, add_model_argument


@sgl.function
def item(s, i):
    s += "You label short notes with one word. " * 4
    s += f"Note {i}: the parcel arrived on time.\nLabel:" + sgl.gen("label", max_tokens=2)


def _rss_mb() -> float:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    import resource

    return pages * resource.getpagesize() / 2**20


class _Sampler:
    """Peak live threads and peak RSS, every few milliseconds, on a thread of its own."""

    def __init__(self) -> None:
        self.threads, self.rss_mb = 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.threads = max(self.threads, threading.active_count() - 1)  # not ourselves
            self.rss_mb = max(self.rss_mb, _rss_mb())
            time.sleep(0.005)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _batch_row(rt: sgl.Runtime, n: int, threads, before: int) -> dict:
    t0 = time.perf_counter()
    with _Sampler() as s:
        states = item.run_batch([{"i": i} for i in range(n)], num_threads=threads, backend=rt)
    seconds = time.perf_counter() - t0
    failed = sum(st.error() is not None for st in states)
    return {"case": f"run_batch of {n}, num_threads={threads}", "seconds": seconds,
            "per_program_ms": 1000 * seconds / n, "peak_threads": s.threads,
            "threads_before": before, "peak_rss_mb": round(s.rss_mb), "failed": failed}


def run(args: argparse.Namespace) -> int:
    rt = sgl.Runtime(args.model)
    item.run(i=-1, backend=rt)  # warm-up: kernels built, the prefix cached ...
    item.run_batch([{"i": -i} for i in range(1, 65)], backend=rt)  # ... and wide batches' shapes
    rows = []
    rt.flush_cache()
    t0 = time.perf_counter()
    for i in range(args.baseline_items):
        item.run(i=i, backend=rt)
    seconds = time.perf_counter() - t0
    rows.append({"case": f"run() one at a time, {args.baseline_items}", "seconds": seconds,
                 "per_program_ms": 1000 * seconds / args.baseline_items,
                 "peak_threads": None, "peak_rss_mb": round(_rss_mb())})
    for threads in ("auto", args.num_threads):
        rt.flush_cache()  # each run computes its prompts (they are the same each run)
        rows.append(_batch_row(rt, args.programs, threads, threading.active_count()))
    base = rows[0]["per_program_ms"]
    for r in rows:
        r["speedup"] = base / r["per_program_ms"]
        print(f"{r['case']:<38} {r['per_program_ms']:7.1f} ms/program  {r['speedup']:5.2f}x  "
              f"peak threads {r['peak_threads']}  peak RSS {r['peak_rss_mb']} MB"
              + (f"  FAILED {r['failed']}" if r.get("failed") else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    rt.shutdown()
    return 1 if any(r.get("failed") for r in rows) else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--programs", type=int, default=1000, help="programs per run_batch")
    parser.add_argument("--num-threads", type=int, default=8,
                        help="the second run's body pool (the first is 'auto')")
    parser.add_argument("--baseline-items", type=int, default=50,
                        help="programs run one at a time, for the per-program baseline")
    add_json_argument(parser)
