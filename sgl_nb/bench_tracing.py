"""`sgl-nb bench tracing`: what tracing costs. The few-shot workload of `sgl-nb bench
programs` (a 5-shot prefix, one select per question) with tracing off, to an OTLP/JSON
file, and to a real receiver (Arize Phoenix over OTLP/HTTP, when `make phoenix` installed
it), in one process, rounds interleaved; the best round of each counts."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from sgl_nb.bench_programs import QUESTIONS, few_shot_prefix
from sgl_nb.phoenix_server import PhoenixServer

TARGET_FILE_COST = 0.05  # file tracing may cost at most 5% of throughput


def _program():
    import sgl_nb as sgl

    @sgl.function
    def few_shot(s, question):
        s += few_shot_prefix() + f"Question: {question}\nAnswer:"
        s += sgl.select("answer", [" yes", " no"])

    return few_shot


def _round(program, questions: list[str], rt, mode: str, dest: dict) -> float:
    """Questions per second of one batch, tracing as `mode` says."""
    import sgl_nb as sgl

    if mode == "file":
        sgl.enable_tracing(file=dest["file"], runtime=rt)
    elif mode == "receiver":
        sgl.enable_tracing(endpoint=dest["endpoint"], runtime=rt,
                           resource_attributes={"openinference.project.name": "sgl-nb-bench"})
    t0 = time.perf_counter()
    states = program.run_batch([{"question": q} for q in questions])
    elapsed = time.perf_counter() - t0
    if mode != "off":
        sgl.disable_tracing()  # the export finishes here, after the clock stopped: the
        # cost that counts is what tracing takes from the running programs
    assert all(s.error() is None for s in states)
    return len(questions) / elapsed


def run_tracing_bench(args: argparse.Namespace) -> int:
    from sgl_nb import Runtime

    questions = (QUESTIONS * (1 + args.questions // len(QUESTIONS)))[: args.questions]
    print("loading the engine ...", flush=True)
    import sgl_nb as sgl

    rt = Runtime(args.model)
    sgl.set_default_backend(rt)  # the programs run on the runtime being traced
    program = _program()
    program.run_batch([{"question": q} for q in questions[:4]])  # warm up
    px = PhoenixServer()
    modes, note = ["off", "file"], ""
    if px.available:
        print("starting Phoenix (the receiver) ...", flush=True)
        px.start()
        modes.append("receiver")
    else:
        note = (f"receiver: not measured, Phoenix is not installed at {px.exe} (run `make "
                "phoenix`); an OTLP receiver inside this process would share its CPU and "
                "is not a fair stand-in")
    tmp = tempfile.mkdtemp(prefix="sgl-nb-bench-tracing-")
    dest = {"file": os.path.join(tmp, "trace.jsonl"), "endpoint": px.traces_url}
    best: dict[str, float] = {}
    try:
        for r in range(args.rounds):
            for mode in modes:
                qps = _round(program, questions, rt, mode, dest)
                best[mode] = max(best.get(mode, 0.0), qps)
                print(f"  round {r + 1} {mode:<9} {qps:7.2f} questions/s", flush=True)
    finally:
        px.stop()
        rt.shutdown()
    size = os.path.getsize(dest["file"]) if os.path.exists(dest["file"]) else 0
    _print_table(args, best, size, note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"questions_per_s": best, "trace_file_bytes": size}, f, indent=2)
    return 0


def _print_table(args, best: dict[str, float], size: int, note: str) -> None:
    names = {"off": "tracing off", "file": "OTLP/JSON file",
             "receiver": "OTLP/HTTP to Phoenix"}
    print(f"\nfew-shot: 5-shot prefix, {args.questions} questions, select; best of "
          f"{args.rounds} rounds")
    print(f"{'tracing':<24}{'questions/s':>12}{'vs off':>9}{'cost':>8}")
    for mode, qps in best.items():
        ratio = qps / best["off"]
        print(f"{names[mode]:<24}{qps:>12.2f}{ratio:>8.3f}x{1 - ratio:>8.1%}")
    cost = 1 - best["file"] / best["off"]
    verdict = "met" if cost <= TARGET_FILE_COST else "NOT met"
    print(f"target: file tracing costs <= {TARGET_FILE_COST:.0%} of throughput: {verdict} "
          f"({cost:.1%}); trace file {size / 1e3:.0f} kB over {args.rounds} rounds")
    if note:
        print(note)
