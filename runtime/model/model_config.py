"""The few numbers of a Llama-family checkpoint that the model runner needs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


@dataclass
class ModelConfig:
    architecture: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> ModelConfig:
        arch = (d.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}: sgl-nb runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        # transformers 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama only when attention_bias says so.
            attention_bias=family == "qwen2" or d.get("attention_bias", False),
            rope_theta=float(theta),
            rope_scaling=rope,
            eos_token_ids=eos_ids,
            name=name,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        folder = Path(folder)
        d = json.loads((folder / "config.json").read_text())
        gen = folder / "generation_config.json"
        if gen.is_file():
            # generation_config's eos list (e.g. Llama 3's several stop ids) wins.
            g = json.loads(gen.read_text())
            if g.get("eos_token_id") is not None:
                d["eos_token_id"] = g["eos_token_id"]
        return cls.from_dict(d, name=folder.name)

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, the same float32 values transformers computes."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        kind = self.rope_scaling.get("rope_type") or self.rope_scaling.get("type") or "default"
        if kind == "default":
            return inv
        if kind == "linear":
            return inv / self.rope_scaling["factor"]
        if kind == "llama3":
            return _llama3_inv_freq(inv, self.rope_scaling)
        raise ValueError(f"unsupported rope type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
