"""The parts of a decoder layer that differ between families, as frozen values: its rotary
embedding, window and MLP kind (LayerSpec), its checkpoint names (WeightNames), its q/k norm
and activation. model_config.py holds one per layer; families.py builds them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch


class QKNorm(Enum):
    NONE = "none"
    PER_HEAD = "per_head"  # RMSNorm over each head's head_dim (Qwen3, Gemma 3)
    WHOLE = "whole"  # RMSNorm over the whole q / k projection, before the head split (OLMo 2)


class Activation(Enum):
    SILU = "silu"
    GELU_TANH = "gelu_tanh"  # Gemma's gelu_pytorch_tanh


ROPE_TYPES = ("default", "linear", "llama3")  # what Rope.inv_freq computes


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: its base and transformers' rope_parameters (type, factor...)."""

    theta: float
    scaling: tuple[tuple[str, object], ...] = ()  # frozen: layers share it and it keys a cache

    @classmethod
    def of(cls, theta: float, scaling: dict | None = None) -> Rope:
        params = {k: tuple(v) if isinstance(v, list) else v for k, v in (scaling or {}).items()
                  if k not in ("rope_theta", "partial_rotary_factor")}
        return cls(float(theta), tuple(sorted(params.items())))

    def inv_freq(self, dim: int) -> torch.Tensor:
        """Inverse frequencies over `dim` rotary dims, the float32 values transformers has."""
        p = dict(self.scaling)
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        kind = p.get("rope_type") or p.get("type") or "default"
        if kind == "default":
            return inv
        if kind == "linear":
            return inv / p["factor"]
        if kind == "llama3":
            return _llama3_inv_freq(inv, p)
        raise ValueError(f"unsupported rope type {kind!r} (supported: {', '.join(ROPE_TYPES)})")


@dataclass(frozen=True)
class LayerSpec:
    window: int | None = None  # sliding window (a query sees the last `window` positions)
    rope: Rope | None = None  # None: this layer has no rotary embedding (SmolLM3's NoPE)
    moe: bool = False  # the MLP is a routed mixture of experts (runtime/model/moe.py)


@dataclass(frozen=True)
class WeightNames:
    """Per-layer checkpoint names (under model.layers.{i}.) of the runner's parts; a norm
    named "" is absent. Lists of names are fused along the output dimension in order."""

    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    attn_norm: str = "input_layernorm"  # before attention
    attn_post_norm: str = ""  # on attention's output, before the residual add
    mlp_norm: str = "post_attention_layernorm"  # before the MLP (Llama's confusing name)
    mlp_post_norm: str = ""  # on the MLP's output, before the residual add
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"


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

