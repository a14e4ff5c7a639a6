"""The numbers and the differences from Llama of a decoder checkpoint, as data the model
runner reads: each field defaults to Llama's behaviour, and runtime/model/families.py sets
the ones a family changes (a norm offset, a soft-cap, a window per layer, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sgl_nb.runtime.model.checkpoint import read_config
from sgl_nb.runtime.model.families import family_overrides
from sgl_nb.runtime.model.layer_spec import Activation, LayerSpec, QKNorm, Rope, WeightNames


@dataclass
class ModelConfig:
    architecture: str  # the family: "llama", "qwen2", "gemma2", ... (runtime/model/families.py)
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
    # What a family changes from Llama; every default is Llama's behaviour.
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w): Gemma's 1 + w
    qk_norm: QKNorm = QKNorm.NONE
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    embed_scale: float = 1.0  # embeddings times this (Gemma sqrt(hidden), Granite)
    residual_scale: float = 1.0  # each block's output times this before the add (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite's name and meaning)
    activation: Activation = Activation.SILU
    rotary_dim: int = 0  # dims of each head that rotate (Phi-3 partial rotary); 0: head_dim
    layers: list[LayerSpec] = field(default_factory=list)  # empty: all LayerSpec(rope=global)
    weights: WeightNames = field(default_factory=WeightNames)
    num_experts: int = 0
    top_k: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        self.rotary_dim = self.rotary_dim or self.head_dim
        if not self.layers:
            rope = Rope.of(self.rope_theta, self.rope_scaling)
            self.layers = [LayerSpec(rope=rope) for _ in range(self.num_layers)]
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {self.num_layers} layers")

    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> ModelConfig:
        family, overrides = family_overrides(d)
        # transformers 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        base = dict(
            architecture=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", False),
            rope_theta=float(theta),
            rope_scaling=rope,
            eos_token_ids=eos_ids,
            name=name,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        # read_config names a missing or wrong file or field; generation_config's eos ids win.
        return cls.from_dict(read_config(folder), name=Path(folder).name)
