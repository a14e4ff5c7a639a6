"""`sgl-nb bench ahead`: decode ahead (EngineConfig.decode_ahead) against a step a token.

One process, one Runtime; each round runs every decode_ahead value over two workloads,
the order turning round by round: one stream, streamed as a notebook shows it (the engine
bench's prompt and figure, greedy, EOS ignored), and a batch of greedy requests sharing a
prefix (the engine bench's). tok/s is generated tokens over wall time, prefill included;
each value keeps its best round and its median. The output must be the same for every
value (the stream's text, the batch's tokens): the bench fails if not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from sgl_nb.bench import add_json_argument, add_model_argument

WORKLOADS = ("one stream", "batch")


def one_pass(rt, ids: list[int], prompts: list[list[int]], args) -> dict:
    """tok/s and tokens of each workload at the Runtime's current settings."""
    out = {}
    t0 = time.perf_counter()
    text = "".join(rt.generate(ids, max_tokens=args.new_tokens, ignore_eos=True, stream=True,
                               prompt_lookup=False))
    out["one stream"] = (args.new_tokens / (time.perf_counter() - t0), [text])
    rt.flush_cache()  # every pass prefills the shared prefix once, as the first did
    t0 = time.perf_counter()
    batch = rt.generate(prompts, max_tokens=args.batch_tokens, ignore_eos=True,
                        prompt_lookup=False)
    tokens = [o.token_ids for o in batch]
    out["batch"] = (sum(map(len, tokens)) / (time.perf_counter() - t0), tokens)
    return out


def summary(passes: dict[int, list[dict]], values: list[int]) -> dict:
    rows = {}
    for v in values:
        for w in WORKLOADS:
            rates = [p[w][0] for p in passes[v]]
            rows[f"{w}, decode_ahead={v}"] = {"best": max(rates),
                                              "median": statistics.median(rates)}
    base = values[0]
    ratios = {f"{w}, {v} / {base}": {
        k: rows[f"{w}, decode_ahead={v}"][k] / rows[f"{w}, decode_ahead={base}"][k]
        for k in ("best", "median")} for v in values[1:] for w in WORKLOADS}
    same = all(p[w][1] == passes[base][0][w][1] for v in values for p in passes[v]
               for w in WORKLOADS)
    return {"tok_s": rows, "ratios": ratios, "same_tokens": same}


def print_summary(s: dict) -> None:
    print(f"\n{'side':<36}{'best tok/s':>12}{'median':>10}")
    for side, r in s["tok_s"].items():
        print(f"{side:<36}{r['best']:>12.1f}{r['median']:>10.1f}")
    for name, r in s["ratios"].items():
        print(f"ratio {name:<30}{r['best']:>11.2f}x{r['median']:>9.2f}x")
    print(f"greedy tokens the same for every value: {'yes' if s['same_tokens'] else 'NO'}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--quantization", default="int4", help="int4, int8 or none")
    parser.add_argument("--values", type=int, nargs="+", default=None,
                        help="decode_ahead values, the first the baseline (default: 1 and "
                        "the engine's default)")
    parser.add_argument("--new-tokens", type=int, default=256, help="one-stream tokens")
    parser.add_argument("--requests", type=int, default=8, help="requests in the batch")
    parser.add_argument("--prefix-tokens", type=int, default=400)
    parser.add_argument("--batch-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--repeat", type=int, default=4)
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    for name in ("new_tokens", "requests", "batch_tokens", "repeat"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    from sgl_nb import Runtime
    from sgl_nb.runtime.engine_config import EngineConfig

    args.values = args.values or [1, EngineConfig.decode_ahead]
    if min(args.values) < 1:
        raise SystemExit("--values must be at least 1")
    from sgl_nb.bench.engine import workload

    _, ids, prompts = workload(args)
    rt = Runtime(args.model, quantization=None if args.quantization == "none"
                 else args.quantization)
    try:
        rt.generate(ids, max_tokens=8)  # builds the kernels; not timed
        passes: dict[int, list[dict]] = {v: [] for v in args.values}
        for round_no in range(args.repeat):
            order = args.values if round_no % 2 == 0 else args.values[::-1]
            for v in order:
                rt.engine.settings = dataclasses.replace(rt.engine.settings, decode_ahead=v)
                passes[v].append(one_pass(rt, ids, prompts[: args.requests], args))
                print(f"round {round_no + 1}/{args.repeat}, decode_ahead={v}: " + ", ".join(
                    f"{w} {passes[v][-1][w][0]:.1f} tok/s" for w in WORKLOADS), flush=True)
    finally:
        rt.shutdown()
    s = summary(passes, args.values)
    print_summary(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=2)
    return 0 if s["same_tokens"] else 1
