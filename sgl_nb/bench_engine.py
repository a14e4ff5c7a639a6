"""`sgl-nb bench engine`: our engine against transformers `generate`, same weights, one run.

1. One stream, N new tokens, greedy: tok/s of both, and our decode step time against the
   bare weight-matmul floor measured here (F.linear over every 2-D weight, tied
   embedding once as the LM head, random activations, two warm-ups, mean of five).
2. R requests sharing a P-token prefix, M new tokens each: end-to-end seconds, against
   HF batched `generate` with left padding.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

STREAM_PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."


def matmul_floor(weights: list[torch.Tensor], batch: int) -> float:
    """Seconds per step for the bare weight matmuls at this batch size."""
    xs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
    for _ in range(2):
        for w in weights:
            F.linear(xs[w.shape[1]], w)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for w in weights:
            F.linear(xs[w.shape[1]], w)
        times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def checkpoint_matrices(folder) -> list[torch.Tensor]:
    from sgl_nb.runtime.model import read_weights

    w = read_weights(folder)
    mats = [t.float() for name, t in w.items() if t.dim() == 2 and "embed_tokens" not in name]
    if "lm_head.weight" not in w:
        mats.append(w["model.embed_tokens.weight"].float())  # tied: the LM head
    return mats


def shared_prefix_prompts(tok, n: int, prefix_tokens: int) -> list[list[int]]:
    text = (
        "The following is a record of questions asked at a public library's help desk. "
        "Each answer is short, friendly and precise. "
    ) * 200
    prefix = tok.encode(text)[:prefix_tokens]
    topics = ["tides", "bread", "volcanoes", "chess", "bees", "rust", "jazz", "glaciers",
              "comets", "maps", "paper", "owls", "salt", "clocks", "bridges", "ink"]
    return [prefix + tok.encode(f"\nQ{i}: Tell me about {topics[i % len(topics)]}.\nA:")
            for i in range(n)]


def hf_one_stream(hf, ids: list[int], n: int) -> float:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    assert out.shape[1] - len(ids) == n
    return time.perf_counter() - t0


def hf_batched(hf, tok, prompts: list[list[int]], n: int) -> float:
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return time.perf_counter() - t0


def ours_one_stream(rt, ids: list[int], n: int) -> tuple[float, float]:
    """(seconds end to end, mean seconds per decode step)."""
    t0 = time.perf_counter()
    stamps = []
    for _ in rt.generate(ids, max_tokens=n, ignore_eos=True, stream=True):
        stamps.append(time.perf_counter())
    total = time.perf_counter() - t0
    step = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return total, step


def run_engine_bench(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from sgl_nb import Runtime

    print("loading our engine and transformers (same weights, fp32) ...", flush=True)
    rt = Runtime(args.model)
    tok = rt.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(str(rt.model_path), dtype=torch.float32).eval()
    torch.set_num_threads(torch.get_num_threads())
    mats = checkpoint_matrices(rt.model_path)
    floor1 = matmul_floor(mats, 1)
    floor_b = matmul_floor(mats, args.requests)

    ids = tok.encode(rt.apply_chat_template([{"role": "user", "content": STREAM_PROMPT}]))
    rt.generate(ids[:8], max_tokens=4)  # warm-up
    print("1/4 one stream, ours ...", flush=True)
    ours_s, ours_step = ours_one_stream(rt, ids, args.new_tokens)
    print("2/4 one stream, transformers ...", flush=True)
    hf_s = hf_one_stream(hf, ids, args.new_tokens)

    prompts = shared_prefix_prompts(tok, args.requests, args.prefix_tokens)
    rt.engine.cache.reset()
    print("3/4 shared prefix, ours ...", flush=True)
    t0 = time.perf_counter()
    outs = rt.generate(prompts, max_tokens=args.shared_new_tokens, ignore_eos=True)
    ours_batch = time.perf_counter() - t0
    cached = sum(o.meta["cached_tokens"] for o in outs)
    print("4/4 shared prefix, transformers ...", flush=True)
    hf_batch = hf_batched(hf, tok, prompts, args.shared_new_tokens)
    rt.shutdown()

    n = args.new_tokens
    rows = {
        "one_stream_tok_s_ours": n / ours_s,
        "one_stream_tok_s_hf": n / hf_s,
        "one_stream_speedup": hf_s / ours_s,
        "decode_step_ms_ours": ours_step * 1e3,
        "matmul_floor_ms_b1": floor1 * 1e3,
        "step_over_floor": ours_step / floor1,
        "shared_prefix_s_ours": ours_batch,
        "shared_prefix_s_hf": hf_batch,
        "shared_prefix_speedup": hf_batch / ours_batch,
        "shared_prefix_cached_tokens": cached,
        f"matmul_floor_ms_b{args.requests}": floor_b * 1e3,
        "threads": torch.get_num_threads(),
    }
    print_table(args, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def print_table(args: argparse.Namespace, r: dict) -> None:
    n, R, P, M = args.new_tokens, args.requests, args.prefix_tokens, args.shared_new_tokens
    print()
    print(f"{'workload':<44}{'ours':>12}{'transformers':>14}{'ratio':>9}{'target':>9}")
    print(f"{f'one stream, {n} new tokens (tok/s)':<44}{r['one_stream_tok_s_ours']:>12.1f}"
          f"{r['one_stream_tok_s_hf']:>14.1f}{r['one_stream_speedup']:>8.2f}x{'>=1.7x':>9}")
    print(f"{f'{R} req, {P}-token shared prefix, {M} new (s)':<44}"
          f"{r['shared_prefix_s_ours']:>12.2f}{r['shared_prefix_s_hf']:>14.2f}"
          f"{r['shared_prefix_speedup']:>8.2f}x{'>=5x':>9}")
    print(f"{'decode step (ms) vs bare-matmul floor b=1':<44}{r['decode_step_ms_ours']:>12.1f}"
          f"{r['matmul_floor_ms_b1']:>14.1f}{r['step_over_floor']:>8.2f}x{'<=1.25x':>9}")
    print(f"prefix tokens served from the radix cache: {r['shared_prefix_cached_tokens']}"
          f" ({R - 1} x {P} expected at least); torch threads: {r['threads']}")
