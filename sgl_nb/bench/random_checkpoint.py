"""Random-weight checkpoints of each native family at a realistic shape (about 0.5B
parameters), for `sgl-nb bench models`: speed depends on the shapes, not on the values,
and nothing is downloaded. The tokenizer is the default model's (vocabulary 49152), so the
same prompt is the same token ids on every family."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 49152
# The default model's tokenizer files a checkpoint folder needs (those that exist are copied).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")

# What every family shares: 28 layers of width 1024, 16 query heads of 64 over 4 KV heads,
# an MLP of 4096 (about 0.48B parameters with the embedding).
BASE = dict(vocab_size=VOCAB, hidden_size=1024, intermediate_size=4096, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=4, head_dim=64,
            max_position_embeddings=4096, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=None)  # the tokenizer's ids

# Each family's own settings on top of BASE, as its released configs set them.
FAMILY_SETTINGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=16, num_experts=16,
                                         num_experts_per_tok=4, moe_intermediate_size=512,
                                         norm_topk_prob=True)),
    "mistral": ("MistralConfig", dict(sliding_window=4096)),
    "gemma2": ("Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=1,
                                    head_dim=256, query_pre_attn_scalar=256,
                                    sliding_window=4096)),
    "gemma3": ("Gemma3TextConfig", dict(num_attention_heads=4, num_key_value_heads=1,
                                        head_dim=256, query_pre_attn_scalar=256,
                                        sliding_window=512)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.75)),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=0.015625, logits_scaling=4.0)),
    "smollm3": ("SmolLM3Config", {}),
}
FAMILIES = tuple(FAMILY_SETTINGS)


def realistic_config(family: str, **overrides):
    """The transformers config of `family` at the bench's shape."""
    import transformers

    if family not in FAMILY_SETTINGS:
        raise ValueError(f"no bench shape for family {family!r}; families: {', '.join(FAMILIES)}")
    cls_name, own = FAMILY_SETTINGS[family]
    return getattr(transformers, cls_name)(**{**BASE, **own, **overrides})


def copy_tokenizer(folder: Path) -> None:
    """The default model's tokenizer files into `folder`."""
    from sgl_nb.runtime.model.model_loader import resolve_model_path

    source = resolve_model_path(None, progress=False)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


def write_random_checkpoint(config, folder: Path, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16) -> Path:
    """A checkpoint folder of `config` with random weights (transformers' own init, seeded)
    and the default model's tokenizer; written once (a folder holding config.json is
    reused)."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    # Written beside it, then renamed: a run stopped halfway leaves no folder that looks done.
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None  # random weights: no natural stop
    model.save_pretrained(partial)
    copy_tokenizer(partial)
    partial.rename(folder)
    return folder
