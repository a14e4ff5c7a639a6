"""`sgl-nb bench serve`: `sgl-nb serve` under load loses nothing.

The bench starts `sgl-nb serve` in a child process (so its resident memory is its own),
asks a greedy completion and chat answer, then runs a bounded load: --clients concurrent
streaming clients for --duration seconds, chat and completions of mixed prompt and output
lengths, a --disconnect-fraction of which close the connection after a few chunks. After
it the bench waits for the engine to go idle and checks, against the state before the load:
every request is counted once in /metrics by finish reason (a hang-up as abort, the others
as their clients saw them), nothing is left running, the server still answers, the greedy
answers are the same text and token ids, and the RSS grew by at most --rss-growth-mb after
the warm-up (--warmup seconds of the load). It prints the client-side throughput, time to
first token and inter-token latency, and exits 1 if a check fails.

With --vllm-bench VENV it runs `vllm bench serve` from that venv instead, against
`sgl-nb serve` and against --vllm-server (a vLLM-CPU server on the same model), in turns.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from sgl_nb.bench import add_json_argument, add_model_argument
from sgl_nb.bench.serve_checks import (
    Check,
    accounting,
    greedy_answers,
    greedy_unchanged,
    rss_stable,
    scrape,
    still_answers,
    wait_idle,
)
from sgl_nb.bench.serve_load import Outcome, Plan, run_load
from sgl_nb.bench.serve_process import ServerProcess


def load_checks(base_url: str, plan: Plan, rss: Callable[[], float | None] | None = None,
                warmup_s: float = 0.0, rss_limit_mb: float | None = None,
                idle_timeout_s: float = 300.0) -> dict:
    """Run `plan` against the server at `base_url` and check it. `rss()` (the server's RSS
    in MB, or None) is sampled about once a second when given. {"outcomes", "seconds",
    "checks", "metrics_before", "metrics_after" (the scrapes around the load), "rss_mb"}."""
    read_rss = rss or (lambda: None)
    greedy_before = greedy_answers(base_url, plan.model)
    rss_before = read_rss()
    before = scrape(base_url)
    samples: list[tuple[float, float]] = []  # (seconds into the load, MB)

    def sample(t: float) -> None:
        if (mb := read_rss()) is not None:
            samples.append((t, mb))

    outcomes, seconds = run_load(base_url, plan, sample if rss else None)
    after = wait_idle(base_url, before, len(outcomes), idle_timeout_s)
    sample(seconds)  # once idle: the RSS after the load
    checks = accounting(outcomes, before, after)
    checks.append(still_answers(base_url))
    checks.append(greedy_unchanged(greedy_before, greedy_answers(base_url, plan.model)))
    if rss_limit_mb is not None:
        checks.append(rss_stable(samples, warmup_s, rss_limit_mb))
    rss_mb = {"before_load": rss_before,
              "after_warmup": next((mb for t, mb in samples if t >= warmup_s), None),
              "after_load": samples[-1][1] if samples else None,
              "peak": max((mb for _, mb in samples), default=None)}
    return {"outcomes": outcomes, "seconds": seconds, "checks": checks,
            "metrics_before": before, "metrics_after": after, "rss_mb": rss_mb}


def client_figures(outcomes: list[Outcome], seconds: float) -> dict:
    """Throughput and latency as the clients saw them (all requests, hung up or not)."""
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    itl = [x for o in outcomes for x in o.itl_s]
    # A read stream's usage counts its tokens; a hung-up one's text chunks stand in.
    tokens = sum(o.completion_tokens if o.completion_tokens is not None else o.chunks
                 for o in outcomes)
    return {"requests": len(outcomes), "hung_up": sum(o.hung_up for o in outcomes),
            "seconds": seconds, "requests_per_s": len(outcomes) / seconds,
            "output_tokens": tokens, "output_tok_per_s": tokens / seconds,
            "ttft_ms": _percentiles(ttft), "itl_ms": _percentiles(itl)}


def _percentiles(seconds: list[float]) -> dict:
    if not seconds:
        return {}
    ms = np.asarray(seconds) * 1000
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def print_report(plan: Plan, figures: dict, rss_mb: dict, checks: list[Check]) -> None:
    f = figures
    print(f"\n{f['requests']} requests from {plan.clients} clients in {f['seconds']:.1f} s "
          f"({f['hung_up']} hung up mid-stream): {f['requests_per_s']:.2f} requests/s, "
          f"{f['output_tok_per_s']:.1f} output tok/s ({f['output_tokens']} tokens)")
    print(f"{'ms, client side':<22}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}")
    for key, label in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token")):
        row = f[key]
        print(f"{label:<22}" + "".join(f"{row.get(p, float('nan')):>9.1f}"
                                       for p in ("mean", "p50", "p90", "p99")))
    print("server RSS (MB): " + ", ".join(
        f"{k.replace('_', ' ')} {'-' if v is None else f'{v:.0f}'}" for k, v in rss_mb.items()))
    print()
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=180.0,
                        help="seconds during which clients start new requests")
    parser.add_argument("--disconnect-fraction", type=float, default=1 / 3,
                        help="requests whose client closes the connection mid-stream")
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="seconds of the load before the RSS baseline is taken")
    parser.add_argument("--rss-growth-mb", type=float, default=64.0,
                        help="the most the server's RSS may grow after the warm-up")
    parser.add_argument("--seed", type=int, default=0, help="draws the requests")
    parser.add_argument("--kv-pool-tokens", type=int, default=None,
                        help="the server's KV pool (default: sgl-nb serve's)")
    parser.add_argument("--vllm-bench", default=None, metavar="VENV",
                        help="instead of the load: run `vllm bench serve` from this venv "
                        "against sgl-nb serve and --vllm-server, in turns")
    parser.add_argument("--vllm-server", default=None, metavar="URL",
                        help="a vLLM server on the same model, for --vllm-bench (python -m "
                        "support.with_server vllm starts one)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="--vllm-bench: turns on each server")
    parser.add_argument("--input-len", type=int, default=256, help="--vllm-bench: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="--vllm-bench: new tokens")
    parser.add_argument("--num-prompts", type=int, default=64, help="--vllm-bench: requests")
    parser.add_argument("--max-concurrency", type=int, default=8,
                        help="--vllm-bench: requests in flight")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.vllm_bench:
        from sgl_nb.bench.serve_vllm import run_comparison

        return run_comparison(args)
    plan = Plan(clients=args.clients, duration_s=args.duration,
                disconnect_fraction=args.disconnect_fraction, seed=args.seed)
    print("starting sgl-nb serve ...", flush=True)
    with ServerProcess(args.model, args.kv_pool_tokens) as server:
        print(f"serving on {server.url}; {args.clients} clients for {args.duration:g} s ...",
              flush=True)
        out = load_checks(server.url, plan, server.rss_mb, args.warmup, args.rss_growth_mb)
    figures = client_figures(out["outcomes"], out["seconds"])
    print_report(plan, figures, out["rss_mb"], out["checks"])
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"plan": asdict(plan), "client": figures, "rss_mb": out["rss_mb"],
             "checks": [asdict(c) for c in out["checks"]]}, indent=2))
    return 0 if all(c.ok for c in out["checks"]) else 1
