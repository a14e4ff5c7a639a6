"""`sgl-nb bench tracing`: what tracing costs. The few-shot workload of `sgl-nb bench
programs` (a 5-shot prefix, one select per question) with tracing off, to an OTLP/JSON
file, and to a real receiver (a running Arize Phoenix over OTLP/HTTP, given by --phoenix
URL), in one process, rounds interleaved; the best round of each counts.

`make bench-tracing` starts Phoenix (from .venv-phoenix), passes its URL, and stops it
afterwards."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import urllib.request

from sgl_nb.bench import add_json_argument, add_model_argument
from sgl_nb.bench.programs import QUESTIONS, few_shot_program

TARGET_FILE_COST = 0.05  # file tracing may cost at most 5% of throughput


def _round(program, questions: list[str], rt, mode: str, dest: dict) -> dict:
    """One batch, tracing as `mode` says: questions per second of wall time, questions per
    CPU second of this process, and the share of that CPU time tracing itself spent (in
    the event callback and in the exporter). The CPU clocks also count the export that
    finishes in disable_tracing: all the work tracing adds, whenever it runs."""
    import sgl_nb as sgl
    from sgl_nb.tracing import session

    c0 = time.process_time()
    if mode == "file":
        sgl.enable_tracing(file=dest["file"], runtime=rt)
    elif mode == "receiver":
        sgl.enable_tracing(endpoint=dest["endpoint"], runtime=rt,
                           resource_attributes={"openinference.project.name": "sgl-nb-bench"})
    traced = session.current()
    if traced is not None:
        traced.recorder.measure = True
    t0 = time.perf_counter()
    states = program.run_batch([{"question": q} for q in questions])
    elapsed = time.perf_counter() - t0
    if traced is not None:
        sgl.disable_tracing()
    cpu = time.process_time() - c0
    assert all(s.error() is None for s in states)
    own = 0 if traced is None else \
        traced.recorder.cpu_ns + sum(g.cpu_ns for g in traced.guards)
    return {"qps": len(questions) / elapsed, "per_cpu": len(questions) / cpu,
            "tracing_cpu": own / 1e9 / cpu}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--questions", type=int, default=32, help="few-shot questions a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode")
    parser.add_argument("--phoenix", default=None, metavar="URL",
                        help="a running Phoenix (e.g. http://127.0.0.1:6006) to export to; "
                        "without it the receiver is not measured (make bench-tracing "
                        "starts one and passes its URL)")
    add_json_argument(parser)


def check_phoenix(url: str) -> str:
    """Phoenix's OTLP/HTTP traces endpoint, once its health check answers; else SystemExit,
    before any round runs."""
    url = url.rstrip("/")
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as r:
            r.read()
    except (OSError, ValueError) as e:
        raise SystemExit(f"--phoenix: no Phoenix answers at {url}/healthz ({e}); start one, "
                         "or run `make bench-tracing`") from None
    return f"{url}/v1/traces"


def run(args: argparse.Namespace) -> int:
    import sgl_nb as sgl

    endpoint = check_phoenix(args.phoenix) if args.phoenix else None

    questions = (QUESTIONS * (1 + args.questions // len(QUESTIONS)))[: args.questions]
    print("loading the engine ...", flush=True)
    rt = sgl.Runtime(args.model)
    sgl.set_default_backend(rt)  # the programs run on the runtime being traced
    program = few_shot_program()
    program.run_batch([{"question": q} for q in questions[:4]])  # warm up
    # The receiver runs in its own process and keeps working (ingesting) after each export:
    # the file rounds are measured before anything is sent to it, the receiver rounds
    # against "off" rounds taken after. Modes alternate, so drift hits both alike.
    phases, note = [("off", "file")], ""
    if endpoint:
        phases.append(("off, receiver up", "receiver"))
    else:
        note = ("receiver: not measured, no --phoenix URL (`make bench-tracing` starts "
                "Phoenix from .venv-phoenix and passes it); an OTLP receiver inside this "
                "process would share its CPU and is not a fair stand-in")
    tmp = tempfile.mkdtemp(prefix="sgl-nb-bench-tracing-")
    dest = {"file": os.path.join(tmp, "trace.jsonl"), "endpoint": endpoint}
    rounds: dict[str, list[dict]] = {m: [] for phase in phases for m in phase}
    try:
        for phase in phases:
            for r in range(args.rounds):
                for mode in phase:
                    got = _round(program, questions, rt, mode.split(",")[0], dest)
                    rounds[mode].append(got)
                    print(f"  round {r + 1} {mode:<17} {got['qps']:6.2f} questions/s, "
                          f"{got['per_cpu']:6.2f} per CPU second, tracing's own CPU "
                          f"{got['tracing_cpu']:6.2%}", flush=True)
    finally:
        rt.shutdown()
    size = os.path.getsize(dest["file"]) if os.path.exists(dest["file"]) else 0
    best = {m: {"qps": max(r["qps"] for r in rs), "per_cpu": max(r["per_cpu"] for r in rs),
                "tracing_cpu": statistics.median(r["tracing_cpu"] for r in rs)}
            for m, rs in rounds.items()}
    for base, mode in phases:
        best[mode]["paired"] = statistics.median(
            t["qps"] / o["qps"] for t, o in zip(rounds[mode], rounds[base]))
        best[mode]["base"] = base
    _print_table(args, best, size, note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"best": best, "rounds": rounds, "trace_file_bytes": size}, f, indent=2)
    return 0


def _print_table(args, best: dict[str, dict], size: int, note: str) -> None:
    print(f"\nfew-shot: 5-shot prefix, {args.questions} questions, select; best of "
          f"{args.rounds} rounds; 'paired': median over rounds of traced / the off round "
          "next to it; tracing's own CPU: the median")
    print(f"{'tracing':<20}{'questions/s':>12}{'best vs off':>12}{'paired':>9}{'q/CPU s':>10}"
          f"{'tracing CPU':>13}")
    for mode, b in best.items():
        base = best[b.get("base", mode)]
        paired = f"{b['paired']:>8.3f}x" if "paired" in b else f"{'':>9}"
        print(f"{mode:<20}{b['qps']:>12.2f}{b['qps'] / base['qps']:>11.3f}x{paired}"
              f"{b['per_cpu']:>10.2f}{b['tracing_cpu']:>13.2%}")
    # On a shared machine throughput swings by tens of percent from round to round; the
    # paired median and the CPU time tracing itself spends (the event callback on the
    # engine's and programs' threads, encoding and writing in the export thread) are the
    # steadier measures, and both must be within the target.
    f = best["file"]
    cost = max(f["tracing_cpu"], 1 - f["paired"])
    verdict = "met" if cost <= TARGET_FILE_COST else "NOT met"
    print(f"target: file tracing costs <= {TARGET_FILE_COST:.0%} of throughput: {verdict} "
          f"(paired ratio {f['paired']:.3f}x, tracing's own CPU {f['tracing_cpu']:.2%}); "
          f"trace file {size / 1e3:.0f} kB over {args.rounds} rounds")
    if note:
        print(note)
