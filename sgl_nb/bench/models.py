"""`sgl-nb bench models`: every native family against transformers `generate`, one stream.

For each family a random-weight checkpoint of a realistic shape (about 0.5B parameters,
sgl_nb/bench/random_checkpoint.py; written once into the cache folder, nothing
downloaded), the same prompt, N greedy tokens (EOS ignored on both sides): tok/s of our
engine and of transformers in fp32, each in a fresh process, and their ratio. Then, on
Llama, our engine through the transformers path (SGL_NB_MODEL_RUNNER=transformers:
transformers' modeling code with our paged attention) against the native runner: what the
general path costs.

Each side runs `--repeat` rounds, the two sides taking turns, and keeps its fastest (noise
on a shared machine only ever slows a run).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from sgl_nb.bench import add_json_argument
from sgl_nb.bench.engine import STREAM_PROMPT, hf_one_stream, in_fresh_process, ours_one_stream
from sgl_nb.bench.random_checkpoint import FAMILIES, realistic_config, write_random_checkpoint


def checkpoint_folder(family: str):
    from sgl_nb.runtime.model.model_loader import cache_dir

    return cache_dir() / "bench_models" / family


def prompt_ids(folder) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    return tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": STREAM_PROMPT}], tokenize=False, add_generation_prompt=True))


def ours_in_process(folder, n: int, runner: str) -> dict:
    """One stream on our engine, on the runner named (native or transformers)."""
    os.environ["SGL_NB_MODEL_RUNNER"] = runner
    from sgl_nb import Runtime

    ids = prompt_ids(folder)
    rt = Runtime(str(folder))
    try:
        path = rt.engine.model.path
        decode = "fused C++" if rt.engine.model.fused_decode_ready() else "torch layer loop"
        rt.generate(ids[:8], max_tokens=4)  # warm-up
        seconds, step = ours_one_stream(rt, ids, n)
        return {"seconds": seconds, "decode_step_ms": step * 1e3, "path": str(path),
                "decode": decode}
    finally:
        rt.shutdown()


def hf_in_process(folder, n: int) -> dict:
    from transformers import AutoModelForCausalLM

    ids = prompt_ids(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf_one_stream(hf, ids[:8], 4)  # warm-up
    return {"seconds": hf_one_stream(hf, ids, n)}


def alternating(repeat: int, *sides: tuple) -> list[dict]:
    """Each side's fastest of `repeat` rounds, the sides taking turns round by round (a load
    that comes and goes on a shared machine then falls on both, not on whichever ran last);
    a side is (function, *args), each run in a fresh process."""
    runs: list[list[dict]] = [[] for _ in sides]
    for _ in range(repeat):
        for side, (fn, *args) in zip(runs, sides, strict=True):
            side.append(in_fresh_process(fn, *args))
    return [min(side, key=lambda r: r["seconds"]) for side in runs]


def bench_family(family: str, args: argparse.Namespace) -> dict:
    folder = checkpoint_folder(family)
    if not (folder / "config.json").is_file():
        print(f"{family}: writing a random-weight checkpoint to {folder} ...", flush=True)
    t0 = time.perf_counter()
    write_random_checkpoint(realistic_config(family), folder)
    print(f"{family}: ours, then transformers ({args.new_tokens} tokens, fp32) ...", flush=True)
    ours, hf = alternating(args.repeat, (ours_in_process, folder, args.new_tokens, "native"),
                           (hf_in_process, folder, args.new_tokens))
    row = {"ours_tok_s": args.new_tokens / ours["seconds"],
           "hf_tok_s": args.new_tokens / hf["seconds"],
           "speedup": hf["seconds"] / ours["seconds"], "path": ours["path"],
           "decode": ours["decode"],
           "wall_s": time.perf_counter() - t0}
    print(f"{family}: {row['ours_tok_s']:.1f} tok/s ours, {row['hf_tok_s']:.1f} transformers, "
          f"{row['speedup']:.2f}x", flush=True)
    return row


def bench_general_path(args: argparse.Namespace) -> dict:
    folder = checkpoint_folder("llama")
    write_random_checkpoint(realistic_config("llama"), folder)
    print("llama: the transformers path against native ...", flush=True)
    native, general = alternating(
        args.repeat, (ours_in_process, folder, args.new_tokens, "native"),
        (ours_in_process, folder, args.new_tokens, "transformers"))
    return {"native_tok_s": args.new_tokens / native["seconds"],
            "transformers_path_tok_s": args.new_tokens / general["seconds"],
            "transformers_path_over_native": native["seconds"] / general["seconds"],
            "path": general["path"]}


def print_table(rows: dict, general: dict | None) -> None:
    print(f"\n{'family':<11} {'ours tok/s':>10} {'hf tok/s':>9} {'ours/hf':>8}  path, decode")
    for family, r in rows.items():
        print(f"{family:<11} {r['ours_tok_s']:>10.1f} {r['hf_tok_s']:>9.1f} "
              f"{r['speedup']:>7.2f}x  {r['path']}, {r['decode']}")
    if general:
        print(f"\nllama through transformers' modeling code: "
              f"{general['transformers_path_tok_s']:.1f} tok/s against native "
              f"{general['native_tok_s']:.1f} "
              f"({general['transformers_path_over_native']:.2f}x of native)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES,
                        metavar="FAMILY",
                        help=f"which families (default all: {', '.join(FAMILIES)})")
    parser.add_argument("--new-tokens", type=int, default=32, help="one-stream tokens")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per side; each keeps its fastest")
    parser.add_argument("--no-general-path", action="store_true",
                        help="skip the transformers path against native on Llama")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1 or args.new_tokens < 2:
        raise SystemExit("--repeat must be at least 1 and --new-tokens at least 2")
    rows = {family: bench_family(family, args) for family in args.families}
    general = None if args.no_general_path else bench_general_path(args)
    print_table(rows, general)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"families": rows, "general_path": general,
                       "threads": torch.get_num_threads(), "new_tokens": args.new_tokens},
                      f, indent=2)
    return 0
