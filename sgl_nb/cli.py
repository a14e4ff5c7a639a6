"""`sgl-nb`: the command line (model set-up, a terminal demo, benchmarks)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

DEMO_QUESTION = "What is a radix tree, and why does it help an LLM server? Answer briefly."


def cmd_model(args: argparse.Namespace) -> int:
    from sgl_nb.kernels import cpu_decode
    from sgl_nb.runtime.model.model_loader import resolve_model_path

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


def cmd_diff(args: argparse.Namespace) -> int:
    """Exit 0 when the runs are the same, 1 when they differ (like diff(1)), 2 on bad input."""
    from pathlib import Path

    from sgl_nb.language.diff import diff
    from sgl_nb.tracing import TraceFormatError

    sides = [(a, p) if p is not None else a for a, p in
             ((args.a, args.program_a), (args.b, args.program_b))]
    try:
        d = diff(*sides, names=(Path(args.a).name, Path(args.b).name))
    except (OSError, TraceFormatError, ValueError, KeyError) as e:
        print(f"sgl-nb diff: {e}", file=sys.stderr)
        return 2
    if args.text or not sys.stdout.isatty():
        print(d)
    else:
        from sgl_nb.tui.diff_app import DiffApp

        DiffApp(d).run()
    return 1 if d else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from sgl_nb.server.serve import cmd_serve as serve

    return serve(args)


class BenchParser(argparse.ArgumentParser):
    """A bench's own parser. Its flags come from its module, imported only when this bench
    is the one run (bench modules import torch: `sgl-nb serve` refusing a bind, or
    `sgl-nb --help`, need not wait for it). A flag it does not know is its error, shown
    with its usage (as a subparser's, it would reach the top parser as sgl-nb's)."""

    def __init__(self, *args, module: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.module = module
        self.loaded = False

    def parse_known_args(self, args=None, namespace=None):
        if not self.loaded:
            module = importlib.import_module(self.module)
            self.description = module.__doc__
            module.add_arguments(self)
            self.set_defaults(func=module.run)
            self.loaded = True
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace, extra


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """`sgl-nb bench NAME [flags]`: one subcommand per module of sgl_nb.bench, with its flags."""
    from sgl_nb.bench import BENCHES

    b = sub.add_parser("bench", help="benchmarks against a baseline measured in the same run",
                       description="Benchmarks against a baseline measured in the same run. "
                       "`sgl-nb bench NAME --help` lists a bench's flags.")
    benches = b.add_subparsers(dest="bench", required=True, metavar="NAME",
                               parser_class=BenchParser)
    for name, summary in BENCHES.items():
        benches.add_parser(name, help=summary, module=f"sgl_nb.bench.{name}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv: list[str] | None = None) -> int:
    from sgl_nb.server.serve import GRACE_SECONDS

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

    add_bench_parsers(sub)

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
    v.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names requests may give, the first one reported "
                   "(default: the model folder's name)")
    v.add_argument("--clip-max-tokens", action="store_true",
                   help="lower a max_tokens that passes the context to what fits, instead "
                   "of answering 400")
    v.add_argument("--kv-pool-tokens", type=int, default=32768)
    v.add_argument("--quiet", action="store_true", help="no line per request")
    v.add_argument("--shutdown-grace", type=float, default=GRACE_SECONDS, metavar="S",
                   help="on Ctrl-C or SIGTERM, seconds running requests get before they are "
                   "aborted, each answered with its text so far (default %(default)g)")
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

    f = sub.add_parser("diff", help="compare two runs recorded as traces: the first Node and "
                       "token where they part (exit 0: the same, 1: they differ, 2: bad input)")
    f.add_argument("a", metavar="A.jsonl")
    f.add_argument("b", metavar="B.jsonl")
    f.add_argument("--program-a", type=int, default=None, metavar="ID",
                   help="the program of A to compare, when it holds several")
    f.add_argument("--program-b", type=int, default=None, metavar="ID")
    f.add_argument("--text", action="store_true", help="print the report, even on a terminal")
    f.set_defaults(func=cmd_diff)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
