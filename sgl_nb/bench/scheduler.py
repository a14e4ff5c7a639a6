"""`sgl-nb bench scheduler`: what preemption buys an interactive request under batch load,
and what a small KV pool costs in throughput. Everything runs in one process, one run."""

from __future__ import annotations

import argparse
import json
import time

from sgl_nb.backends.local_runtime import Runtime
from sgl_nb.bench import add_json_argument, add_model_argument

BATCH_TOPICS = ("cat", "dog", "ship", "tree", "robot", "river", "castle", "violin",
                "garden", "train", "lamp", "storm")
INTERACTIVE_PROMPT = "In one sentence, why is the sky blue?"


def _interactive(rt: Runtime, n: int) -> tuple[float, float]:
    """(time to first token, total latency) of one interactive request, in seconds."""
    t0 = time.perf_counter()
    ttft = None
    for _ in rt.generate(INTERACTIVE_PROMPT, max_tokens=n, ignore_eos=True, stream=True,
                         priority="interactive"):
        if ttft is None:
            ttft = time.perf_counter() - t0
    return ttft or 0.0, time.perf_counter() - t0


def _under_load(rt: Runtime, args: argparse.Namespace) -> tuple[float, float, dict]:
    jobs = [rt.submit(f"Write a long story about a {BATCH_TOPICS[i % len(BATCH_TOPICS)]}.",
                      max_tokens=args.batch_tokens, ignore_eos=True, priority="batch")
            for i in range(args.batch_jobs)]
    while rt.metrics()["running"] < args.batch_jobs or rt.metrics()["steps"]["decode"] < 4:
        time.sleep(0.01)  # the batch decodes at full width before the interactive arrives
    ttft, total = _interactive(rt, args.interactive_tokens)
    for h in jobs:
        h.result()
    return ttft, total, rt.metrics()


def latency_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    with Runtime(args.model, time_slice=args.time_slice) as rt:
        _interactive(rt, 4)  # warm-up
        ttft, total = _interactive(rt, args.interactive_tokens)
        rows.append({"case": "interactive alone", "ttft_s": ttft, "latency_s": total})
        ttft, total, m = _under_load(rt, args)
        rows.append({"case": f"+ {args.batch_jobs} batch jobs, preemption on", "ttft_s": ttft,
                     "latency_s": total, "preemptions": m["preemptions"]})
    with Runtime(args.model, time_slice=args.time_slice, preemption=False) as rt:
        _interactive(rt, 4)
        ttft, total, m = _under_load(rt, args)
        rows.append({"case": f"+ {args.batch_jobs} batch jobs, preemption off", "ttft_s": ttft,
                     "latency_s": total, "preemptions": m["preemptions"]})
    alone = rows[0]["latency_s"]
    for r in rows:
        r["vs_alone"] = r["latency_s"] / alone
    return rows


GUIDE = ("You are a careful assistant. Answer in plain words, in two or three sentences, "
         "and keep to facts a child could check. ") * 4


def throughput_rows(args: argparse.Namespace) -> list[dict]:
    """32 programs that share an instruction prefix (as programs built from one template
    do). "Need" counts every program's prompt and new tokens as if nothing were shared;
    the radix cache is what lets a smaller pool keep up."""
    import sgl_nb as sgl

    @sgl.function
    def describe(s, thing):
        s += GUIDE + f"Describe a {thing}.\nAnswer:"
        s += sgl.gen("answer", max_tokens=args.program_tokens, ignore_eos=True)

    items = [{"thing": f"{BATCH_TOPICS[i % len(BATCH_TOPICS)]} number {i}"}
             for i in range(args.programs)]
    rows = []
    with Runtime(args.model, kv_pool_tokens=1024) as probe:
        tok = probe.tokenizer
        lens = [len(tok.encode(GUIDE + f"Describe a {kw['thing']}.\nAnswer:")) for kw in items]
        shared = len(tok.encode(GUIDE)) - 1
    need = sum(lens) + args.program_tokens * len(items)
    distinct = need - shared * (len(items) - 1)
    for frac in (1.0, 0.5, 0.25):
        with Runtime(args.model, kv_pool_tokens=int(need * frac)) as rt:
            rt.generate("warm-up", max_tokens=2)
            t0 = time.perf_counter()
            states = describe.run_batch(items, backend=rt)
            dt = time.perf_counter() - t0
            m = rt.metrics()
        tokens = sum(st.get_meta_info("answer")["completion_tokens"] for st in states)
        rows.append({"pool": f"{frac:.0%} of need ({int(need * frac)} tokens)",
                     "tok_per_s": tokens / dt, "seconds": dt, "retractions": m["retractions"],
                     "need": need, "need_with_sharing": distinct})
    for r in rows:
        r["vs_full"] = r["tok_per_s"] / rows[0]["tok_per_s"]
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--batch-jobs", type=int, default=8, help="long batch jobs")
    parser.add_argument("--batch-tokens", type=int, default=128, help="tokens per batch job")
    parser.add_argument("--interactive-tokens", type=int, default=32,
                        help="tokens of the interactive request")
    parser.add_argument("--time-slice", type=int, default=8, help="decode steps")
    parser.add_argument("--programs", type=int, default=32, help="throughput programs")
    parser.add_argument("--program-tokens", type=int, default=64,
                        help="tokens per throughput program")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    print(f"interactive request ({args.interactive_tokens} tokens) alone and under "
          f"{args.batch_jobs} batch jobs of {args.batch_tokens} tokens, time slice "
          f"{args.time_slice} ...", flush=True)
    lat = latency_rows(args)
    print(f"{'case':<36} {'ttft s':>8} {'latency s':>10} {'x alone':>8}")
    for r in lat:
        print(f"{r['case']:<36} {r['ttft_s']:>8.2f} {r['latency_s']:>10.2f} "
              f"{r['vs_alone']:>7.2f}x")
    print(f"target: under load with preemption <= 1.5x alone "
          f"({'met' if lat[1]['vs_alone'] <= 1.5 else 'NOT met'})\n", flush=True)
    print(f"{args.programs} programs x {args.program_tokens} tokens, KV pool at 100/50/25% of "
          "their need ...", flush=True)
    thr = throughput_rows(args)
    print(f"need: {thr[0]['need']} tokens counted per program; {thr[0]['need_with_sharing']} "
          "with their common prefix counted once")
    print(f"{'pool':<32} {'tok/s':>8} {'s':>8} {'retractions':>12} {'x 100%':>8}")
    for r in thr:
        print(f"{r['pool']:<32} {r['tok_per_s']:>8.1f} {r['seconds']:>8.1f} "
              f"{r['retractions']:>12} {r['vs_full']:>7.2f}x")
    print(f"target: at 25% >= 0.5x of 100% ({'met' if thr[2]['vs_full'] >= 0.5 else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"latency": lat, "throughput": thr}, f, indent=2)
    return 0
