"""`sgl-nb bench gguf`: int4 from a GGUF's own blocks against int4 quantized again from its
dequantized weights (what a load did before the blocks were kept), one stream, one prompt.

Rows, on the default model's Q4_1 GGUF (or --model, a .gguf):
- fp32: the dequantized weights, the reference for the tokens;
- int4 requantized: the converted folder seen without the file's blocks (its weights
  linked into the cache's bench_gguf/ folder), so int4 quantizes them again (bf16
  activations, the int4 default);
- int4 blocks, bf16: the file's Q4_1 / Q8_0 blocks, activations rounded to int8 in the
  matmuls (the default dtype);
- int4 blocks, fp32: the same blocks, the kernels' exact path.

Per row: decode tok/s over N greedy tokens (EOS ignored), its ratio to "int4 requantized",
and how many of the N tokens equal fp32's. Each row runs in a fresh process, `--repeat`
rounds taking turns, and keeps its fastest round (noise on a shared machine only slows).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from sgl_nb.bench import add_json_argument, add_model_argument
from sgl_nb.bench.engine import STREAM_PROMPT, in_fresh_process, ours_one_stream

# label -> (dtype, quantization, the file's blocks kept)
ROWS = {
    "fp32": ("float32", None, True),
    "int4 requantized": (None, "int4", False),
    "int4 blocks, bf16": (None, "int4", True),
    "int4 blocks, fp32": ("float32", "int4", True),
}
BASELINE = "int4 requantized"


def without_blocks(folder: Path) -> Path:
    """A folder of `folder`'s config, tokenizer and weights (links), without the GGUF's
    blocks: a load of it quantizes the dequantized weights, as before they were kept."""
    from sgl_nb.runtime.model.model_loader import cache_dir

    view = cache_dir() / "bench_gguf" / folder.name
    view.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and not (view / f.name).exists():
            (view / f.name).symlink_to(f.resolve())
    return view


def row_in_process(model: str | None, label: str, n: int) -> dict:
    """One stream of N tokens on one row's load: its tokens and its decode speed."""
    from transformers import AutoTokenizer

    from sgl_nb import Runtime
    from sgl_nb.runtime.model.model_loader import resolve_model_path

    dtype, quantization, blocks = ROWS[label]
    folder = resolve_model_path(model)
    if not blocks:
        folder = without_blocks(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": STREAM_PROMPT}], tokenize=False, add_generation_prompt=True))
    rt = Runtime(str(folder), dtype=dtype, quantization=quantization)
    try:
        rt.generate(ids[:8], max_tokens=4)  # warm-up
        seconds, step = ours_one_stream(rt, ids, n)
        # From an empty cache, as fp32's: a prompt served from the cache is computed in
        # another order (extend attention over a cached prefix), which can turn a near-tie.
        rt.flush_cache()
        tokens = rt.generate(ids, max_tokens=n, ignore_eos=True).token_ids
        return {"seconds": seconds, "decode_step_ms": step * 1e3, "tokens": tokens}
    finally:
        rt.shutdown()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--new-tokens", type=int, default=128, help="one-stream tokens")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds of all rows, taking turns; each row keeps its fastest")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {args.repeat}")
    if args.model is not None and Path(args.model).suffix != ".gguf":
        raise SystemExit(f"--model must be a .gguf file, got {args.model}")
    best: dict[str, dict] = {}
    for round_no in range(1, args.repeat + 1):
        for label in ROWS:
            print(f"round {round_no}/{args.repeat}: {label} ...", flush=True)
            got = in_fresh_process(row_in_process, args.model, label, args.new_tokens)
            if label not in best or got["decode_step_ms"] < best[label]["decode_step_ms"]:
                best[label] = got
    reference = best["fp32"]["tokens"]
    rows = {}
    for label, r in best.items():
        same = next((i for i, (a, b) in enumerate(zip(r["tokens"], reference)) if a != b),
                    len(reference))
        rows[label] = {"decode_tok_s": 1e3 / r["decode_step_ms"],
                       "vs_requantized": best[BASELINE]["decode_step_ms"] / r["decode_step_ms"],
                       "tokens_equal_to_fp32": same}
    n, name = args.new_tokens, os.path.basename(args.model) if args.model else "default model"
    print(f"\n{f'load ({name})':<28}{'decode tok/s':>14}{'vs requantized':>16}"
          f"{f'= fp32 of {n}':>14}")
    for label, r in rows.items():
        print(f"{label:<28}{r['decode_tok_s']:>14.1f}{r['vs_requantized']:>15.2f}x"
              f"{r['tokens_equal_to_fp32']:>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
