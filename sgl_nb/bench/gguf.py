"""`sgl-nb bench gguf`: int4 from a GGUF's own blocks against int4 quantized again from its
dequantized weights (what a load did before the blocks were kept), one stream, one prompt.

Rows, on the default model's Q4_1 GGUF (or --model, a .gguf):
- fp32: the dequantized weights, the reference for the tokens;
- int4 requantized: the converted folder seen without the file's blocks (its files linked
  into the cache's bench_gguf/ folder), so int4 quantizes them again (bf16 activations, the
  int4 default);
- int4 blocks, bf16: the file's Q4_1 / Q8_0 blocks, activations rounded to int8 in the
  matmuls (the default dtype);
- int4 blocks, fp32: the same blocks, the kernels' exact path.

All rows are loaded in one process and take turns, one stream of N greedy tokens each per
round (EOS ignored): on a shared machine the load changes from minute to minute, and rows
run seconds apart see the same. Per row: its best decode tok/s, the median over rounds of
its speed over the re-quantized row's in the same round, and how many of N greedy tokens
(from an empty cache) equal fp32's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from sgl_nb.bench import add_json_argument, add_model_argument
from sgl_nb.bench.engine import STREAM_PROMPT, ours_one_stream

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


def load_rows(model: str | None) -> tuple[dict, list[int]]:
    """Each row's Runtime, and the prompt's ids (the bench prompt in the chat template)."""
    from transformers import AutoTokenizer

    from sgl_nb import Runtime
    from sgl_nb.runtime.model.model_loader import resolve_model_path

    folder = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": STREAM_PROMPT}], tokenize=False, add_generation_prompt=True))
    runtimes = {}
    for label, (dtype, quantization, blocks) in ROWS.items():
        path = folder if blocks else without_blocks(folder)
        runtimes[label] = Runtime(str(path), dtype=dtype, quantization=quantization)
        runtimes[label].generate(ids[:8], max_tokens=4)  # warm-up
    return runtimes, ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--new-tokens", type=int, default=128, help="one-stream tokens")
    parser.add_argument("--repeat", type=int, default=6,
                        help="rounds, every row one stream per round")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {args.repeat}")
    if args.model is not None and Path(args.model).suffix != ".gguf":
        raise SystemExit(f"--model must be a .gguf file, got {args.model}")
    n = args.new_tokens
    runtimes, ids = load_rows(args.model)
    try:
        steps: dict[str, list[float]] = {label: [] for label in ROWS}
        for round_no in range(1, args.repeat + 1):
            print(f"round {round_no}/{args.repeat}", flush=True)
            for label, rt in runtimes.items():
                rt.flush_cache()
                steps[label].append(ours_one_stream(rt, ids, n)[1])
        tokens = {}
        for label, rt in runtimes.items():
            # From an empty cache, as fp32's: a prompt served from the cache is computed in
            # another order (extend attention over a cached prefix), which can turn a near-tie.
            rt.flush_cache()
            tokens[label] = rt.generate(ids, max_tokens=n, ignore_eos=True).token_ids
    finally:
        for rt in runtimes.values():
            rt.shutdown()
    rows = {}
    for label, s in steps.items():
        same = next((i for i, (a, b) in enumerate(zip(tokens[label], tokens["fp32"])) if a != b),
                    n)
        rows[label] = {
            "decode_tok_s_best": 1 / min(s),
            "vs_requantized": statistics.median(b / x for b, x in zip(steps[BASELINE], s)),
            "tokens_equal_to_fp32": same,
        }
    name = os.path.basename(args.model) if args.model else "default model"
    print(f"\n{f'load ({name})':<24}{'best decode tok/s':>19}{'vs requantized':>16}"
          f"{f'= fp32 of {n}':>14}")
    for label, r in rows.items():
        print(f"{label:<24}{r['decode_tok_s_best']:>19.1f}{r['vs_requantized']:>15.2f}x"
              f"{r['tokens_equal_to_fp32']:>14}")
    print(f"(vs requantized: the median over {args.repeat} rounds of the two rows' speeds "
          "measured seconds apart)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
