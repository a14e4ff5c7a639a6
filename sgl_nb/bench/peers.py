"""`sgl-nb bench peers`: our engine against llama.cpp on the same GGUF files, one stream.

Each row is one GGUF file of the default model (sgl_nb/bench/peers_gguf.py: the shipped
Q4_1, and Q4_0, Q8_0 and F32 written from it), loaded by both engines:
- ours: int4 on a Q4_0 / Q4_1 file, int8 on Q8_0 (the file's own blocks), fp32 on F32;
- llama.cpp (llama-cpp-python, in its own venv: `make llamacpp`) in a child process
  (sgl_nb/bench/peers_llamacpp.py), everything loaded once.

Same prompt (the engine bench's, in the chat template), N new tokens (EOS ignored),
greedy, the same thread count. Each round runs every row on both engines, the two taking
turns; per row and engine the fastest round is kept (noise only slows a run), and the
ratio is also given as the median over rounds of the two measured seconds apart. Speeds
are decode tok/s (first token to last: prefill left out) and end-to-end tok/s. It also
counts the leading greedy tokens the two engines agree on.

On a busy machine set OMP_WAIT_POLICY=PASSIVE (the child inherits it): llama.cpp's OpenMP
threads otherwise spin-wait for each other and its speed collapses (measured: 1.4-5 tok/s
against 25-54 with it, same load).

`--copy` adds the copy workload (sgl_nb/bench/copy_workload.py) on the Q4_1 row: prompt
lookup on and off on both engines (llama.cpp's LlamaPromptLookupDecoding).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from sgl_nb.bench import add_json_argument, add_llamacpp_venv_argument
from sgl_nb.bench.engine import STREAM_PROMPT
from sgl_nb.bench.llamacpp_process import LlamaCpp, venv_python

# GGUF type -> (our dtype, our quantization)
ROWS = {
    "Q4_0": (None, "int4"),
    "Q4_1": (None, "int4"),
    "Q8_0": (None, "int8"),
    "F32": ("float32", None),
}
def ours_stream(rt, ids: list[int], n: int) -> dict:
    """One stream on our engine, figures in the child's shape; prompt lookup off, as
    llama.cpp's one stream has none (--copy compares the two with it)."""
    rt.flush_cache()
    out = rt.generate(ids, max_tokens=n, ignore_eos=True, prompt_lookup=False)
    seconds, ttft = out.meta["e2e_latency"], out.meta["ttft"]
    return {"tokens": list(out.token_ids), "seconds": seconds, "decode_seconds": seconds - ttft}


def rates(run: dict) -> tuple[float, float]:
    """(decode tok/s, end-to-end tok/s) of one stream."""
    n = len(run["tokens"])
    return (n - 1) / run["decode_seconds"], n / run["seconds"]


def agreeing(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def load_ours(qtypes: list[str], files: dict[str, Path]) -> dict:
    from sgl_nb import Runtime

    runtimes = {}
    for qtype in qtypes:
        dtype, quantization = ROWS[qtype]
        print(f"ours: loading {files[qtype].name} as {quantization or dtype} ...", flush=True)
        runtimes[qtype] = Runtime(str(files[qtype]), dtype=dtype, quantization=quantization,
                                  kv_pool_tokens=8192)
    return runtimes


def prompt_ids() -> list[int]:
    from transformers import AutoTokenizer

    from sgl_nb.runtime.model.model_loader import resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path()))
    return tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": STREAM_PROMPT}], tokenize=False, add_generation_prompt=True))


def stream_rounds(args, runtimes: dict, llama: LlamaCpp, files: dict, ids: list[int]) -> dict:
    """Per row: every round's run of each engine."""
    runs = {q: {"ours": [], "llama.cpp": []} for q in runtimes}
    threads = torch.get_num_threads()
    for round_no in range(1, args.repeat + 1):
        print(f"round {round_no}/{args.repeat}", flush=True)
        for qtype, rt in runtimes.items():
            request = {"model": str(files[qtype]), "ids": ids, "n": args.new_tokens,
                       "threads": threads}
            order = ["ours", "llama.cpp"] if round_no % 2 else ["llama.cpp", "ours"]
            for side in order:
                run = (ours_stream(rt, ids, args.new_tokens) if side == "ours"
                       else llama.ask(request))
                runs[qtype][side].append(run)
            ours_d, llama_d = (rates(runs[qtype][s][-1])[0] for s in ("ours", "llama.cpp"))
            print(f"  {qtype}: ours {ours_d:.1f}, llama.cpp {llama_d:.1f} decode tok/s",
                  flush=True)
    return runs


def stream_rows(runs: dict) -> dict:
    rows = {}
    for qtype, sides in runs.items():
        best = {s: max(rates(r)[0] for r in rs) for s, rs in sides.items()}
        best_e2e = {s: max(rates(r)[1] for r in rs) for s, rs in sides.items()}
        dtype, quantization = ROWS[qtype]
        rows[qtype] = {
            "ours_mode": quantization or "fp32",
            "ours_decode_tok_s": best["ours"], "llama_decode_tok_s": best["llama.cpp"],
            "ratio_best": best["ours"] / best["llama.cpp"],
            "ratio_median": statistics.median(
                rates(o)[0] / rates(ll)[0] for o, ll in zip(sides["ours"], sides["llama.cpp"])),
            "ours_e2e_tok_s": best_e2e["ours"], "llama_e2e_tok_s": best_e2e["llama.cpp"],
            "tokens_agreeing": agreeing(sides["ours"][0]["tokens"],
                                        sides["llama.cpp"][0]["tokens"]),
            "new_tokens": len(sides["ours"][0]["tokens"]),
        }
    return rows


def copy_rounds(args, rt, llama: LlamaCpp, gguf: Path) -> dict:
    """The copy workload on one file: lookup on and off on both engines, whole-workload
    tok/s, each side's fastest round; the greedy outputs on vs off compared per engine."""
    from transformers import AutoTokenizer

    from sgl_nb.bench.copy_workload import copy_requests
    from sgl_nb.runtime.model.model_loader import resolve_model_path

    requests = copy_requests(AutoTokenizer.from_pretrained(str(resolve_model_path())))
    threads = torch.get_num_threads()

    def ours(lookup: bool) -> dict:
        runs = []
        for r in requests:
            rt.flush_cache()
            out = rt.generate(r.ids, max_tokens=r.max_tokens, prompt_lookup=lookup)
            runs.append({"tokens": list(out.token_ids), "seconds": out.meta["e2e_latency"]})
        return runs

    def theirs(lookup: int) -> list[dict]:
        return [llama.ask({"model": str(gguf), "ids": r.ids, "n": r.max_tokens,
                           "threads": threads, "stop_at_eos": True, "lookup": lookup})
                for r in requests]

    sides = {"ours, lookup on": lambda: ours(True), "ours, lookup off": lambda: ours(False),
             "llama.cpp, lookup on": lambda: theirs(args.llama_lookup_tokens),
             "llama.cpp, lookup off": lambda: theirs(0)}
    best: dict[str, list[dict]] = {}
    for round_no in range(1, args.repeat + 1):
        print(f"copy workload, round {round_no}/{args.repeat}", flush=True)
        for side, fn in sides.items() if round_no % 2 else list(sides.items())[::-1]:
            runs = fn()
            if side not in best or sum(r["seconds"] for r in runs) < sum(
                    r["seconds"] for r in best[side]):
                best[side] = runs
    tok_s = {side: sum(len(r["tokens"]) for r in runs) / sum(r["seconds"] for r in runs)
             for side, runs in best.items()}

    def same(a: str, b: str) -> bool:
        return [r["tokens"] for r in best[a]] == [r["tokens"] for r in best[b]]

    return {"tok_s": tok_s,
            "ours_on_over_off": tok_s["ours, lookup on"] / tok_s["ours, lookup off"],
            "llama_on_over_off": tok_s["llama.cpp, lookup on"] / tok_s["llama.cpp, lookup off"],
            "ours_on_over_llama_on": tok_s["ours, lookup on"] / tok_s["llama.cpp, lookup on"],
            "ours_identical": same("ours, lookup on", "ours, lookup off"),
            "llama_identical": same("llama.cpp, lookup on", "llama.cpp, lookup off")}


def print_rows(rows: dict, version: str, args: argparse.Namespace) -> None:
    print(f"\none stream, {args.new_tokens} new tokens, greedy; llama.cpp {version} "
          f"(llama-cpp-python), {torch.get_num_threads()} threads both")
    print(f"{'GGUF':<6}{'ours':>6}{'ours tok/s':>12}{'llama.cpp':>11}{'ratio':>8}"
          f"{'median':>8}{'e2e ratio':>11}{'same tokens':>13}")
    for qtype, r in rows.items():
        print(f"{qtype:<6}{r['ours_mode']:>6}{r['ours_decode_tok_s']:>12.1f}"
              f"{r['llama_decode_tok_s']:>11.1f}{r['ratio_best']:>7.2f}x"
              f"{r['ratio_median']:>7.2f}x"
              f"{r['ours_e2e_tok_s'] / r['llama_e2e_tok_s']:>10.2f}x"
              f"{r['tokens_agreeing']:>8} of {r['new_tokens']}")
    print("(tok/s: decode, each side's fastest round; ratio: of those; median: over rounds "
          "of the two run seconds apart; e2e: with prefill)")


def print_copy(c: dict) -> None:
    print("\ncopy workload on the Q4_1 file (whole-workload tok/s, prefill included)")
    for side, v in c["tok_s"].items():
        print(f"  {side:<24}{v:>8.1f}")
    print(f"ours on / off {c['ours_on_over_off']:.2f}x (output "
          f"{'identical' if c['ours_identical'] else 'DIFFERENT'}); llama.cpp on / off "
          f"{c['llama_on_over_off']:.2f}x (output "
          f"{'identical' if c['llama_identical'] else 'different'}); ours / llama.cpp, "
          f"lookup on: {c['ours_on_over_llama_on']:.2f}x")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", nargs="+", default=list(ROWS), choices=list(ROWS),
                        metavar="TYPE", help=f"GGUF types (default all: {', '.join(ROWS)})")
    parser.add_argument("--new-tokens", type=int, default=128, help="one-stream tokens")
    parser.add_argument("--repeat", type=int, default=4,
                        help="rounds, both engines on every file each round")
    add_llamacpp_venv_argument(parser)
    parser.add_argument("--copy", action="store_true",
                        help="also the copy workload on Q4_1, prompt lookup on and off")
    parser.add_argument("--llama-lookup-tokens", type=int, default=10,
                        help="LlamaPromptLookupDecoding's num_pred_tokens (--copy)")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1 or args.new_tokens < 2:
        raise SystemExit("--repeat must be at least 1 and --new-tokens at least 2")
    if args.llama_lookup_tokens < 1:
        raise SystemExit("--llama-lookup-tokens must be at least 1")
    from sgl_nb.bench.peers_gguf import variant_path

    llama = LlamaCpp(venv_python(args.llamacpp_venv))
    files = {qtype: variant_path(qtype) for qtype in args.files}
    if args.copy:
        files.setdefault("Q4_1", variant_path("Q4_1"))
    runtimes = load_ours(list(files), files)
    try:
        ids = prompt_ids()
        for qtype, rt in runtimes.items():  # warm-up: each model's first stream, both sides
            rt.generate(ids[:8], max_tokens=4)
            llama.ask({"model": str(files[qtype]), "ids": ids[:8], "n": 4,
                       "threads": torch.get_num_threads()})
        runs = stream_rounds(args, {q: runtimes[q] for q in args.files}, llama, files, ids)
        copy = copy_rounds(args, runtimes["Q4_1"], llama, files["Q4_1"]) if args.copy else None
    finally:
        for rt in runtimes.values():
            rt.shutdown()
        llama.close()
    rows = stream_rows(runs)
    print_rows(rows, llama.version, args)
    if copy:
        print_copy(copy)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "copy": copy, "llama_cpp": llama.version,
                       "threads": torch.get_num_threads(), "new_tokens": args.new_tokens},
                      f, indent=2)
    return 0 if copy is None or copy["ours_identical"] else 1
