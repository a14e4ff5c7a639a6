"""`sgl-nb bench copy`: prompt lookup (n-gram speculation) where the output copies the input.

The workload (sgl_nb/bench/copy_workload.py): fields quoted out of three documents and two
code snippets returned with a name changed, one request at a time, greedy, each request
until EOS or its token limit, from an empty cache. Four sides on the same prompts and the
same weights, in one process:
- ours with prompt lookup on, and off (`prompt_lookup=` per request);
- transformers `generate` with `prompt_lookup_num_tokens`, and without.

Each round runs every side over the whole workload, the order turning round by round;
each side keeps its fastest round (noise on a shared machine only slows a run). tok/s is
generated tokens over the workload's wall time, prefill included. Ours must give the same
greedy tokens with lookup on and off: the bench fails if not. It prints the acceptance
(accepted / drafted tokens) from the engine's counters.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import torch

from sgl_nb.bench import add_json_argument, add_model_argument
from sgl_nb.bench.copy_workload import CopyRequest, copy_requests

LOOKUP_COUNTERS = ("prompt_lookup_drafted", "prompt_lookup_accepted",
                   "prompt_lookup_steps_saved")
SIDES = ("ours, lookup on", "ours, lookup off", "transformers, lookup on",
         "transformers, lookup off")


@dataclass
class Pass:
    """One side's run over the whole workload."""
    seconds: float
    tokens: list[list[int]]
    counters: dict = field(default_factory=dict)

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tok_s(self) -> float:
        return self.generated / self.seconds


def lookup_counters(rt) -> dict:
    metrics = rt.engine.metrics()
    return {key: metrics.get(key, 0) for key in LOOKUP_COUNTERS}


def ours_pass(rt, requests: list[CopyRequest], lookup: bool) -> Pass:
    before = lookup_counters(rt)
    seconds, tokens = 0.0, []
    for r in requests:
        rt.flush_cache()  # every request prefills its whole prompt, as transformers does
        t0 = time.perf_counter()
        out = rt.generate(r.ids, max_tokens=r.max_tokens, prompt_lookup=lookup)
        seconds += time.perf_counter() - t0
        tokens.append(list(out.token_ids))
    after = lookup_counters(rt)
    return Pass(seconds, tokens, {key: after[key] - before[key] for key in LOOKUP_COUNTERS})


def hf_pass(hf, requests: list[CopyRequest], lookup_tokens: int | None) -> Pass:
    seconds, tokens = 0.0, []
    for r in requests:
        x = torch.tensor([r.ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=r.max_tokens,
                              do_sample=False, prompt_lookup_num_tokens=lookup_tokens)
        seconds += time.perf_counter() - t0
        new = out[0, len(r.ids):].tolist()
        # generate stops after EOS and keeps it; our token_ids stop before a stop token.
        if new and new[-1] == hf.generation_config.eos_token_id:
            new = new[:-1]
        tokens.append(new)
    return Pass(seconds, tokens)


def load_sides(args: argparse.Namespace):
    """(our Runtime, transformers' model, the workload): the same checkpoint folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_nb import Runtime
    from sgl_nb.runtime.model.model_loader import resolve_model_path

    folder = resolve_model_path(args.model)
    requests = copy_requests(AutoTokenizer.from_pretrained(str(folder)))
    rt = Runtime(str(folder), dtype=args.dtype, quantization=args.quantization)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = eos[0] if isinstance(eos, list) else eos
    return rt, hf, requests


def one_round(rt, hf, requests: list[CopyRequest], args: argparse.Namespace,
              round_no: int) -> dict[str, Pass]:
    runs = {
        SIDES[0]: lambda: ours_pass(rt, requests, True),
        SIDES[1]: lambda: ours_pass(rt, requests, False),
        SIDES[2]: lambda: hf_pass(hf, requests, args.hf_lookup_tokens),
        SIDES[3]: lambda: hf_pass(hf, requests, None),
    }
    # The order turns each round, so that no side always runs right after the same one.
    order = list(SIDES[round_no % 2::2] + SIDES[1 - round_no % 2::2])
    passes = {}
    for side in order:
        passes[side] = runs[side]()
        print(f"  {side}: {passes[side].tok_s:.1f} tok/s", flush=True)
    return passes


def check_identical(best: dict[str, Pass], requests: list[CopyRequest]) -> list[str]:
    """The requests whose greedy tokens differ between ours with lookup on and off."""
    on, off = best[SIDES[0]].tokens, best[SIDES[1]].tokens
    return [r.name for r, a, b in zip(requests, on, off, strict=True) if a != b]


def summary(best: dict[str, Pass], requests: list[CopyRequest], args: argparse.Namespace,
            differing: list[str]) -> dict:
    on, off, hf_on, hf_off = (best[s] for s in SIDES)
    c = on.counters
    return {
        "ours_on_over_off": on.tok_s / off.tok_s,
        "hf_on_over_off": hf_on.tok_s / hf_off.tok_s,
        "ours_on_over_hf_on": on.tok_s / hf_on.tok_s,
        "ours_off_over_hf_off": off.tok_s / hf_off.tok_s,
        "tok_s": {side: best[side].tok_s for side in SIDES},
        "generated_tokens": {side: best[side].generated for side in SIDES},
        "drafted": c.get("prompt_lookup_drafted", 0),
        "accepted": c.get("prompt_lookup_accepted", 0),
        "steps_saved": c.get("prompt_lookup_steps_saved", 0),
        "identical_on_off": not differing,
        "differing": differing,
        "hf_identical_on_off": hf_on.tokens == hf_off.tokens,
        "ours_equal_hf": sum(a == b for a, b in zip(off.tokens, hf_off.tokens)),
        "requests": [{"name": r.name, "kind": r.kind, "prompt_tokens": len(r.ids)}
                     for r in requests],
        "rounds": args.repeat, "threads": torch.get_num_threads(),
        "mode": {"dtype": args.dtype, "quantization": args.quantization},
    }


def print_summary(s: dict) -> None:
    print(f"\n{'side (copy workload)':<28}{'tok/s':>8}{'tokens':>8}")
    for side in SIDES:
        print(f"{side:<28}{s['tok_s'][side]:>8.1f}{s['generated_tokens'][side]:>8}")
    print(f"\nours: lookup on / off {s['ours_on_over_off']:.2f}x (target >= 1.5x); "
          f"transformers: on / off {s['hf_on_over_off']:.2f}x")
    print(f"ours / transformers: lookup on {s['ours_on_over_hf_on']:.2f}x, lookup off "
          f"{s['ours_off_over_hf_off']:.2f}x")
    drafted, accepted = s["drafted"], s["accepted"]
    rate = f"{accepted / drafted:.1%}" if drafted else "n/a"
    print(f"prompt lookup: {accepted} of {drafted} drafted tokens accepted ({rate}), "
          f"{s['steps_saved']} decode steps saved")
    print(f"greedy output, ours lookup on vs off: "
          f"{'identical' if s['identical_on_off'] else 'DIFFERENT: ' + ', '.join(s['differing'])}"
          f"; transformers on vs off: {'identical' if s['hf_identical_on_off'] else 'different'}"
          f"; ours = transformers on {s['ours_equal_hf']} of {len(s['requests'])} requests")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="our activations (transformers runs fp32)")
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"],
                        help="our weights (default: as the checkpoint, dense)")
    parser.add_argument("--hf-lookup-tokens", type=int, default=10,
                        help="transformers' prompt_lookup_num_tokens (its docs suggest 10)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="cap every request's new tokens (default: its own, 160 for an "
                        "extraction, 320 for an edit)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds, every side once per round; each keeps its fastest")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {args.repeat}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise SystemExit(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.hf_lookup_tokens < 1:
        raise SystemExit(f"--hf-lookup-tokens must be at least 1, got {args.hf_lookup_tokens}")
    rt, hf, requests = load_sides(args)
    for r in requests:
        r.max_tokens = min(r.max_tokens, args.max_tokens or r.max_tokens)
    try:
        print(f"{len(requests)} requests, prompts "
              f"{', '.join(str(len(r.ids)) for r in requests)} tokens", flush=True)
        rt.generate(requests[-1].ids[:8], max_tokens=4)  # warm-up
        best: dict[str, Pass] = {}
        for round_no in range(1, args.repeat + 1):
            print(f"round {round_no}/{args.repeat}", flush=True)
            for side, p in one_round(rt, hf, requests, args, round_no).items():
                if side not in best or p.seconds < best[side].seconds:
                    best[side] = p
    finally:
        rt.shutdown()
    differing = check_identical(best, requests)
    s = summary(best, requests, args, differing)
    print_summary(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=2)
    if differing:
        print(f"FAILED: prompt lookup changed the greedy output of: {', '.join(differing)}",
              flush=True)
        return 1
    return 0
