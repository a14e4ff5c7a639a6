"""What each natively run model family changes from Llama: one function per family, from a
checkpoint's config.json (a dict) to the ModelConfig fields it overrides, weight names
included. The runner (runtime/model/model.py) reads only those fields, never the family.

native_family(config) says whether a config is one of these (None: it is not; the
transformers path may still run it); family_overrides raises a ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_nb.runtime.model.layer_spec import (
    ROPE_TYPES,
    Activation,
    LayerSpec,
    QKNorm,
    Rope,
    WeightNames,
)

SLIDING = "sliding_attention"


def llama(d: dict) -> dict:
    return dict(layers=_layers(d))


def qwen2(d: dict) -> dict:
    return dict(attention_bias=True, layers=_layers(d, _qwen_layer_types(d)))


def qwen3(d: dict) -> dict:
    return dict(qk_norm=QKNorm.PER_HEAD, layers=_layers(d, _qwen_layer_types(d)))


def qwen3_moe(d: dict) -> dict:
    n, step = d["num_hidden_layers"], d.get("decoder_sparse_step", 1)
    experts = d.get("num_experts") or d.get("num_local_experts") or 0
    dense = set(d.get("mlp_only_layers") or [])
    moe = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)]
    return dict(
        qk_norm=QKNorm.PER_HEAD, layers=_layers(d, _qwen_layer_types(d), moe=moe),
        num_experts=experts, top_k=d["num_experts_per_tok"],
        norm_topk_prob=d.get("norm_topk_prob", False),
        moe_intermediate_size=d["moe_intermediate_size"],
    )


def mistral(d: dict) -> dict:
    # One window for every layer when sliding_window is set (Mistral 7B v0.1: 4096).
    return dict(layers=_layers(d, [SLIDING] * d["num_hidden_layers"]))


def gemma2(d: dict) -> dict:
    n = d["num_hidden_layers"]
    alternating = [SLIDING if i % 2 == 0 else "full_attention" for i in range(n)]
    return dict(**_gemma(d), attn_softcap=d.get("attn_logit_softcapping"),
                final_softcap=d.get("final_logit_softcapping"),
                layers=_layers(d, d.get("layer_types") or alternating))


def gemma3_text(d: dict) -> dict:
    n, pattern = d["num_hidden_layers"], d.get("sliding_window_pattern", 6)
    types = d.get("layer_types") or [
        SLIDING if (i + 1) % pattern else "full_attention" for i in range(n)]
    params = d.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one rope per layer type
        full = _rope(params["full_attention"])
        local = _rope(params.get(SLIDING) or {"rope_theta": 10000.0})
    else:  # older configs: rope_theta + rope_scaling, and a local base frequency
        full, local = _rope(d), Rope.of(d.get("rope_local_base_freq", 10000.0))
    layers = [LayerSpec(window=d["sliding_window"], rope=local) if t == SLIDING
              else LayerSpec(rope=full) for t in types]
    return dict(**_gemma(d), qk_norm=QKNorm.PER_HEAD, attn_softcap=d.get("attn_logit_softcapping"),
                final_softcap=d.get("final_logit_softcapping"), layers=layers,
                rope_theta=full.theta, rope_scaling=dict(full.scaling))


def phi3(d: dict) -> dict:
    params = d.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0
    return dict(
        rotary_dim=int(_head_dim(d) * factor),
        weights=WeightNames(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)),
        layers=_layers(d, [SLIDING] * d["num_hidden_layers"]),
    )


def olmo2(d: dict) -> dict:
    # Norms on each block's output only, and q/k normed over the whole projection.
    names = WeightNames(attn_norm="", attn_post_norm="post_attention_layernorm",
                        mlp_norm="", mlp_post_norm="post_feedforward_layernorm")
    return dict(weights=names, qk_norm=QKNorm.WHOLE, layers=_layers(d))


def granite(d: dict) -> dict:
    return dict(
        embed_scale=d.get("embedding_multiplier", 1.0),
        residual_scale=d.get("residual_multiplier", 1.0),
        attn_scale=d.get("attention_multiplier"),
        logits_scaling=d.get("logits_scaling", 1.0),
        layers=_layers(d),
    )


def smollm3(d: dict) -> dict:
    # no_rope_layers[i] == 1 means layer i HAS rope (transformers' naming).
    n, interval = d["num_hidden_layers"], d.get("no_rope_layer_interval", 4)
    uses_rope = d.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    layers = _layers(d, _qwen_layer_types(d))
    return dict(layers=[s if uses_rope[i] else LayerSpec(window=s.window, rope=None)
                        for i, s in enumerate(layers)])


# model_type -> family function; the architecture names (config "architectures") they run.
FAMILIES: dict[str, Callable[[dict], dict]] = {
    "llama": llama, "qwen2": qwen2, "qwen3": qwen3, "qwen3_moe": qwen3_moe,
    "mistral": mistral, "gemma2": gemma2, "gemma3_text": gemma3_text, "phi3": phi3,
    "olmo2": olmo2, "granite": granite, "smollm3": smollm3,
}
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite", "SmolLM3ForCausalLM": "smollm3",
}


# What transformers' config class assumes for a field config.json leaves out, where that is
# not what the functions above assume (checkpoints written by hand, or by an older
# save_pretrained, omit fields equal to the class defaults).
CLASS_DEFAULTS: dict[str, dict] = {
    "gemma2": dict(query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   sliding_window=4096),
    "gemma3_text": dict(query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                        sliding_window=4096),
}


def with_class_defaults(d: dict) -> dict:
    """config.json with its family's CLASS_DEFAULTS under the values it sets."""
    family = d.get("model_type") or ARCHITECTURES.get((d.get("architectures") or [None])[0])
    return {**CLASS_DEFAULTS.get(family, {}), **d}


def native_family(d: dict) -> str | None:
    """The family (model_type) a config.json runs as natively, or None."""
    return None if _not_native(d) else d.get("model_type") or ARCHITECTURES[d["architectures"][0]]


def family_overrides(d: dict) -> tuple[str, dict]:
    """(family, ModelConfig overrides) of a config.json; a ValueError saying why for one that
    does not run natively."""
    d = with_class_defaults(d)
    why = _not_native(d)
    if why:
        raise ValueError(why)
    family = native_family(d)
    return family, {"activation": ACTIVATION_NAMES[_activation_name(d)], **FAMILIES[family](d)}


def _not_native(d: dict) -> str | None:
    d = with_class_defaults(d)
    arch = (d.get("architectures") or [None])[0]
    family = d.get("model_type") or ARCHITECTURES.get(arch)
    if (arch is not None and arch not in ARCHITECTURES) or family not in FAMILIES:
        # e.g. Gemma3ForConditionalGeneration, LlamaForSequenceClassification, falcon
        return (f"unsupported architecture {arch or '?'!r} (model_type "
                f"{d.get('model_type')!r}): sgl-nb runs natively "
                f"{', '.join(sorted(ARCHITECTURES))}")
    for kind in _rope_types(d):
        if kind not in ROPE_TYPES:
            return (f"{family}: rope type {kind!r} is not native (native: "
                    f"{', '.join(ROPE_TYPES)})")
    if _activation_name(d) not in ACTIVATION_NAMES:
        return (f"{family}: activation {_activation_name(d)!r} is not native (native: "
                f"{', '.join(ACTIVATION_NAMES)})")
    return None


def _rope_types(d: dict) -> set[str]:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    entries = [v for v in params.values() if isinstance(v, dict)] or [params]  # Gemma 3: per type
    return {e.get("rope_type") or e.get("type") or "default" for e in entries}


def _head_dim(d: dict) -> int:
    return d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]


def _rope(d: dict) -> Rope:
    """The rope of a config (or of one rope_parameters entry)."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if "rope_type" in d or "type" in d:  # d is itself one rope_parameters entry
        params = d
    return Rope.of(params.get("rope_theta") or d.get("rope_theta", 10000.0), params)


def _layers(d: dict, types: list[str] | None = None, moe: list[bool] | None = None):
    """Layer specs: the config's rope on every layer, sliding_window where `types` says so."""
    n, rope, window = d["num_hidden_layers"], _rope(d), d.get("sliding_window")
    types = types or d.get("layer_types") or ["full_attention"] * n
    moe = moe or [False] * n
    return [LayerSpec(window=window if t == SLIDING else None, rope=rope, moe=m)
            for t, m in zip(types, moe, strict=True)]


def _qwen_layer_types(d: dict) -> list[str]:
    # Older Qwen configs: use_sliding_window from layer max_window_layers on.
    n = d["num_hidden_layers"]
    if d.get("layer_types"):
        return d["layer_types"]
    if not d.get("use_sliding_window"):
        return ["full_attention"] * n
    return [SLIDING if i >= d.get("max_window_layers", n) else "full_attention"
            for i in range(n)]


def _gemma(d: dict) -> dict:
    return dict(
        norm_offset=1.0, embed_scale=d["hidden_size"] ** 0.5,
        attn_scale=d.get("query_pre_attn_scalar", _head_dim(d)) ** -0.5,
        tie_word_embeddings=d.get("tie_word_embeddings", True),
        weights=WeightNames(attn_post_norm="post_attention_layernorm",
                            mlp_norm="pre_feedforward_layernorm",
                            mlp_post_norm="post_feedforward_layernorm"),
    )


ACTIVATION_NAMES = {"silu": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH}


def _activation_name(d: dict) -> str:
    return d.get("hidden_activation") or d.get("hidden_act") or "silu"
