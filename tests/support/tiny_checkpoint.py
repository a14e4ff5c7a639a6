"""Tiny random-weight checkpoints of each model family, built from a transformers config: no
download. `tiny_config(family)` gives a small config of the family's real shape (GQA,
head_dim 64, its own features switched on at values a tiny model can feel), and
`tiny_checkpoint(config, folder)` saves a model of it with random weights and the default
model's tokenizer (vocab 49152, so token ids mean the same words).

    folder = tiny_checkpoint(tiny_config("gemma2"), tmp_path / "gemma2")
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 49152  # the default model's (SmolLM2) tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")

# Shared by every family: 4 query heads over 2 KV heads (GQA 2), head_dim 64, ids of the
# SmolLM2 tokenizer's special tokens.
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
    rms_norm_eps=1e-6, initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    tie_word_embeddings=False,
)

# Each family's own features, at values that change the tiny model's output (a soft-cap of
# 50 never bites scores of size 1, a window of 4096 never bites a 40-token prompt).
_FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", dict(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=256))),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1])),
    "mistral": ("MistralConfig", dict(sliding_window=16)),
    "gemma2": ("Gemma2Config", dict(
        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=48, sliding_window=16, attn_logit_softcapping=2.0,
        final_logit_softcapping=4.0, layer_types=None, num_hidden_layers=4)),
    "gemma3": ("Gemma3TextConfig", dict(
        tie_word_embeddings=True, query_pre_attn_scalar=48, sliding_window=16,
        num_hidden_layers=4, sliding_window_pattern=2, layer_types=None,
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6)))),
    "phi3": ("Phi3Config", dict(pad_token_id=2)),
    "phi3_partial": ("Phi3Config", dict(
        pad_token_id=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                             partial_rotary_factor=0.75))),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", dict(
        embedding_multiplier=12.0, attention_multiplier=0.03, residual_multiplier=0.22,
        logits_scaling=8.0)),  # untied: a tied head times 12x embeddings echoes the input
    "smollm3": ("SmolLM3Config", dict(
        tie_word_embeddings=True, no_rope_layers=[1, 1, 0, 1], num_hidden_layers=4,
        no_rope_layer_interval=3)),
}

FAMILIES = tuple(_FAMILIES)


def tiny_config(family: str, **overrides):
    """A small transformers config of `family` (a key of FAMILIES); `overrides` win."""
    import transformers

    if family not in _FAMILIES:
        raise ValueError(f"no tiny config for {family!r}: one of {', '.join(FAMILIES)}")
    cls_name, own = _FAMILIES[family]
    kwargs = {**_COMMON, **own, **overrides}
    if kwargs.get("layer_types", 0) is None:
        del kwargs["layer_types"]  # the config derives it from its own pattern
    if cls_name == "Gemma3TextConfig" and "sliding_window_pattern" in kwargs:
        pattern = kwargs.pop("sliding_window_pattern")
        kwargs["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(kwargs["num_hidden_layers"])]
    return getattr(transformers, cls_name)(**kwargs)


def tiny_checkpoint(config, folder: str | Path, seed: int = 0) -> Path:
    """Save a random-weight model of `config` (a transformers config object) in `folder`,
    safetensors plus the default model's tokenizer files; returns the folder."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights start at one (zero for Gemma's 1 + w) and biases at zero: spread
            # them so a wrong offset, a missed norm or a dropped bias changes the tokens.
            if "norm" in name or "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    copy_tokenizer(folder)
    return folder


def copy_tokenizer(folder: Path) -> None:
    """The default model's tokenizer files into `folder` (converted once by the model loader)."""
    from sgl_nb.runtime.model.model_loader import resolve_model_path

    source = resolve_model_path(progress=False)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


def load_reference(folder: str | Path):
    """transformers' own model of a saved tiny checkpoint, fp32, eager attention (the one
    every family's masks and soft-caps are defined against)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager").eval()
