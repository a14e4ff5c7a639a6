"""Llama-family model runner (Llama 2/3, SmolLM2, TinyLlama, Qwen2) over our paged KV pool.

The arithmetic mirrors transformers' LlamaForCausalLM op for op (fp32 RMSNorm, RoPE as
q*cos + rotate_half(q)*sin, residual order), so greedy tokens match it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sgl_nb import kernels
from sgl_nb.runtime.forward_batch import ForwardBatch
from sgl_nb.runtime.kv_pool import KVPool
from sgl_nb.runtime.linear import DenseLinear
from sgl_nb.runtime.model_config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's fused F.rms_norm is slower than this on CPU at decode sizes (measured).
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin, [T, 1, D], for apply_rope (computed as transformers does)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    half = inv_freq.numel()
    sin = emb.sin()
    sin[..., :half].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # rotate_half(x) * sin == roll(x, half) * [-sin1, sin2] exactly (negation is exact),
    # in two ops instead of four.
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: DenseLinear  # q, k and v projections fused into one matmul
    o_proj: DenseLinear
    post_norm: torch.Tensor
    gate_up: DenseLinear  # gate and up projections fused
    down: DenseLinear


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


class Model:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        c = config
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        lm = "lm_head.weight"
        self.lm_head = self.embed if c.tie_word_embeddings or lm not in weights else w(lm)
        self.layers = [self._layer(w, weights, i) for i in range(c.num_layers)]
        self.inv_freq = c.inv_freq().to(self.device)

    def _layer(self, w, weights: dict, i: int) -> Layer:
        p = f"model.layers.{i}."
        att, mlp = p + "self_attn.", p + "mlp."
        qkv_w = torch.cat([w(att + f"{n}_proj.weight") for n in "qkv"])
        qkv_b = None
        if self.config.attention_bias:
            qkv_b = torch.cat([w(att + f"{n}_proj.bias") for n in "qkv"])
        o_b = w(att + "o_proj.bias") if att + "o_proj.bias" in weights else None
        return Layer(
            input_norm=w(p + "input_layernorm.weight"),
            qkv=DenseLinear(qkv_w, qkv_b),
            o_proj=DenseLinear(w(att + "o_proj.weight"), o_b),
            post_norm=w(p + "post_attention_layernorm.weight"),
            gate_up=DenseLinear(
                torch.cat([w(mlp + "gate_proj.weight"), w(mlp + "up_proj.weight")])
            ),
            down=DenseLinear(w(mlp + "down_proj.weight")),
        )

    @classmethod
    def load(cls, folder: Path, dtype=torch.float32, device="cpu") -> Model:
        return cls(ModelConfig.from_folder(folder), read_weights(folder), dtype, device)

    def new_kv_pool(self, num_slots: int) -> KVPool:
        c = self.config
        return KVPool(c.num_layers, num_slots, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool):
        """Float32 logits at batch.logits_at, [B, vocab]; with score_rows, also theirs."""
        h = self.embed[batch.input_ids]
        cos, sin = rope_tables(batch.positions, self.inv_freq, self.dtype)
        plan = None
        if batch.is_decode:
            c = self.config
            plan = kernels.plan_decode(
                batch.kv_indptr, batch.kv_indices, c.num_kv_heads, c.num_heads, batch.max_kv_len
            )
        eps = self.config.rms_norm_eps
        for i, layer in enumerate(self.layers):
            residual = h
            h = rms_norm(h, layer.input_norm, eps)
            h = self._attention(i, layer, h, cos, sin, batch, pool, plan)
            h = residual + h
            residual = h
            h = rms_norm(h, layer.post_norm, eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            h = residual + layer.down(F.silu(gate) * up)
        last = self._logits(h[batch.logits_at])
        if batch.score_rows is None:
            return last
        return last, self._logits(h[batch.score_rows])

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h, self.norm, self.config.rms_norm_eps)
        return F.linear(h, self.lm_head).float()

    def _attention(self, i, layer: Layer, h, cos, sin, batch: ForwardBatch, pool: KVPool, plan):
        c = self.config
        T = h.shape[0]
        qkv = layer.qkv(h)
        qk = qkv[:, : self.q_size + self.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(T, c.num_kv_heads, c.head_dim)
        kb, vb = pool.k_buffers[i], pool.v_buffers[i]
        kernels.store_kv(kb, vb, batch.out_cache_loc, k, v)
        if batch.is_decode:
            o = kernels.decode_attention(
                q, kb, vb, batch.kv_indptr, batch.kv_indices, self.scale, batch.max_kv_len, plan
            )
        else:
            o = kernels.extend_attention(
                q, kb, vb, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, self.scale,
                batch.max_kv_len,
            )
        return layer.o_proj(o.reshape(T, self.q_size))
