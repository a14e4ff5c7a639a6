"""`sgl-nb bench engine`: our engine against transformers `generate`, same weights, one run.

1. One stream, N new tokens, greedy: tok/s of both, and our decode step time against two
   floors measured here, each just before and just after the one-stream run, so that both
   stand under the same machine load:
   - the memory-bandwidth floor: the bytes of weights a decode step reads per token
     (Model.decode_read_bytes: every linear as its kernel holds it, scales and mins, the
     LM head) over the read bandwidth of this machine (a buffer larger than the last-level
     cache summed by torch on the engine's threads, best of several passes; or the rate
     the step's matmuls read the weights at, where that is higher), and the
     fraction of it the one-stream run reached (its tok/s over the floor's);
   - the bare weight-matmul floor (the model's own linear layers, fused q/k/v and gate/up,
     LM head once, on random activations: the median of 15 passes before and 15 after).
2. R requests sharing a P-token prefix, M new tokens each: end-to-end seconds, against
   HF batched `generate` with left padding.

The whole sequence runs `--repeat` rounds (default 2) and each side keeps its best round
(per figure: the one-stream figures and the batch-1 floor from its fastest one-stream
round, the lowest batch-R floor, the fastest shared-prefix run): on a shared machine noise
only ever makes a run slower, by up to 2x here, in spells of minutes (measured), so a side
caught in one is outvoted by its other round.

fp32 always runs (the first table: ratios and targets). `--dtype bfloat16` and
`--quantization int8 int4` add one row each to a second table, against the same fp32
transformers baseline; on the default model a last row measures llama.cpp on its GGUF file
(llama-cpp-python in this venv, else in --llamacpp-venv's: `make llamacpp`), and int4's one
stream is given against it.

Each engine mode, transformers and llama.cpp run in a fresh process of their own, one
after another: threads, thread pools and caches left by one never slow the next.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from sgl_nb.bench import add_json_argument, add_llamacpp_venv_argument, add_model_argument
from sgl_nb.runtime.model.weight_arena import Arena

STREAM_PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."


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
    """(seconds end to end, mean seconds per decode step: from the first token's text to
    the last's, over the n - 1 tokens between; a chunk may hold several, decode ahead's
    do). Prompt lookup off: this is the decode step's figure (`sgl-nb bench copy`
    measures lookup)."""
    t0 = time.perf_counter()
    stamps = []
    for _ in rt.generate(ids, max_tokens=n, ignore_eos=True, stream=True, prompt_lookup=False):
        stamps.append(time.perf_counter())
    total = time.perf_counter() - t0
    step = (stamps[-1] - stamps[0]) / max(n - 1, 1)
    return total, step


MODE_LABELS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def bench_modes(args: argparse.Namespace) -> list[tuple[str, str | None, str | None]]:
    """(label, dtype, quantization) per engine mode to run: fp32 first (the baseline rows),
    then each extra --dtype, then each --quantization (with 16-bit activations)."""
    modes = [("fp32", "float32", None)]
    for dtype in args.dtype or []:
        if dtype != "float32":
            modes.append((MODE_LABELS[dtype], dtype, None))
    for q in args.quantization or []:
        if q != "none":
            modes.append((q, None, q))
    return modes


def linears_floor(model, batch: int, passes: int = 5) -> list[float]:
    """Seconds of each pass over the bare weight matmuls of `model` (its own linear layers
    and kernels, LM head included) at this batch size, after two warm-up passes."""
    layers = model.decode_linears()
    xs = {lin.in_features: torch.randn(batch, lin.in_features, dtype=model.dtype)
          for lin in layers}
    with torch.inference_mode():
        for _ in range(2):
            for lin in layers:
                lin(xs[lin.in_features])
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            for lin in layers:
                lin(xs[lin.in_features])
            times.append(time.perf_counter() - t0)
    return times


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), 0 when unknown."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=0)


def read_bandwidth(passes: int = 5) -> float:
    """Bytes per second at reading memory: a float32 buffer of twice the last-level cache
    (256 MiB to 2 GiB) summed by torch on its threads (the engine's), the best pass. The
    buffer is on huge pages where Linux gives them, as the step's weights are (Arena): on
    4 KiB pages torch's sum read 28-34 GB/s where it read 35-37 on 2 MiB ones, in one spell
    of a 2-core Zen 4 whose fp32 matmuls streamed 34-36."""
    size = min(max(2 * last_level_cache_bytes(), 2**28), 2**31)
    buf = Arena(size).buffer.view(torch.float32)
    buf.fill_(1.0)  # every page touched before timing
    buf.sum()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return size / best


def measure_ours(rt, args: argparse.Namespace, ids: list[int], prompts: list[list[int]]) -> dict:
    model = rt.engine.model
    bandwidth = read_bandwidth()
    # The batch-1 floor brackets the one-stream run: 15 passes before, 15 after, median.
    # Five passes (0.1 s) right after loading gave 13.9-19.7 ms in three fresh processes of
    # the same fp32 build, while the steps (a 5 s run) varied 20.7-21.3: a short spell of
    # fast memory is not the load the steps ran under.
    before = linears_floor(model, 1, passes=15)
    floor_b = statistics.median(linears_floor(model, args.requests))
    rt.generate(ids[:8], max_tokens=4)  # warm-up
    engine = rt.engine
    # Zeroed before the request: its decode steps are the ones after its first token, the
    # window `step` is measured over (its prompt is an extend, which neither counts). Zeroed
    # at the first token instead, the call waited for the decode run already under way and
    # the engine counted that run's seconds, or not yet: a run's worth (~0.1 ms a step)
    # came and went in "forward call beyond the phases".
    model.decode_phase_seconds()
    since = {"decodes": engine.steps["decode"], "forward_s": engine.step_seconds["decode"]}
    stream_s, step = ours_one_stream(rt, ids, args.new_tokens)
    decodes = engine.steps["decode"] - since["decodes"]
    forward_s = engine.step_seconds["decode"] - since["forward_s"]
    phases = model.decode_phase_seconds() or {}
    floor1 = statistics.median(before + linears_floor(model, 1, passes=15))
    weight_bytes = model.decode_read_bytes()
    breakdown = decode_breakdown(step, forward_s, decodes, phases)
    # The step's own matmuls reading faster than the plain read is memory proving faster
    # than that read found it (fp32 at 23 GB/s against a read of 14.6 on a Zen 1 host,
    # measured): the floor takes the faster, so a step never beats its own floor.
    matmul_gb_s = matmul_read_rate(weight_bytes, breakdown) or 0.0
    bandwidth = max(bandwidth, read_bandwidth(), matmul_gb_s * 1e9)
    rt.engine.cache.reset()
    t0 = time.perf_counter()
    outs = rt.generate(prompts, max_tokens=args.shared_new_tokens, ignore_eos=True)
    shared_s = time.perf_counter() - t0
    return {
        "one_stream_tok_s": args.new_tokens / stream_s,
        "one_stream_s": stream_s,
        "decode_step_ms": step * 1e3,
        "matmul_floor_ms_b1": floor1 * 1e3,
        f"matmul_floor_ms_b{args.requests}": floor_b * 1e3,
        "weight_bytes_per_token": weight_bytes,
        "read_gb_s": bandwidth / 1e9,
        "bandwidth_floor_tok_s": bandwidth / weight_bytes,
        "fraction_of_floor": args.new_tokens / stream_s / (bandwidth / weight_bytes),
        "shared_prefix_s": shared_s,
        "shared_prefix_cached_tokens": sum(o.meta["cached_tokens"] for o in outs),
        "decode_breakdown_ms": breakdown,
    }


def decode_breakdown(step_s: float, forward_s: float, decodes: int,
                     phases: dict[str, float]) -> dict[str, float]:
    """Milliseconds per decode step of the one-stream run by part: the fused step's phases,
    the forward call beyond them (its Python and the step's set-up), and the engine around
    the forward (scheduling, picking the token, detokenizing, streaming)."""
    if decodes == 0:
        return {}
    out = {name: 1e3 * s / decodes for name, s in phases.items()}
    forward_ms = 1e3 * forward_s / decodes
    out["forward call beyond the phases"] = forward_ms - sum(out.values())
    out["engine around the forward (python)"] = 1e3 * step_s - forward_ms
    return out


def llama_cpp_bench(args: argparse.Namespace, ids: list[int],
                    prompts: list[list[int]]) -> dict | None:
    """llama.cpp on the default GGUF, in the child process `sgl-nb bench peers` runs
    (llama-cpp-python here, else in --llamacpp-venv's: `make llamacpp`): one stream, then
    the shared-prefix requests one after another, each keeping what the last evaluated, so
    that the shared prefix is computed once. None without llama-cpp-python."""
    from sgl_nb.bench.llamacpp_process import LlamaCpp, venv_python
    from sgl_nb.runtime.model.model_loader import default_gguf_path

    here = importlib.util.find_spec("llama_cpp") is not None
    python = Path(sys.executable) if here else venv_python(args.llamacpp_venv)
    if not python.is_file():
        print(f"llama.cpp: not measured; no {python} (`make llamacpp` builds llama-cpp-python "
              "there, or pip install it in this venv)", flush=True)
        return None
    threads = torch.get_num_threads()
    base = {"model": str(default_gguf_path()), "threads": threads}
    llama = LlamaCpp(python)
    try:
        llama.ask({**base, "ids": ids[:8], "n": 4})  # warm-up
        stream = llama.ask({**base, "ids": ids, "n": args.new_tokens})
        shared = [llama.ask({**base, "ids": p, "n": args.shared_new_tokens, "keep_prefix": i > 0})
                  for i, p in enumerate(prompts)]
    finally:
        llama.close()
    return {"one_stream_tok_s": args.new_tokens / stream["seconds"],
            "one_stream_s": stream["seconds"],
            "shared_prefix_s": sum(r["seconds"] for r in shared), "threads": threads}


def in_fresh_process(fn, *args):
    """fn(*args) in a new Python process (spawned, not forked: nothing of this one's
    threads or memory), its result returned."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def workload(args: argparse.Namespace):
    """(tokenizer, the one-stream prompt, the shared-prefix prompts), prompts as token ids."""
    from transformers import AutoTokenizer

    from sgl_nb.runtime.model.model_loader import resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": STREAM_PROMPT}], tokenize=False, add_generation_prompt=True))
    return tok, ids, shared_prefix_prompts(tok, args.requests, args.prefix_tokens)


def ours_in_process(args: argparse.Namespace, dtype: str | None, quant: str | None) -> dict:
    from sgl_nb import Runtime

    _, ids, prompts = workload(args)
    rt = Runtime(args.model, dtype=dtype, quantization=quant)
    try:
        return measure_ours(rt, args, ids, prompts)
    finally:
        rt.shutdown()


def hf_in_process(args: argparse.Namespace) -> dict:
    """Seconds of transformers fp32: one_stream_s, shared_prefix_s."""
    from transformers import AutoModelForCausalLM

    from sgl_nb.runtime.model.model_loader import resolve_model_path

    path = resolve_model_path(args.model)
    tok, ids, prompts = workload(args)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return {"one_stream_s": hf_one_stream(hf, ids, args.new_tokens),
            "shared_prefix_s": hf_batched(hf, tok, prompts, args.shared_new_tokens)}


def llama_in_process(args: argparse.Namespace) -> dict | None:
    _, ids, prompts = workload(args)
    return llama_cpp_bench(args, ids, prompts)


# Taken together from one round: the step / floor ratio pairs figures measured under one load.
STREAM_FIGURES = ("one_stream_s", "one_stream_tok_s", "decode_step_ms", "matmul_floor_ms_b1",
                  "read_gb_s", "bandwidth_floor_tok_s", "fraction_of_floor",
                  "decode_breakdown_ms")


def better_round(best: dict | None, new: dict | None) -> dict | None:
    """One side's figures over two rounds: the one-stream figures of the faster one-stream
    run (with the batch-1 floor measured just before it: the step / floor ratio pairs
    figures taken under the same load), the lower batch-R floor, the faster shared-prefix
    run."""
    if best is None or new is None:
        return new if best is None else best
    merged = dict(best)
    if new["one_stream_s"] < best["one_stream_s"]:
        merged.update({key: new[key] for key in STREAM_FIGURES if key in new})
    for key in new.keys() - set(STREAM_FIGURES):
        if key.startswith("matmul_floor") or key == "shared_prefix_s":
            merged[key] = min(merged[key], new[key])
    return merged


def run_round(args: argparse.Namespace, round_no: int) -> tuple[dict, dict, dict | None]:
    """(ours by mode, transformers, llama.cpp or None): every side once, each in a fresh
    process, one after another."""
    modes = bench_modes(args)
    steps = len(modes) + 1 + (args.model is None)
    tag = f"round {round_no}/{args.repeat}, "
    ours = {}
    for i, (label, dtype, quant) in enumerate(modes, 1):
        print(f"{tag}{i}/{steps} ours, {label}: one stream, then shared prefix ...", flush=True)
        ours[label] = in_fresh_process(ours_in_process, args, dtype, quant)
    print(f"{tag}{len(modes) + 1}/{steps} transformers (fp32): one stream, then shared "
          "prefix ...", flush=True)
    hf = in_fresh_process(hf_in_process, args)
    llama = None
    if args.model is None:
        print(f"{tag}{steps}/{steps} llama.cpp: one stream, then the shared-prefix requests "
              "one after another ...", flush=True)
        llama = in_fresh_process(llama_in_process, args)
    elif round_no == 1:
        print("llama.cpp: measured on the default model only (its GGUF file)", flush=True)
    return ours, hf, llama


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The one-stream and shared-prefix workloads' sizes (the remote bench runs them too)."""
    parser.add_argument("--new-tokens", type=int, default=256, help="one-stream tokens")
    parser.add_argument("--requests", type=int, default=16, help="shared-prefix requests")
    parser.add_argument("--prefix-tokens", type=int, default=400)
    parser.add_argument("--shared-new-tokens", type=int, default=32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_workload_arguments(parser)
    parser.add_argument("--dtype", nargs="+", default=[],
                        choices=["float32", "bfloat16", "float16"],
                        help="also run these activation dtypes (fp32 always runs)")
    parser.add_argument("--quantization", nargs="+", default=[],
                        choices=["none", "int8", "int4"],
                        help="also run these weight-only modes (bf16 activations)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="rounds of the whole sequence, ours and the baselines'; each "
                        "side keeps its best round (noise only slows a run)")
    add_llamacpp_venv_argument(parser, ", where this venv has none")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {args.repeat}")
    ours: dict = {}
    hf = llama = None
    for round_no in range(1, args.repeat + 1):
        ours_r, hf_r, llama_r = run_round(args, round_no)
        ours = {label: better_round(ours.get(label), m) for label, m in ours_r.items()}
        hf, llama = better_round(hf, hf_r), better_round(llama, llama_r)
    hf_s, hf_batch = hf["one_stream_s"], hf["shared_prefix_s"]

    n, base = args.new_tokens, ours["fp32"]
    rows = {
        "one_stream_tok_s_ours": base["one_stream_tok_s"],
        "one_stream_tok_s_hf": n / hf_s,
        "one_stream_speedup": hf_s / base["one_stream_s"],
        "decode_step_ms_ours": base["decode_step_ms"],
        "matmul_floor_ms_b1": base["matmul_floor_ms_b1"],
        "step_over_floor": base["decode_step_ms"] / base["matmul_floor_ms_b1"],
        "shared_prefix_s_ours": base["shared_prefix_s"],
        "shared_prefix_s_hf": hf_batch,
        "shared_prefix_speedup": hf_batch / base["shared_prefix_s"],
        "shared_prefix_cached_tokens": base["shared_prefix_cached_tokens"],
        f"matmul_floor_ms_b{args.requests}": base[f"matmul_floor_ms_b{args.requests}"],
        "threads": torch.get_num_threads(),
        "modes": ours,
        "llama_cpp": llama,
    }
    print_table(args, rows)
    print_modes(args, rows)
    print_bandwidth_floor(ours)
    print_breakdown(ours)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def print_table(args: argparse.Namespace, r: dict) -> None:
    n, R, P, M = args.new_tokens, args.requests, args.prefix_tokens, args.shared_new_tokens
    print()
    print(f"{'workload (fp32)':<44}{'ours':>12}{'transformers':>14}{'ratio':>9}{'target':>9}")
    print(f"{f'one stream, {n} new tokens (tok/s)':<44}{r['one_stream_tok_s_ours']:>12.1f}"
          f"{r['one_stream_tok_s_hf']:>14.1f}{r['one_stream_speedup']:>8.2f}x{'>=1.7x':>9}")
    print(f"{f'{R} req, {P}-token shared prefix, {M} new (s)':<44}"
          f"{r['shared_prefix_s_ours']:>12.2f}{r['shared_prefix_s_hf']:>14.2f}"
          f"{r['shared_prefix_speedup']:>8.2f}x{'>=5x':>9}")
    print(f"{'decode step (ms) vs bare-matmul floor b=1':<44}{r['decode_step_ms_ours']:>12.1f}"
          f"{r['matmul_floor_ms_b1']:>14.1f}{r['step_over_floor']:>8.2f}x{'<=1.25x':>9}")
    print(f"prefix tokens served from the radix cache: {r['shared_prefix_cached_tokens']}"
          f" ({R - 1} x {P} expected at least); torch threads: {r['threads']}")


def print_bandwidth_floor(modes: dict) -> None:
    """Per mode: the weights a decode step reads, the read bandwidth measured in its
    process, the floor they give and the fraction of it reached (one stream's tok/s, and
    the decode step alone)."""
    print()
    print(f"{'memory-bandwidth floor':<22}{'MB/token':>10}{'read GB/s':>11}{'floor tok/s':>13}"
          f"{'1 stream':>10}{'of floor':>10}{'decode step':>13}{'matmul GB/s':>13}")
    for label, m in modes.items():
        floor_ms = 1e3 / m["bandwidth_floor_tok_s"]
        rate = matmul_read_rate(m["weight_bytes_per_token"], m["decode_breakdown_ms"])
        print(f"{label:<22}{m['weight_bytes_per_token'] / 1e6:>10.1f}{m['read_gb_s']:>11.1f}"
              f"{m['bandwidth_floor_tok_s']:>13.1f}{m['one_stream_tok_s']:>10.1f}"
              f"{m['fraction_of_floor']:>9.0%}{floor_ms / m['decode_step_ms']:>12.0%}"
              + (f"{rate:>13.1f}" if rate else f"{'-':>13}"))
    print("floor: the weights one decode step reads (scales, mins and the LM head included) "
          "over the read bandwidth of a buffer twice the last-level cache, on the engine's "
          "threads, or the step's matmuls' rate where higher; 'of floor': one stream's "
          "tok/s over the floor's; 'decode step': the floor's step time over ours; "
          "'matmul GB/s': those weights over the step's matmul phases (where well under "
          "'read GB/s', the way the kernels stream the weights, not memory, sets them)")


def matmul_read_rate(weight_bytes: float, breakdown_ms: dict[str, float]) -> float | None:
    """GB/s at which a decode step's matmuls went through its weights: the bytes it reads
    over its matmul phases (decode_breakdown's; None without the fused step's phases)."""
    ms = sum(v for k, v in breakdown_ms.items() if k.endswith("matmul"))
    return weight_bytes / ms / 1e6 if ms > 0 else None


def print_breakdown(modes: dict) -> None:
    """Where one stream's decode step went, ms per step, a column per mode."""
    parts = list(dict.fromkeys(p for m in modes.values() for p in m["decode_breakdown_ms"]))
    if not parts:
        return
    print()
    print(f"{'one-stream decode step (ms)':<38}" + "".join(f"{label:>10}" for label in modes))
    for part in parts:
        print(f"{part:<38}" + "".join(f"{m['decode_breakdown_ms'].get(part, 0.0):>10.3f}"
                                      for m in modes.values()))
    print(f"{'step (tokens apart)':<38}" + "".join(f"{m['decode_step_ms']:>10.3f}"
                                                for m in modes.values()))


def print_modes(args: argparse.Namespace, r: dict) -> None:
    """One row per precision mode (and llama.cpp), each against the same fp32 transformers
    baseline; the floor is that mode's own weight matmuls."""
    modes, llama = r["modes"], r["llama_cpp"]
    if len(modes) == 1 and llama is None:
        return
    hf_tok_s, hf_shared = r["one_stream_tok_s_hf"], r["shared_prefix_s_hf"]
    R = args.requests
    print()
    print(f"{'mode':<22}{'1 stream tok/s':>15}{'vs HF':>8}{'shared (s)':>12}{'vs HF':>8}"
          f"{'step ms':>9}{'floor ms':>10}{'ratio':>8}{f'floor b={R}':>12}")
    for label, m in modes.items():
        print(f"{label:<22}{m['one_stream_tok_s']:>15.1f}"
              f"{m['one_stream_tok_s'] / hf_tok_s:>7.2f}x{m['shared_prefix_s']:>12.2f}"
              f"{hf_shared / m['shared_prefix_s']:>7.2f}x{m['decode_step_ms']:>9.1f}"
              f"{m['matmul_floor_ms_b1']:>10.1f}"
              f"{m['decode_step_ms'] / m['matmul_floor_ms_b1']:>7.2f}x"
              f"{m[f'matmul_floor_ms_b{R}']:>12.1f}")
    if llama is not None:
        print(f"{'llama.cpp (Q4_1 GGUF)':<22}{llama['one_stream_tok_s']:>15.1f}"
              f"{llama['one_stream_tok_s'] / hf_tok_s:>7.2f}x{llama['shared_prefix_s']:>12.2f}"
              f"{hf_shared / llama['shared_prefix_s']:>7.2f}x{'-':>9}{'-':>10}{'-':>8}{'-':>12}")
    print("vs HF: against transformers fp32 on the same weights; the shared-prefix requests "
          "run one after another on llama.cpp")
    if llama is not None and "int4" in modes:
        ours, theirs = modes["int4"]["one_stream_tok_s"], llama["one_stream_tok_s"]
        print(f"int4 one stream against llama.cpp on the same Q4_1 file: {ours:.1f} against "
              f"{theirs:.1f} tok/s, {ours / theirs:.2f}x (prefill included on both sides)")
