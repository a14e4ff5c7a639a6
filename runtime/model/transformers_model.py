"""Any decoder-only causal LM of the installed transformers, run on our paged KV pool.

transformers' own modeling code computes everything but attention. Attention is ours,
registered through transformers' AttentionInterface under ATTENTION_NAME: it writes each
layer's new K/V into our KVPool (store_kv) and attends over the request's slots with the
kernels the native runner uses (decode_attention / extend_attention). The engine's
scheduling, radix cache, fork, grammar and tracing therefore work unchanged on these models.

A step runs the model on [1, T]: the batch's flattened new tokens, our positions as
position_ids, no attention mask and no transformers cache (use_cache=False). Our attention
name is not one of transformers' mask functions (AttentionMaskInterface), so it builds no
causal mask of its own (masking_utils._preprocess_mask_arguments returns None): the kernels'
causal rule over each request's slots is the only mask. The step (batch and pool) reaches
the attention function through a context variable set for the duration of one forward.

What each layer's attention looks like (KV heads, head size, sliding window, soft-cap) is
learned by running the loaded model once on one token with a recording attention function
(_probe): whatever the modeling code passes is what our kernels get. That run also
refuses what this path cannot serve: layers that never call attention (state-space,
convolution, recurrent: hybrids), bidirectional attention (encoders), K and V of different
sizes (latent attention), attention sinks.
"""

from __future__ import annotations

import contextvars
import inspect
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sgl_nb.kernels import decode_attention, extend_attention, plan_decode, store_kv
from sgl_nb.runtime.kv_pool import KVPool
from sgl_nb.runtime.model.checkpoint import read_config
from sgl_nb.runtime.model.forward_batch import ForwardBatch
from sgl_nb.runtime.model.linear import check_quantization, resolve_dtype
from sgl_nb.runtime.model.transformers_linear import quantize_linears

ATTENTION_NAME = "sgl_nb_paged"

# Config fields that list what each layer is, and the entries meaning "an attention layer".
LAYER_PATTERN_FIELDS = ("layer_types", "layers_block_type", "block_types")
ATTENTION_LAYER_KINDS = {"full_attention", "sliding_attention", "attention", "global", "local"}
# Words in a config that name a layer kind other than attention.
NON_ATTENTION_WORDS = ("mamba", "ssm", "conv", "linear_attention", "recurrent", "hybrid", "rwkv",
                       "lstm")
# model_type words of models with no attention layers at all.
STATE_SPACE_MODEL_TYPES = ("mamba", "rwkv", "lstm")
# Attention keyword arguments our kernels have no counterpart for (value: what they are).
UNSUPPORTED_ATTENTION_ARGS = {"s_aux": "attention sinks"}


@dataclass
class TransformersConfig:
    """What the engine and the KV pool read of a model on the transformers path."""

    architecture: str  # transformers' class, e.g. "GPTNeoXForCausalLM"
    model_type: str
    vocab_size: int
    max_position_embeddings: int
    num_layers: int  # attention layers, each with its own K/V in the pool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...] = ()  # per attention layer; None: full attention
    softcaps: tuple[float | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""


@dataclass
class LayerAttention:
    """One attention layer as the modeling code called us in the probe run."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    softcap: float | None


@dataclass
class Step:
    """One forward's batch and pool, for the attention function of every layer."""

    batch: ForwardBatch
    pool: KVPool
    layer_of: dict[int, int]  # id(attention module) -> its layer in the pool
    num_heads: int
    num_kv_heads: int
    plans: dict[int | None, object] = field(default_factory=dict)  # decode plan per window

    def decode_plan(self, window: int | None):
        """plan_decode's gather indices, once per step and window (shared by the layers)."""
        if window not in self.plans:
            b = self.batch
            self.plans[window] = plan_decode(b.kv_indptr, b.kv_indices, self.num_kv_heads,
                                             self.num_heads, b.max_kv_len, window=window)
        return self.plans[window]


@dataclass
class Probe:
    """What the probe run saw: one entry per attention call, in call order."""

    modules: list = field(default_factory=list)
    layers: list[LayerAttention] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


_current: contextvars.ContextVar[Step | Probe | None] = contextvars.ContextVar(
    "sgl_nb_transformers_step", default=None
)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function signature: query [1, Hq, T, D], key and value
    [1, Hkv, T, D] (this step's new tokens) -> ([1, T, Hq, D], no attention weights).
    attention_mask is ignored: our kernels apply the causal rule per request."""
    step = _current.get()
    if isinstance(step, Probe):
        return _record(step, module, query, key, value, sliding_window, softcap, kwargs)
    if step is None:
        raise RuntimeError(f"the {ATTENTION_NAME!r} attention runs only inside "
                           "TransformersModel.forward")
    # [T, H, D]; the kernels view q's heads as groups, so it must be contiguous.
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    layer = step.layer_of[id(module)]
    pool, b = step.pool, step.batch
    kb, vb = pool.k_buffers[layer], pool.v_buffers[layer]
    store_kv(kb, vb, b.out_cache_loc, k, v)
    scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
    # transformers' sliding_window: a query at p sees keys at p - window < k <= p, as ours.
    window = None if sliding_window is None else int(sliding_window)
    softcap = None if softcap is None else float(softcap)
    if b.is_decode:
        o = decode_attention(q, kb, vb, b.kv_indptr, b.kv_indices, scale, b.max_kv_len,
                             step.decode_plan(window), window=window, softcap=softcap)
    else:
        o = extend_attention(q, kb, vb, b.qo_indptr, b.kv_indptr, b.kv_indices, scale,
                             b.max_kv_len, window=window, softcap=softcap)
    return o.unsqueeze(0), None


def _record(probe: Probe, module, query, key, value, window, softcap, kwargs):
    name = type(module).__name__
    if any(m is module for m in probe.modules):
        probe.problems.append(f"{name} is called twice in one forward (shared attention)")
    if getattr(module, "is_causal", True) is False:
        probe.problems.append(f"{name} attends both ways (an encoder), not causally")
    if key.shape[-1] != value.shape[-1]:
        probe.problems.append(f"{name}'s keys ({key.shape[-1]}) and values ({value.shape[-1]}) "
                              "differ in size (latent attention)")
    if query.shape[1] % key.shape[1]:
        probe.problems.append(f"{name}: {query.shape[1]} query heads over {key.shape[1]} KV heads")
    for arg, what in UNSUPPORTED_ATTENTION_ARGS.items():
        if kwargs.get(arg) is not None:
            probe.problems.append(f"{name} uses {what} ({arg})")
    probe.modules.append(module)
    probe.layers.append(LayerAttention(
        num_heads=query.shape[1], num_kv_heads=key.shape[1], head_dim=key.shape[-1],
        window=None if window is None else int(window),
        softcap=None if softcap is None else float(softcap)))
    out = torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1],
                      dtype=query.dtype, device=query.device)
    return out, None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)


def hybrid_reason(config: dict) -> str | None:
    """Why a transformers config's layers are not all attention (a hybrid, or no attention at
    all), or None. Read from the config alone, before any weight loads; the probe run
    (_probe) catches what a config does not say."""
    model_type = str(config.get("model_type", ""))
    if any(w in model_type for w in STATE_SPACE_MODEL_TYPES):
        return f"it is a state-space or recurrent model (model_type {model_type!r}), not attention"
    pattern = config.get("hybrid_override_pattern")
    if isinstance(pattern, str) and "M" in pattern:  # one letter a layer, M: Mamba
        return f"its hybrid_override_pattern {pattern!r} has Mamba (M) layers"
    for name in LAYER_PATTERN_FIELDS:
        kinds = config.get(name)
        if not isinstance(kinds, list):
            continue
        other = sorted({str(k) for k in kinds} - ATTENTION_LAYER_KINDS)
        if any(w in k.lower() for k in other for w in NON_ATTENTION_WORDS):
            return f"its {name} lists layers that are not attention: {', '.join(other)}"
    marks = sorted(k for k in config if k.lower().startswith(("mamba", "ssm_")))
    if marks:
        return f"it has state-space (Mamba) layers ({', '.join(marks[:3])} in config.json)"
    return None


def encoder_reason(config: dict) -> str | None:
    """Why a transformers config is not a decoder-only model, or None."""
    if config.get("is_encoder_decoder"):
        return "it is an encoder-decoder model (is_encoder_decoder in config.json)"
    return None


def attention_reason(config: dict) -> str | None:
    """Why the model's transformers class cannot take our attention function (it computes
    attention in its own code), or None. Looked up from the config, before any weight loads."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"), ""),
                  None)
    if cls is not None and not cls.is_backend_compatible():
        return (f"its transformers modeling code ({cls.__name__}) computes attention itself "
                "(it does not take an AttentionInterface function)")
    return None


class TransformersModel:
    """A transformers causal LM whose attention reads and writes our KV pool."""

    path = "transformers"

    def __init__(self, hf_model, config: TransformersConfig, layer_modules: list,
                 dtype: torch.dtype, device: torch.device, quantization: str | None = None,
                 fallbacks: dict[str, str] | None = None):
        self.hf, self.config, self.dtype, self.device = hf_model, config, dtype, device
        self.quantization = quantization
        self.fallbacks = fallbacks or {}  # linear layer -> why it stayed dense
        self._layer_of = {id(m): i for i, m in enumerate(layer_modules)}
        self._layer_modules = layer_modules  # keeps the ids above alive and unique
        self._keeps_rows = "logits_to_keep" in inspect.signature(hf_model.forward).parameters

    @classmethod
    def load(
        cls,
        folder: Path,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str = "cpu",
        quantization: str | None = None,
    ) -> TransformersModel:
        """Load a local checkpoint folder with AutoModelForCausalLM (nothing is downloaded) and
        put our attention in it. dtype None: bf16 on CUDA or with quantization, else fp32.
        int8/int4: the decoder's linear layers become ours (transformers_linear.py),
        quantized at every load (the native runner's cache is keyed by its own layer names)."""
        from transformers import AutoModelForCausalLM

        folder = Path(folder)
        d = read_config(folder)
        arch = (d.get("architectures") or [d.get("model_type", "?")])[0]
        for reason in (encoder_reason(d), hybrid_reason(d), attention_reason(d)):
            if reason:
                raise ValueError(f"{arch} cannot run on sgl-nb's paged engine: {reason}")
        quantization = check_quantization(quantization)
        dtype = resolve_dtype(dtype, device, quantization)
        device = torch.device(device)
        _register()
        try:
            hf, info = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype, attn_implementation=ATTENTION_NAME,
                local_files_only=True, output_loading_info=True)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"{arch} from {folder}: transformers could not load it as a causal "
                             f"LM: {e}") from e
        if info.get("missing_keys"):
            missing = sorted(info["missing_keys"])
            raise ValueError(f"{folder}: weights missing from the checkpoint: "
                             f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        hf = hf.to(device).eval()
        hf.config.use_cache = False
        layers, modules = _probe(hf, arch)
        fallbacks = {}
        if quantization is not None:
            fallbacks = quantize_linears(hf, quantization, dtype, device, folder)
            _warn_fallbacks(fallbacks, quantization)
        config = _config(d, hf.config, arch, layers, folder.name)
        return cls(hf, config, modules, dtype, device, quantization, fallbacks)

    def new_kv_pool(self, num_slots: int) -> KVPool:
        c = self.config
        return KVPool(c.num_layers, num_slots, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def fused_decode_ready(self) -> bool:
        return False  # the fused C++ decode step is the native runner's

    def ahead_mark(self) -> int:
        return 0  # no decode ahead here (it takes the fused step): nothing to interrupt

    def interrupt_ahead(self) -> None:
        pass

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool):
        """Float32 logits at batch.logits_at, [B, vocab]; with score_rows, also theirs."""
        rows = batch.logits_at
        if batch.score_rows is not None:
            rows = torch.cat([batch.logits_at, batch.score_rows])
        c = self.config
        step = Step(batch, pool, self._layer_of, c.num_heads, c.num_kv_heads)
        extra = {"logits_to_keep": rows} if self._keeps_rows else {}
        token = _current.set(step)
        try:
            out = self.hf(input_ids=batch.input_ids[None], position_ids=batch.positions[None],
                          attention_mask=None, use_cache=False, **extra)
        finally:
            _current.reset(token)
        logits = out.logits[0].float()
        if not self._keeps_rows:
            logits = logits[rows]
        if batch.score_rows is None:
            return logits
        n = batch.logits_at.numel()
        return logits[:n], logits[n:]


def _probe(hf, arch: str) -> tuple[list[LayerAttention], list]:
    """Run the model once on one token with the recording attention: each attention layer's
    shape, window and soft-cap, in call order; a ValueError saying why where this path cannot
    serve the model."""
    probe = Probe()
    token = _current.set(probe)
    try:
        with torch.inference_mode():
            ids = torch.zeros(1, 1, dtype=torch.int64, device=hf.device)
            hf(input_ids=ids, position_ids=ids, attention_mask=None, use_cache=False)
    finally:
        _current.reset(token)
    refuse = f"{arch} cannot run on sgl-nb's paged engine:"
    layers = probe.layers
    expected = getattr(hf.config, "num_hidden_layers", None)
    if not layers:
        raise ValueError(f"{refuse} no layer calls attention (state-space, convolution or "
                         "recurrent layers only)")
    if expected is not None and len(layers) < expected:
        raise ValueError(f"{refuse} {expected - len(layers)} of its {expected} layers are not "
                         "attention (a hybrid of attention and state-space, convolution or "
                         "recurrent layers)")
    if probe.problems:
        raise ValueError(f"{refuse} {probe.problems[0]}")
    shapes = {(x.num_heads, x.num_kv_heads, x.head_dim) for x in layers}
    if len(shapes) > 1:
        raise ValueError(f"{refuse} its layers differ in head counts or sizes {sorted(shapes)}; "
                         "the KV pool holds one shape")
    return layers, probe.modules


def _config(d: dict, hf_config, arch: str, layers: list[LayerAttention],
            name: str) -> TransformersConfig:
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    first = layers[0]
    return TransformersConfig(
        architecture=arch,
        model_type=d.get("model_type", ""),
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=_context_length(hf_config),
        num_layers=len(layers),
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        windows=tuple(x.window for x in layers),
        softcaps=tuple(x.softcap for x in layers),
        eos_token_ids=eos_ids,
        name=name,
    )


def _warn_fallbacks(fallbacks: dict[str, str], quantization: str) -> None:
    if fallbacks:
        names = sorted(fallbacks)
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        warnings.warn(f"{quantization}: {len(names)} linear layer(s) stay dense ({shown}): "
                      f"{fallbacks[names[0]]}", stacklevel=3)


def _context_length(hf_config) -> int:
    # max_position_embeddings is an alias of n_positions (GPT-2) and the like in most configs.
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length",
                 "max_sequence_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4096  # no limit in the config (pure RoPE): the KV pool's size caps it
