"""The engine's settings, declared once: `sgl.Runtime(**settings)` takes them as keywords,
the Engine and its Scheduler take this dataclass. Every value is checked here, before
anything loads, so a typo fails at once and names the allowed values."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sgl_nb.runtime.model.linear import resolve_dtype

SCHEDULE_POLICIES = ("lpm", "fifo")


@dataclass(frozen=True)
class EngineConfig:
    # A checkpoint folder (a native family, or any decoder-only causal LM transformers
    # runs: runtime/model/load.py), a .gguf file, a hub id already in the
    # local Hugging Face cache, or None for the default model.
    model_path: str | Path | None = None
    kv_pool_tokens: int = 32768  # the KV pool's capacity, in tokens
    max_prefill_tokens: int = 512  # tokens prefilled per step (longer prompts: in chunks)
    max_running: int = 64  # requests decoding together at most
    # Activations and KV cache: "float32", "bfloat16" or "float16"; None picks bf16 on
    # CUDA or with quantization, fp32 otherwise (runtime/model/linear.py resolve_dtype).
    dtype: str | torch.dtype | None = None
    device: str | None = None  # None: CUDA when there is one, else the CPU
    quantization: str | None = None  # None, "int8" or "int4" (weight-only)
    time_slice: int = 8  # decode steps before yielding to waiting higher-priority work
    preemption: bool = True  # False: priorities only order the queue
    starvation_steps: int = 256  # after waiting this long, work runs one top-level slice
    schedule_policy: str = "lpm"  # "lpm": a long queue admits the longest cached prefix first
    # Text a grammar forces (a JSON key, a closing quote) is computed in one extend step
    # and checked against the model's own choices, instead of one decode step a token.
    jump_forward: bool = True
    # Prompt lookup (n-gram speculation): where the output copies its context, the tokens
    # that followed the latest earlier occurrence of its last few tokens are drafted and
    # checked in one step (runtime/prompt_lookup.py; same output, token for token, in every
    # dtype: scheduled_batch.py's decode-shaped check). None: on with fp32 weights, off
    # otherwise. Measured on bench copy's workload (2-core CPU, loaded): fp32 1.7x (same
    # tokens); int4 slower (a checked row costs int4's bf16 kernels about a third of a
    # decode in arithmetic, where an fp32 row rides on the weight read).
    prompt_lookup: bool | None = None
    # Why this token: the k most likely tokens of each step, with what the grammar masked,
    # kept on every request (Request.token_choices, GenerateOutput.tokens, token events).
    # 0: none recorded.
    token_alternatives: int = 5
    # Where every request of a decode step is greedy with nothing between its steps that
    # could change its picks (no grammar, penalties, drafts or step controller), one call
    # of the fused CPU step decodes up to this many tokens ahead over its requests (a batch
    # of B: decode_ahead // B steps), each its greedy pick, and the picker then checks each
    # row as it checks any draft: the same tokens, with the engine's Python between steps
    # paid once for them. A run never takes more steps than a request has generated so
    # far, nor 8 where it has stop strings (runs past one are computed for nothing) or
    # prompt lookup (drafts are proposed between runs); it ends at a stop token, and after
    # its current step once new work arrives. Tokens then stream in runs of up to this
    # many. 1: a step a token.
    decode_ahead: int = 32

    def __post_init__(self) -> None:
        for name in ("kv_pool_tokens", "max_prefill_tokens", "max_running", "time_slice",
                     "starvation_steps", "decode_ahead"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        alts = self.token_alternatives
        if not isinstance(alts, int) or isinstance(alts, bool) or alts < 0:
            raise ValueError(f"token_alternatives must be an integer >= 0, got {alts!r}")
        if not isinstance(self.jump_forward, bool):
            raise ValueError(f"jump_forward must be True or False, got {self.jump_forward!r}")
        if self.prompt_lookup is not None and not isinstance(self.prompt_lookup, bool):
            raise ValueError(f"prompt_lookup must be True, False or None, got "
                             f"{self.prompt_lookup!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got "
                             f"{self.schedule_policy!r}")
        # Resolved once here: a bad dtype or quantization name fails before the model loads.
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.torch_device,
                                                        self.quantization))
        if self.prompt_lookup is None:
            object.__setattr__(self, "prompt_lookup", self.quantization is None
                               and self.dtype == torch.float32)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
