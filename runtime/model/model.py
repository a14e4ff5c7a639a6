"""The model runner of the native families over our paged KV pool: Llama's decoder layer,
with what a family changes read from ModelConfig's fields (runtime/model/families.py sets
them): norm offset and post-norms, q/k norms, attention scale and soft-cap, a window and a
rope (or none) per layer, partial rotary, embedding / residual / logit multipliers, the
activation, mixture-of-experts MLPs.

The arithmetic mirrors transformers op for op (fp32 RMSNorm, RoPE as
q*cos + rotate_half(q)*sin, residual order), so greedy tokens match it exactly. On the CPU,
decode steps of every family go through kernels/cpu_decode.cpp's fused step, which reads the
same fields (its Family, built by decode_family below).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from sgl_nb.kernels import cpu_decode, decode_attention, extend_attention, plan_decode, store_kv
from sgl_nb.runtime.kv_pool import KVPool
from sgl_nb.runtime.model.checkpoint import check_shapes, llama_shapes, read_weights
from sgl_nb.runtime.model.forward_batch import AheadLogits, ForwardBatch, greedy_picks
from sgl_nb.runtime.model.layer_spec import Activation, QKNorm
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
from sgl_nb.runtime.model.moe import MoE, expert_linear_weights, moe_from_weights
from sgl_nb.runtime.model.quantize import (
    dequantize,
    form_of,
    quantize,
    quantize_int4,
    weight_shape,
)
from sgl_nb.runtime.model.weight_arena import pack_decode_weights


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


ACTIVATIONS = {Activation.SILU: F.silu, Activation.GELU_TANH: partial(F.gelu, approximate="tanh")}


@dataclass
class Layer:
    attn_norm: torch.Tensor | None  # None: absent (ModelConfig.weights names which exist)
    qkv: Linear  # q, k and v projections fused into one matmul
    o_proj: Linear
    mlp_norm: torch.Tensor | None
    gate_up: Linear | None  # gate and up projections fused; None in a MoE layer
    down: Linear | None
    attn_post_norm: torch.Tensor | None = None
    mlp_post_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    moe: MoE | None = None


def lm_head_quantization(quantization: str, shape: torch.Size) -> str:
    """The LM head's quantization in int8/int4 modes: the mode's own where the kernel takes
    the shape, else int8. Its best candidates are recomputed from 16-bit rows
    (linear.LogitsHead), so the head only ranks them; an int4 head without that refinement
    cost 14 points of greedy agreement with fp32."""
    return quantization if shape_error(*shape, quantization) is None else "int8"


def head_ranker(head: dict[str, torch.Tensor],
                quantization: str) -> dict[str, torch.Tensor] | None:
    """What a decode step ranks the vocabulary with where 16-bit activations have the LM
    head's best candidates recomputed from 16-bit rows (linear.LogitsHead), so that its
    matmul only ranks them: in int4 mode an int4 copy of a head the file holds in another
    form (a GGUF's Q8_0: kept for prefill, scoring and fp32 activations, whose head is
    exact). The head is a decode step's largest read; int4 reads 0.6 of Q8_0's bytes.
    None: the head itself serves."""
    if (quantization != "int4" or form_of(head) == "int4"
            or shape_error(*weight_shape(head), "int4") is not None):
        return None
    return quantize_int4(dequantize(head))


def quantize_weights(
    c: ModelConfig, weights: dict[str, torch.Tensor], quantization: str, blocks=None
) -> dict[str, dict[str, torch.Tensor]]:
    """Each linear layer's quantized form, for the layers whose shape the kernel takes; a
    GGUF's own blocks where `blocks` (gguf_blocks.FileBlocks) has them (quantize.quantize)."""
    out = {}
    for name, weight, _ in linear_weights(c, weights):
        if shape_error(*weight.shape, quantization) is None:
            out[name] = quantize(weight, quantization, blocks)
    head = lm_head_weight(c, weights)
    out["lm_head"] = quantize(head, lm_head_quantization(quantization, head.shape), blocks)
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


def linear_weights(
    c: ModelConfig, weights: dict[str, torch.Tensor], experts: bool = True
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, weight, bias) of every decoder-layer linear as the runner computes it: q/k/v
    and gate/up fused along the output dimension, a MoE layer's experts one by one (unless
    `experts` is False: moe_from_weights builds those)."""
    names = c.weights
    for i in range(c.num_layers):
        layer = f"model.layers.{i}."
        qkv_b = None
        if c.attention_bias:
            qkv_b = torch.cat([weights[layer + n + ".bias"] for n in names.qkv])
        qkv_w = torch.cat([weights[layer + n + ".weight"] for n in names.qkv])
        yield f"layers.{i}.qkv", qkv_w, qkv_b
        att = layer + "self_attn."
        yield f"layers.{i}.o_proj", weights[att + "o_proj.weight"], weights.get(att + "o_proj.bias")
        if c.layers[i].moe:
            if experts:
                yield from expert_linear_weights(weights, layer + "mlp.", f"layers.{i}",
                                                 c.num_experts)
            continue
        gate_up = torch.cat([weights[layer + n + ".weight"] for n in names.gate_up])
        yield f"layers.{i}.gate_up", gate_up, None
        yield f"layers.{i}.down", weights[layer + "mlp.down_proj.weight"], None


def lm_head_weight(c: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    if c.tie_word_embeddings or "lm_head.weight" not in weights:
        return weights["model.embed_tokens.weight"]
    return weights["lm_head.weight"]


class Model:
    path = "native"  # which runner (load.py); TransformersModel's is "transformers"

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
        self.scale = c.attn_scale if c.attn_scale is not None else c.head_dim**-0.5
        self.act = ACTIVATIONS[c.activation]
        # Rounded to the weights' dtype first, as transformers' Gemma does (once, not per step).
        self.embed_scale = torch.tensor(c.embed_scale, dtype=dtype).item()

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        def norm(name: str) -> torch.Tensor | None:
            # Gemma's (1 + w) added in fp32, as transformers does, then cast.
            if not name:
                return None
            weight = weights[name].float()
            return (weight + c.norm_offset if c.norm_offset else weight).to(self.device, dtype)

        self.embed = w("model.embed_tokens.weight")
        self.norm = norm("model.norm.weight")
        linears: dict[str, Linear] = {}
        self.fallbacks: dict[str, str] = {}  # layer name -> why it stayed dense
        # A decode step's pick only ranks the head's logits (its best refined, LogitsHead),
        # so in int4 mode it reads an int4 ranker; an extend (prefill, scoring) the head.
        ranker = None
        if quantized and "lm_head" in quantized and dtype != torch.float32:
            ranker = head_ranker(quantized["lm_head"], quantization)
        if quantized:  # every layer's kernel and shape checked at once, in one probe process
            head_q = lm_head_quantization(quantization, lm_head_weight(c, weights).shape)
            check_kernels([(head_q if name == "lm_head" else quantization, t)
                           for name, t in quantized.items()]
                          + ([("int4", ranker)] if ranker is not None else []), dtype, self.device)
        for name, weight, bias in linear_weights(c, weights, experts=False):
            q = None if quantized is None else quantized.get(name)
            linears[name], why = make_linear(weight, bias, dtype, self.device, quantization, q)
            if why is not None:
                self.fallbacks[name] = why
        self.lm_head, self.decode_head = self._heads(weights, w, quantized, ranker)
        self.layers = [self._layer(i, weights, linears, norm, quantized)
                       for i in range(c.num_layers)]
        if self.fallbacks:
            _warn_fallbacks(self.fallbacks, quantization)
        self.inv_freqs = {spec.rope: spec.rope.inv_freq(c.rotary_dim).to(self.device)
                          for spec in c.layers if spec.rope is not None}
        # What a decode step streams, in one buffer in its order (weight_arena's why).
        self.weight_arena = pack_decode_weights(self.decode_linears()) if (
            self.device.type == "cpu") else None
        self._fused = None  # the fused CPU decode step, built on the first decode

    def _heads(self, weights: dict[str, torch.Tensor], w: Callable[[str], torch.Tensor],
               quantized: dict[str, dict[str, torch.Tensor]] | None,
               ranker: dict[str, torch.Tensor] | None) -> tuple[LogitsHead, LogitsHead]:
        """The LM head, and the one decode steps read: the same one but where an int4
        `ranker` stands in (head_ranker)."""
        c, dtype, quantization = self.config, self.dtype, self.quantization
        head = lm_head_weight(c, weights)
        # Tied: the embedding's copy serves as the head's 16-bit weight too.
        head16 = self.embed if head is weights["model.embed_tokens.weight"] else w("lm_head.weight")
        refine = None if dtype == torch.float32 else head16
        if quantization is None:
            exact = LogitsHead(DenseLinear(head16), refine)
            return exact, exact
        q = None if quantized is None else quantized.get("lm_head")
        linear, why = make_linear(head, None, dtype, self.device,
                                  lm_head_quantization(quantization, head.shape), q, dense=head16)
        if why is not None:
            self.fallbacks["lm_head"] = why
        exact = LogitsHead(linear, refine)
        if ranker is None:
            return exact, exact
        linear, why = make_linear(head, None, dtype, self.device, "int4", ranker, dense=head16)
        return exact, (exact if why is not None else LogitsHead(linear, refine))

    def _layer(self, i: int, weights, linears: dict[str, Linear], norm, quantized) -> Layer:
        c, names, prefix = self.config, self.config.weights, f"model.layers.{i}."
        layer = Layer(
            attn_norm=norm(names.attn_norm and prefix + names.attn_norm + ".weight"),
            qkv=linears[f"layers.{i}.qkv"],
            o_proj=linears[f"layers.{i}.o_proj"],
            mlp_norm=norm(names.mlp_norm and prefix + names.mlp_norm + ".weight"),
            gate_up=linears.get(f"layers.{i}.gate_up"),
            down=linears.get(f"layers.{i}.down"),
            attn_post_norm=norm(names.attn_post_norm and prefix + names.attn_post_norm + ".weight"),
            mlp_post_norm=norm(names.mlp_post_norm and prefix + names.mlp_post_norm + ".weight"),
        )
        if c.qk_norm is not QKNorm.NONE:
            layer.q_norm = norm(prefix + names.q_norm + ".weight")
            layer.k_norm = norm(prefix + names.k_norm + ".weight")
        if c.layers[i].moe:
            layer.moe, why = moe_from_weights(
                weights, prefix + "mlp.", f"layers.{i}", c.num_experts, c.top_k,
                c.norm_topk_prob, self.dtype, self.device, self.quantization, quantized,
                self.act)
            self.fallbacks.update(why)
        return layer

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
        check_shapes(llama_shapes(config, weights), weights, folder)
        quantized = None
        if quantization is not None:
            quantized = load_quantized(
                folder, quantization,
                lambda blocks: quantize_weights(config, weights, quantization, blocks),
            )
        return cls(config, weights, dtype, device, quantization, quantized)

    def new_kv_pool(self, num_slots: int) -> KVPool:
        """Head-major where the fused CPU step reads it (KVPool._buffer says why); the torch
        path's index ops take either."""
        c = self.config
        return KVPool(c.num_layers, num_slots, c.num_kv_heads, c.head_dim, self.dtype, self.device,
                      head_major=self._fused_decode() is not None)

    def forward(self, batch: ForwardBatch, pool: KVPool):
        """Float32 logits at batch.logits_at, [B, vocab]; with score_rows, also theirs."""
        fused = self._fused_decode()
        if fused is None:
            return self._forward_layers(batch, pool)
        if not batch.is_decode:
            return self._forward_extend(fused, batch, pool)
        # Outside inference mode: the step is one C++ call that records no autograd, and
        # entering and leaving the mode cost ~30 us of a decode step's Python (its code is
        # out of cache after the step's weight reads).
        rows = fused.logits(
            batch.input_ids, batch.positions, batch.kv_indptr, batch.kv_indices,
            batch.out_cache_loc, pool.k_buffers, pool.v_buffers, self.scale,
        )
        if batch.score_rows is None and batch.logits_at.numel() == rows.shape[0]:
            return rows  # a decode step: a row per request
        last = rows[batch.logits_at]
        return last if batch.score_rows is None else (last, rows[batch.score_rows])

    def forward_ahead(self, batch: ForwardBatch, pool: KVPool, stop_ids: list[int],
                      mark: int = 0, alternatives: int = 0) -> AheadLogits:
        """Up to batch.ahead decode steps (ForwardBatch), each request's later inputs its
        greedy picks, ending early once every pick is one of stop_ids, or (the fused step)
        once interrupt_ahead was called after ahead_mark() gave `mark`: on CPU one C++
        call, so that no Python runs between the steps. alternatives > 0: the fused step
        also gives each row's that many best entries and its logsumexp, where it can."""
        fused = self._fused_decode()
        if fused is not None:
            return AheadLogits(*fused.logits_ahead(
                batch.input_ids, batch.positions, batch.kv_indptr, batch.kv_indices,
                pool.k_buffers, pool.v_buffers, self.scale, batch.ahead, stop_ids, mark,
                alternatives))
        rows, picks, ids = [], [], batch.input_ids
        for s in range(batch.ahead):
            rows.append(self.forward(batch.step_of(s, ids), pool))
            if s + 1 < batch.ahead:
                ids = greedy_picks(rows[-1])
                picks.append(ids)
                if set(ids.tolist()) <= set(stop_ids):
                    break
        empty = torch.empty((0, batch.batch_size), dtype=torch.int64, device=ids.device)
        return AheadLogits(torch.stack(rows), torch.stack(picks) if picks else empty)

    @torch.inference_mode()
    def _forward_extend(self, fused, batch: ForwardBatch, pool: KVPool):
        """An extend (a prompt or a chunk of one, drafts to verify) where decode steps take
        the fused step: through its layers, so that a token's KV has the bits a decode step
        gives it (one path for every token: which one a prompt's tokens took must not depend
        on its length or batch), then the extend's LM head as _forward_layers applies it.
        One C++ call: the torch loop's ~15 ops a layer were a fifth of a short prompt's
        time."""
        first, ends = batch.token_ranges()
        rows = batch.logits_at
        if batch.score_rows is not None:
            rows = torch.cat([rows, batch.score_rows])
        h = fused.hidden(batch.input_ids, batch.positions, first, ends, batch.kv_indices,
                         batch.out_cache_loc, pool.k_buffers, pool.v_buffers, self.scale, rows)
        n = batch.logits_at.numel()
        last = self._logits(h[:n], self.lm_head)
        return last if batch.score_rows is None else (last, self._logits(h[n:], self.lm_head))

    @torch.inference_mode()
    def _forward_layers(self, batch: ForwardBatch, pool: KVPool):
        """forward through the torch layer loop (where the fused step is not used)."""
        # The residual stream is fp32 in every mode (.float() is a no-op in fp32 mode): in
        # 16-bit modes that rounds less and agrees better with fp32 (README, Precision
        # modes); rms_norm hands the matmuls their 16-bit input.
        c = self.config
        h = self.embed[batch.input_ids].float()
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        ropes = {rope: rope_tables(batch.positions, inv, self.dtype)
                 for rope, inv in self.inv_freqs.items()}
        plans: dict[int | None, object] = {}
        if batch.is_decode:  # one gather plan per window, shared by that window's layers
            for window in {spec.window for spec in c.layers}:
                plans[window] = plan_decode(batch.kv_indptr, batch.kv_indices, c.num_kv_heads,
                                            c.num_heads, batch.max_kv_len, window)
        for i, layer in enumerate(self.layers):
            spec = c.layers[i]
            rope = None if spec.rope is None else ropes[spec.rope]
            x = self._norm(h, layer.attn_norm)
            x = self._attention(i, layer, x, rope, batch, pool, plans.get(spec.window))
            h = self._residual(h, self._post_norm(x, layer.attn_post_norm))
            x = self._norm(h, layer.mlp_norm)
            if layer.moe is not None:
                x = layer.moe(x)
            else:
                gate, up = layer.gate_up(x).chunk(2, dim=-1)
                x = layer.down(self.act(gate) * up)
            h = self._residual(h, self._post_norm(x, layer.mlp_post_norm))
        head = self.decode_head if batch.is_decode else self.lm_head
        last = self._logits(h[batch.logits_at], head)
        if batch.score_rows is None:
            return last
        return last, self._logits(h[batch.score_rows], head)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:  # no norm here: the next matmul still takes the model's dtype
            return x.to(self.dtype)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _post_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else rms_norm(x, weight, self.config.rms_norm_eps)

    def _residual(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        scale = self.config.residual_scale
        return h + (x if scale == 1.0 else x * scale)

    def decode_linears(self) -> list[Linear]:
        """The dense linears a decode step runs, in its order (each layer's qkv, o, gate_up
        and down, then the decode head's); a MoE layer's experts are left out (which run
        depends on routing)."""
        return [x for layer in self.layers
                for x in (layer.qkv, layer.o_proj, layer.gate_up, layer.down) if x is not None
                ] + [self.decode_head.linear]

    def decode_read_bytes(self) -> int:
        """Bytes of weights one decode step reads per token (batch 1): every linear layer
        as its kernel holds it (scales and mins included), the norms, the LM head (and
        the 16-bit rows its refinement reads), one embedding row; in a MoE layer the router
        and top_k experts. The floor of `sgl-nb bench engine` divides it by a bandwidth."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        total = size(self.norm) + self.embed.shape[1] * self.embed.element_size()
        for layer in self.layers:
            linears = [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
            if layer.moe is not None:
                total += size(layer.moe.router)
                linears += [x for pair in layer.moe.experts[:layer.moe.top_k] for x in pair]
            total += sum(x.read_bytes for x in linears if x is not None)
            total += sum(size(t) for t in (layer.attn_norm, layer.mlp_norm, layer.attn_post_norm,
                                            layer.mlp_post_norm, layer.q_norm, layer.k_norm))
        head = self.decode_head
        total += head.linear.read_bytes
        if head.weight16 is not None:
            total += head.refine * head.weight16.shape[1] * head.weight16.element_size()
        return total

    def decode_phase_seconds(self) -> dict[str, float] | None:
        """Seconds the fused CPU decode step spent in each of its phases (matmuls,
        attention, norms, ...) since the last call, then zeroed; None without that step."""
        fused = self._fused_decode()
        return None if fused is None else dict(fused.phase_seconds())

    def ahead_mark(self) -> int:
        """The count of interrupt_ahead calls so far (forward_ahead's `mark`)."""
        return self._fused.interrupts() if self._fused else 0

    def interrupt_ahead(self) -> None:
        """From any thread: a forward_ahead given an earlier mark ends after its current
        step (work waits that the engine schedules between steps)."""
        fused = self._fused
        if fused:
            fused.interrupt()

    def fused_decode_ready(self) -> bool:
        """Whether steps take the fused CPU path (decode steps, and the layers of extends),
        building it if needed."""
        return self._fused_decode() is not None

    def use_fused_decode(self, step: bool | object = True) -> None:
        """Which path steps take. True (the default): the fused CPU step, built on the next
        step where it is usable (see _fused_decode); False: the torch layer loop, always; a
        cpu_decode DecodeStep (fused_step's): that one. Tests compare the paths this way."""
        self._fused = None if step is True else step

    def _fused_decode(self):
        """kernels/cpu_decode.cpp's decode step (token ids to logits) for this model, or
        None where the torch path runs (CUDA, float16, head_dim not a multiple of 8,
        SGL_NB_CPU_DECODE=0, no compiler)."""
        if self._fused is None:
            self._fused = False
            usable = (self.device.type == "cpu" and self.config.head_dim % 8 == 0
                      and self.dtype in (torch.float32, torch.bfloat16))
            if usable and cpu_decode.available():
                self._fused = fused_step(cpu_decode.load(), self)
        return self._fused or None

    def _logits(self, h: torch.Tensor, head: LogitsHead) -> torch.Tensor:
        c = self.config
        logits = head(rms_norm(h, self.norm, c.rms_norm_eps))
        if c.logits_scaling != 1.0:
            logits = logits / c.logits_scaling
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    def _attention(self, i, layer: Layer, h, rope, batch: ForwardBatch, pool: KVPool, plan):
        c, spec = self.config, self.config.layers[i]
        T, hq, hkv, d = h.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qkv = layer.qkv(h)
        if c.qk_norm is QKNorm.NONE:
            qk = qkv[:, : self.q_size + self.kv_size].view(T, hq + hkv, d)
        else:
            qk = self._qk_norm(layer, qkv, T)
        if rope is not None:
            qk = self._rotate(qk, *rope)
        q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[:, self.q_size + self.kv_size :].view(T, hkv, d)
        kb, vb = pool.k_buffers[i], pool.v_buffers[i]
        store_kv(kb, vb, batch.out_cache_loc, k, v)
        if batch.is_decode:
            o = decode_attention(
                q, kb, vb, batch.kv_indptr, batch.kv_indices, self.scale, batch.max_kv_len, plan,
                window=spec.window, softcap=c.attn_softcap,
            )
        else:
            o = extend_attention(
                q, kb, vb, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, self.scale,
                batch.max_kv_len, window=spec.window, softcap=c.attn_softcap,
            )
        return layer.o_proj(o.reshape(T, self.q_size))

    def _qk_norm(self, layer: Layer, qkv: torch.Tensor, T: int) -> torch.Tensor:
        """q and k normed (per head, or over the whole projection), as [T, Hq + Hkv, D]."""
        c, eps = self.config, self.config.rms_norm_eps
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        if c.qk_norm is QKNorm.WHOLE:
            q, k = rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)
        q = q.reshape(T, c.num_heads, c.head_dim)
        k = k.reshape(T, c.num_kv_heads, c.head_dim)
        if c.qk_norm is QKNorm.PER_HEAD:
            q, k = rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)
        return torch.cat([q, k], dim=1)

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dim = self.config.rotary_dim
        if dim == qk.shape[-1]:
            return apply_rope(qk, cos, sin)
        # Partial rotary (Phi-3/4): the first `dim` dims of each head turn, the rest pass.
        return torch.cat([apply_rope(qk[..., :dim], cos, sin), qk[..., dim:]], dim=-1)


def _linear_spec(layer: Linear | None) -> tuple[int, list[torch.Tensor]]:
    """(kind, tensors) as cpu_decode.cpp's LinearSpec takes them: the bias last, empty
    tensors for what is absent (a MoE layer's dense MLP: all of it)."""
    none = torch.empty(0)
    if layer is None:
        return 0, [none, none]
    bias = none if layer.bias is None else layer.bias
    if isinstance(layer, Int8Linear):
        return 1, [layer.qweight if layer.panels is None else layer.panels, layer.scale, bias]
    if isinstance(layer, Int4Linear):
        small = layer.small or (none, none, none)
        return 2, [layer.packed, layer.scale_zeros, *small, bias]
    return 0, [layer.weight if layer.panels is None else layer.panels, bias]


def fused_step(module, model: Model, family=None):
    """cpu_decode.cpp's DecodeStep of `model`; `family` (a module.Family) replaces what its
    config says (tests build the plain Llama step of another family this way)."""
    c, head = model.config, model.decode_head
    none = torch.empty(0, dtype=model.dtype)
    norms, specs = [], []
    for layer in model.layers:
        norms += [none if n is None else n for n in (layer.attn_norm, layer.mlp_norm)]
        specs += [_linear_spec(x) for x in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    kinds, tensors = (list(x) for x in zip(*specs))
    head_kind, head_tensors = _linear_spec(head.linear)
    head16 = torch.empty(0) if head.weight16 is None else head.weight16
    return module.DecodeStep(
        norms, kinds, tensors, model.embed, model.norm, head_kind, head_tensors, head16,
        head.refine, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
        decode_family(module, model) if family is None else family,
    )


# cpu_layer_ops.h's Activation and cpu_decode.cpp's QKNorm, by value.
_ACTIVATION_CODES = {Activation.SILU: 0, Activation.GELU_TANH: 1}
_QK_NORM_CODES = {QKNorm.NONE: 0, QKNorm.PER_HEAD: 1, QKNorm.WHOLE: 2}


def decode_family(module, model: Model):
    """ModelConfig's differences from Llama as cpu_decode.cpp's Family takes them (its enums
    by value, empty tensors for what a layer lacks)."""
    c, f = model.config, module.Family()
    none = torch.empty(0, dtype=model.dtype)

    def pairs(get) -> list[torch.Tensor]:
        return [none if t is None else t for layer in model.layers for t in get(layer)]

    f.windows = [spec.window or 0 for spec in c.layers]
    f.attn_softcap = c.attn_softcap or 0.0
    if any(layer.attn_post_norm is not None or layer.mlp_post_norm is not None
           for layer in model.layers):
        f.post_norms = pairs(lambda layer: (layer.attn_post_norm, layer.mlp_post_norm))
    f.qk_norm = _QK_NORM_CODES[c.qk_norm]
    if c.qk_norm is not QKNorm.NONE:
        f.qk_norms = pairs(lambda layer: (layer.q_norm, layer.k_norm))
    ropes = list(model.inv_freqs)
    f.inv_freqs = [model.inv_freqs[rope].float().contiguous() for rope in ropes]
    f.rope_of_layer = [-1 if spec.rope is None else ropes.index(spec.rope) for spec in c.layers]
    f.rotary_dim = c.rotary_dim
    f.activation = _ACTIVATION_CODES[c.activation]
    f.embed_scale, f.residual_scale = model.embed_scale, c.residual_scale
    f.logits_scaling, f.final_softcap = c.logits_scaling, c.final_softcap or 0.0
    if any(layer.moe is not None for layer in model.layers):
        f.routers = [none if layer.moe is None else layer.moe.router for layer in model.layers]
        experts = [[_linear_spec(x) for pair in (layer.moe.experts if layer.moe else [])
                    for x in pair] for layer in model.layers]
        f.expert_kinds = [[kind for kind, _ in layer] for layer in experts]
        f.expert_tensors = [[ts for _, ts in layer] for layer in experts]
        f.top_k = c.top_k
        f.norm_topk_prob = c.norm_topk_prob
    return f
