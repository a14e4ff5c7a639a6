"""Llama-family model runner (Llama 2/3, SmolLM2, TinyLlama, Qwen2) over our paged KV pool.

The arithmetic mirrors transformers' LlamaForCausalLM op for op (fp32 RMSNorm, RoPE as
q*cos + rotate_half(q)*sin, residual order), so greedy tokens match it exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sgl_nb.kernels import cpu_decode, decode_attention, extend_attention, plan_decode, store_kv
from sgl_nb.runtime.kv_pool import KVPool
from sgl_nb.runtime.model.forward_batch import ForwardBatch
from sgl_nb.runtime.model.linear import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    LogitsHead,
    check_kernels,
    check_quantization,
    make_linear,
    resolve_dtype,
    shape_error,
)
from sgl_nb.runtime.model.model_config import ModelConfig
from sgl_nb.runtime.model.model_loader import load_quantized
from sgl_nb.runtime.model.quantize import quantize


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's fused F.rms_norm is slower than this on CPU at decode sizes (measured).
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    # The weight's dtype, not x's: with 16-bit weights and the fp32 residual stream the
    # norm hands the next matmul its 16-bit input in the same op (fp32: the same thing).
    return weight * h.to(weight.dtype)


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
    qkv: Linear  # q, k and v projections fused into one matmul
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up projections fused
    down: Linear


def lm_head_quantization(quantization: str, shape: torch.Size) -> str:
    """The LM head's quantization in int8/int4 modes: the mode's own where the kernel takes
    the shape, else int8. Its best candidates are recomputed from 16-bit rows
    (linear.LogitsHead), so the head only ranks them; an int4 head without that refinement
    cost 14 points of greedy agreement with fp32."""
    return quantization if shape_error(*shape, quantization) is None else "int8"


def quantize_weights(
    c: ModelConfig, weights: dict[str, torch.Tensor], quantization: str
) -> dict[str, dict[str, torch.Tensor]]:
    """Each linear layer's quantized form, for the layers whose shape the kernel takes."""
    out = {}
    for name, weight, _ in linear_weights(c, weights):
        if shape_error(*weight.shape, quantization) is None:
            out[name] = quantize(weight, quantization)
    head = lm_head_weight(c, weights)
    out["lm_head"] = quantize(head, lm_head_quantization(quantization, head.shape))
    return out


def _warn_fallbacks(fallbacks: dict[str, str], quantization: str | None) -> None:
    by_reason: dict[str, list[str]] = {}
    for name, why in fallbacks.items():
        by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        warnings.warn(
            f"{quantization}: {len(names)} linear layer(s) stay dense ({shown}): {why}",
            stacklevel=3,
        )


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def linear_weights(
    c: ModelConfig, weights: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, weight, bias) of every decoder-layer linear as the runner computes it: q/k/v
    and gate/up fused along the output dimension."""
    for i in range(c.num_layers):
        att, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv_b = None
        if c.attention_bias:
            qkv_b = torch.cat([weights[att + f"{n}_proj.bias"] for n in "qkv"])
        qkv_w = torch.cat([weights[att + f"{n}_proj.weight"] for n in "qkv"])
        yield f"layers.{i}.qkv", qkv_w, qkv_b
        yield f"layers.{i}.o_proj", weights[att + "o_proj.weight"], weights.get(att + "o_proj.bias")
        gate_up = torch.cat([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]])
        yield f"layers.{i}.gate_up", gate_up, None
        yield f"layers.{i}.down", weights[mlp + "down_proj.weight"], None


def lm_head_weight(c: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    if c.tie_word_embeddings or "lm_head.weight" not in weights:
        return weights["model.embed_tokens.weight"]
    return weights["lm_head.weight"]


class Model:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantization: str | None = None,
        quantized: dict[str, dict[str, torch.Tensor]] | None = None,
    ):
        """`quantized` holds, for int8/int4, each linear layer's quantized form by name
        (see linear_weights; a layer absent from it stays dense)."""
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.quantization = check_quantization(quantization)
        c = config
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        linears: dict[str, Linear] = {}
        self.fallbacks: dict[str, str] = {}  # layer name -> why it stayed dense
        if quantized:  # every layer's kernel and shape checked at once, in one probe process
            head_q = lm_head_quantization(quantization, lm_head_weight(c, weights).shape)
            check_kernels([(head_q if name == "lm_head" else quantization, t)
                           for name, t in quantized.items()], dtype, self.device)
        for name, weight, bias in linear_weights(c, weights):
            q = None if quantized is None else quantized.get(name)
            linears[name], why = make_linear(weight, bias, dtype, self.device, quantization, q)
            if why is not None:
                self.fallbacks[name] = why
        head = lm_head_weight(c, weights)
        # Tied: the embedding's copy serves as the head's 16-bit weight too.
        head16 = self.embed if head is weights["model.embed_tokens.weight"] else w("lm_head.weight")
        if quantization is None:
            head_linear: Linear = DenseLinear(head16)
        else:
            q = None if quantized is None else quantized.get("lm_head")
            head_linear, why = make_linear(
                head, None, dtype, self.device, lm_head_quantization(quantization, head.shape), q,
                dense=head16,
            )
            if why is not None:
                self.fallbacks["lm_head"] = why
        if self.fallbacks:
            _warn_fallbacks(self.fallbacks, quantization)
        self.lm_head = LogitsHead(head_linear, None if dtype == torch.float32 else head16)
        self.layers = [
            Layer(
                input_norm=w(f"model.layers.{i}.input_layernorm.weight"),
                qkv=linears[f"layers.{i}.qkv"],
                o_proj=linears[f"layers.{i}.o_proj"],
                post_norm=w(f"model.layers.{i}.post_attention_layernorm.weight"),
                gate_up=linears[f"layers.{i}.gate_up"],
                down=linears[f"layers.{i}.down"],
            )
            for i in range(c.num_layers)
        ]
        self.inv_freq = c.inv_freq().to(self.device)
        self._fused = None  # the fused CPU decode step, built on the first decode


    @classmethod
    def load(
        cls,
        folder: Path,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str = "cpu",
        quantization: str | None = None,
    ) -> Model:
        """dtype None: bf16 on CUDA or with quantization, else fp32. int8/int4 weights are
        quantized once and kept in the cache folder (model_loader.load_quantized)."""
        quantization = check_quantization(quantization)
        dtype = resolve_dtype(dtype, device, quantization)
        config = ModelConfig.from_folder(folder)
        weights = read_weights(folder)
        quantized = None
        if quantization is not None:
            quantized = load_quantized(
                folder, quantization, lambda: quantize_weights(config, weights, quantization)
            )
        return cls(config, weights, dtype, device, quantization, quantized)

    def new_kv_pool(self, num_slots: int) -> KVPool:
        c = self.config
        return KVPool(c.num_layers, num_slots, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool):
        """Float32 logits at batch.logits_at, [B, vocab]; with score_rows, also theirs."""
        fused = self._fused_decode() if batch.is_decode else None
        if fused is not None:  # decode: one token per request, each row's logits
            return fused.logits(
                batch.input_ids, batch.positions, batch.kv_indptr, batch.kv_indices,
                batch.out_cache_loc, pool.k_buffers, pool.v_buffers, self.scale,
            )
        # The residual stream is fp32 in every mode (.float() is a no-op in fp32 mode): in
        # 16-bit modes that rounds less and agrees better with fp32 (README, Precision
        # modes); rms_norm hands the matmuls their 16-bit input.
        h = self.embed[batch.input_ids].float()
        cos, sin = rope_tables(batch.positions, self.inv_freq, self.dtype)
        plan = None
        if batch.is_decode:
            c = self.config
            plan = plan_decode(
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

    def fused_decode_ready(self) -> bool:
        """Whether decode steps take the fused CPU path (building it if needed)."""
        return self._fused_decode() is not None

    def _fused_decode(self):
        """kernels/cpu_decode.cpp's decode step (token ids to logits) for this model, or
        None where the torch path runs (CUDA, float16, head_dim not a multiple of 8,
        SGL_NB_CPU_DECODE=0, no compiler)."""
        if self._fused is None:
            self._fused = False
            usable = (self.device.type == "cpu" and self.config.head_dim % 8 == 0
                      and self.dtype in (torch.float32, torch.bfloat16))
            if usable and cpu_decode.available():
                self._fused = _fused_step(cpu_decode.load(), self)
        return self._fused or None

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h, self.norm, self.config.rms_norm_eps)
        return self.lm_head(h)

    def _attention(self, i, layer: Layer, h, cos, sin, batch: ForwardBatch, pool: KVPool, plan):
        c = self.config
        T = h.shape[0]
        qkv = layer.qkv(h)
        qk = qkv[:, : self.q_size + self.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(T, c.num_kv_heads, c.head_dim)
        kb, vb = pool.k_buffers[i], pool.v_buffers[i]
        store_kv(kb, vb, batch.out_cache_loc, k, v)
        if batch.is_decode:
            o = decode_attention(
                q, kb, vb, batch.kv_indptr, batch.kv_indices, self.scale, batch.max_kv_len, plan
            )
        else:
            o = extend_attention(
                q, kb, vb, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, self.scale,
                batch.max_kv_len,
            )
        return layer.o_proj(o.reshape(T, self.q_size))


def _linear_spec(layer: Linear) -> tuple[int, list[torch.Tensor]]:
    """(kind, tensors) as cpu_decode.cpp's LinearSpec takes them: the bias last, empty
    tensors for what is absent."""
    none = torch.empty(0)
    bias = none if layer.bias is None else layer.bias
    if isinstance(layer, Int8Linear):
        return 1, [layer.qweight if layer.panels is None else layer.panels, layer.scale, bias]
    if isinstance(layer, Int4Linear):
        small = layer.small or (none, none, none)
        return 2, [layer.packed, layer.scale_zeros, *small, bias]
    return 0, [layer.weight if layer.panels is None else layer.panels, bias]


def _fused_step(module, model: Model):
    c, head = model.config, model.lm_head
    norms, specs = [], []
    for layer in model.layers:
        norms += [layer.input_norm, layer.post_norm]
        specs += [_linear_spec(x) for x in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    kinds, tensors = (list(x) for x in zip(*specs))
    head_kind, head_tensors = _linear_spec(head.linear)
    head16 = torch.empty(0) if head.weight16 is None else head.weight16
    return module.DecodeStep(
        norms, kinds, tensors, model.embed, model.inv_freq.float().contiguous(), model.norm,
        head_kind, head_tensors, head16, head.refine,
        c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
    )
