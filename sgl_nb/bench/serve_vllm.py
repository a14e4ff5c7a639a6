"""`sgl-nb bench serve --vllm-bench VENV`: vLLM's own serving benchmark, `vllm bench serve`
from VENV, against `sgl-nb serve` (started here) and against --vllm-server (a vLLM-CPU
server on the same model folder), with the same settings, in turns: the random dataset
(--input-len prompt tokens, --output-len new tokens past EOS), greedy, --num-prompts
requests with at most --max-concurrency in flight, streamed from /v1/completions.

    PYTHONPATH=tests python -m support.with_server vllm -- \\
        sgl-nb bench serve --vllm-bench .venv-vllm --vllm-server {url}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from sgl_nb.bench.serve_load import httpx_module
from sgl_nb.bench.serve_process import ServerProcess

# The venv's `vllm` script fails under vllm-cpu (it asks for the version of a distribution
# named "vllm"); this is what `vllm bench serve` runs, without that look-up.
VLLM_BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
FIGURES = (("request_throughput", "requests/s"), ("output_throughput", "output tok/s"),
           ("mean_ttft_ms", "TTFT mean (ms)"), ("median_ttft_ms", "TTFT median (ms)"),
           ("p99_ttft_ms", "TTFT p99 (ms)"), ("mean_itl_ms", "ITL mean (ms)"),
           ("median_itl_ms", "ITL median (ms)"), ("p99_itl_ms", "ITL p99 (ms)"))
RATIOS = (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT median"),
          ("median_itl_ms", "ITL median"))
RUN_TIMEOUT_S = 3600.0  # one `vllm bench serve`; only a hung one reaches it


def served_model(url: str, flag: str) -> tuple[str, str]:
    """The model the server at `url` serves: its folder (/v1/models root), where the
    benchmark reads the tokenizer, and the name requests give (its id); or SystemExit."""
    httpx = httpx_module()
    try:
        model = httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"{flag}: no OpenAI-compatible server answers at {url} ({e}): "
                         "python -m support.with_server vllm starts vLLM-CPU") from None
    return model.get("root") or model["id"], model["id"]


def bench_arguments(args: argparse.Namespace, url: str, model: str, name: str, seed: int,
                    result: Path) -> list[str]:
    return ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url,
            "--model", model, "--tokenizer", model, "--served-model-name", name,
            "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--ignore-eos",
            "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def vllm_bench_serve(python: Path, args: argparse.Namespace, url: str, model: str,
                     name: str, seed: int) -> dict:
    """One `vllm bench serve` run: its saved result (its figures, `failed`, `errors`)."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [str(python), "-c", VLLM_BENCH_SERVE,
               *bench_arguments(args, url, model, name, seed, result)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise RuntimeError(f"vllm bench serve against {url} failed "
                               f"({proc.returncode}):\n{tail}")
        return json.loads(result.read_text())


def run_comparison(args: argparse.Namespace) -> int:
    vllm_model = served_model(args.vllm_server, "--vllm-server") if args.vllm_server else None
    python = Path(args.vllm_bench) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"--vllm-bench: no {python} (make vllm builds .venv-vllm)")
    runs: list[dict] = []
    print("starting sgl-nb serve ...", flush=True)
    with ServerProcess(args.model, args.kv_pool_tokens) as server:
        model, name = served_model(server.url, "sgl-nb serve")
        if vllm_model is not None and vllm_model[0] != model:
            print(f"note: vLLM serves {vllm_model[0]}, sgl-nb serve {model}")
        sides = [("sgl-nb serve", server.url, name)]
        if vllm_model is not None:
            sides.append(("vLLM-CPU", args.vllm_server.rstrip("/"), vllm_model[1]))
        for turn in range(args.rounds):
            # Prompts new to both servers each round: a repeated one would come from their
            # prefix caches.
            seed = args.seed + turn
            for side, url, served_as in sides:
                print(f"round {turn + 1}: vllm bench serve against {side} ...", flush=True)
                runs.append({"server": side, "round": turn + 1, "seed": seed,
                             **vllm_bench_serve(python, args, url, model, served_as, seed)})
    print_comparison(args, runs)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def print_comparison(args: argparse.Namespace, runs: list[dict]) -> None:
    print(f"\nvllm bench serve: random dataset, {args.input_len} prompt + {args.output_len} "
          f"new tokens (ignore_eos, greedy), {args.num_prompts} requests, "
          f"{args.max_concurrency} in flight, /v1/completions streamed; round k draws its "
          f"prompts with seed {args.seed} + k - 1")
    heads = [f"{r['server']} {r['round']}" for r in runs]
    print(f"{'':<20}" + "".join(f"{h:>16}" for h in heads))
    for key, label in FIGURES:
        print(f"{label:<20}" + "".join(f"{r.get(key, float('nan')):>16.2f}" for r in runs))
    print(f"{'completed / failed':<20}" + "".join(
        f"{str(r['completed']) + ' / ' + str(r['failed']):>16}" for r in runs))
    ours = [r for r in runs if r["server"] == "sgl-nb serve"]
    theirs = [r for r in runs if r["server"] != "sgl-nb serve"]
    for a, b in zip(ours, theirs):  # the same round: the machine's load alike
        print(f"round {a['round']}, sgl-nb serve / vLLM-CPU: " + ", ".join(
            f"{label} {_ratio(a, b, key):.2f}x" for key, label in RATIOS))
    for r in runs:
        errors = sorted({e for e in r.get("errors", []) if e})
        if errors:
            print(f"{r['server']} round {r['round']}: {len(errors)} distinct errors, first: "
                  f"{errors[0][:500]}")


def _ratio(a: dict, b: dict, key: str) -> float:
    return a[key] / b[key] if b.get(key) else float("nan")
