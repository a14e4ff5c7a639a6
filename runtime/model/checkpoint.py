"""Reading a checkpoint: config.json (with generation_config.json's stop ids), the safetensors
weights (sharded through model.safetensors.index.json too) and a GGUF file's config and
weights. Every error names the file, the field or the tensor that is wrong.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file is there but its content cannot be used as it is."""


class MissingTensorError(KeyError):
    """A tensor the model runner reads is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0])


class Weights(dict):
    """Tensor name -> tensor, as read from `source`; reading an absent name raises a
    MissingTensorError naming it and the source (`.get` and `in` behave as a dict's)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], source: str | Path):
        super().__init__(tensors)
        self.source = str(source)

    def __missing__(self, name: str):
        raise MissingTensorError(
            f"tensor {name!r} is missing from {self.source} ({len(self)} tensors there, "
            f"e.g. {', '.join(sorted(self)[:3]) or 'none'})"
        )


# ---- config ---------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def read_config(folder: str | Path) -> dict:
    """config.json of a checkpoint folder as a dict, checked: `architectures` (derived from
    `model_type` where absent) names a transformers class, and generation_config.json's
    `eos_token_id` (e.g. Llama 3's several stop ids) replaces config.json's."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: a checkpoint folder needs config.json (the model's transformers "
            "config) next to its *.safetensors, or holds a .gguf file"
        )
    config = _read_json(path)
    config["architectures"] = _architectures(config, path)
    generation = folder / GENERATION_CONFIG_FILE
    if generation.is_file():
        eos = _read_json(generation).get("eos_token_id")
        if eos is not None:
            config["eos_token_id"] = eos
    return config


def _architectures(config: dict, path: Path) -> list[str]:
    """config.json's `architectures`, checked against transformers; where absent or naming
    no transformers class, the causal LM class of `model_type` (as transformers' Auto
    classes load it)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type, archs = config.get("model_type"), config.get("architectures")
    version = transformers.__version__
    if model_type is None and not archs:
        raise CheckpointError(
            f"{path}: neither 'model_type' nor 'architectures' is set, so the model's family "
            "is unknown (a transformers config.json names both)"
        )
    if model_type is not None and model_type not in CONFIG_MAPPING_NAMES:
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is unknown to transformers {version} (a model "
            "that needs trust_remote_code is not supported)"
        )
    if archs is not None and (not isinstance(archs, list)
                              or not all(isinstance(a, str) for a in archs)):
        raise CheckpointError(f"{path}: 'architectures' must be a list of class names, got "
                              f"{archs!r}")
    # dir() lists transformers' lazy names; hasattr would import each class's modeling module
    # (for Llama 5 s in a fresh process, on a path that never runs transformers' model).
    names = set(dir(transformers))
    unknown = [a for a in archs or [] if a not in names]
    if archs and not unknown:
        return archs
    derived = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if derived is None:
        if unknown:
            raise CheckpointError(
                f"{path}: architectures {unknown} name no class of transformers {version} (a "
                "model that needs trust_remote_code is not supported)"
            )
        raise CheckpointError(
            f"{path}: 'architectures' is not set and model_type {model_type!r} has no causal "
            "LM class in transformers (sgl-nb runs decoder-only causal LMs)"
        )
    if unknown:
        warnings.warn(f"{path}: architectures {unknown} name no class of transformers "
                      f"{version}; model_type {model_type!r} gives {derived}, used instead",
                      stacklevel=3)
    return [derived]


# ---- safetensors weights ----------------------------------------------------------------------


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its index names (each must
    exist), else every *.safetensors in it."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        shards = sorted(set(_weight_map(index).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} names {len(missing)} shard(s) missing from {folder}: "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
            )
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or *.gguf in {folder}")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: 'weight_map' (tensor name -> shard file) is missing "
                              "or empty")
    return weight_map


def read_weights(folder: str | Path) -> Weights:
    """Every tensor of a checkpoint folder's safetensors (all shards), by name."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    files = weight_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read it as safetensors: {e}") from e
    index = folder / INDEX_FILE
    if index.is_file():
        absent = [(name, shard) for name, shard in _weight_map(index).items()
                  if name not in tensors]
        if absent:
            name, shard = absent[0]
            raise CheckpointError(
                f"{index} puts tensor {name!r} in {shard}, which does not hold it "
                f"({len(absent)} such tensor(s))"
            )
    return Weights(tensors, folder)


def check_shapes(expected: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor],
                 source: str | Path = "the checkpoint") -> None:
    """Raise naming the first tensor that is missing or whose shape is not the one the
    config gives (`expected`: tensor name -> shape)."""
    missing = [name for name in expected if name not in weights]
    if missing:
        raise MissingTensorError(
            f"tensor {missing[0]!r} is missing from {source} ({len(missing)} expected tensor(s) "
            f"missing{': ' + ', '.join(missing[1:4]) if len(missing) > 1 else ''})"
        )
    for name, shape in expected.items():
        got = tuple(weights[name].shape)
        if got != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {source} has shape {got}, but config.json's numbers give "
                f"{tuple(shape)}"
            )


def llama_shapes(config, tensors: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """The shape a ModelConfig's numbers give each tensor among `tensors` (the checkpoint's
    names) of a Llama-like layout under the family's weight names (config.weights: fused
    qkv / gate_up, its norms): embedding, q/k/v/o and biases, gate/up/down, the norms, q/k
    norms, the LM head. Expert tensors are left to the MoE block; a tensor the runner reads
    and the checkpoint lacks is named when it is read (Weights)."""
    c, names = config, config.weights
    hidden, q, kv, inter = (c.hidden_size, c.num_heads * c.head_dim,
                            c.num_kv_heads * c.head_dim, c.intermediate_size)
    qkv_rows = (q + 2 * kv,) if len(names.qkv) == 1 else (q, kv, kv)
    norms = [n for n in (names.attn_norm, names.attn_post_norm, names.mlp_norm,
                         names.mlp_post_norm) if n]
    whole_qk = c.qk_norm.value == "whole"  # OLMo 2 norms the whole projection, not a head
    shapes = {"model.embed_tokens.weight": (c.vocab_size, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (c.vocab_size, hidden)}
    for i in range(c.num_layers):
        layer = f"model.layers.{i}."
        for name, rows in zip(names.qkv, qkv_rows):
            shapes[f"{layer}{name}.weight"] = (rows, hidden)
            shapes[f"{layer}{name}.bias"] = (rows,)
        shapes[f"{layer}self_attn.o_proj.weight"] = (hidden, q)
        shapes[f"{layer}self_attn.o_proj.bias"] = (hidden,)
        for name in names.gate_up:
            shapes[f"{layer}{name}.weight"] = (inter * 2 // len(names.gate_up), hidden)
        shapes[f"{layer}mlp.down_proj.weight"] = (hidden, inter)
        for norm in norms:
            shapes[f"{layer}{norm}.weight"] = (hidden,)
        shapes[f"{layer}{names.q_norm}.weight"] = (q,) if whole_qk else (c.head_dim,)
        shapes[f"{layer}{names.k_norm}.weight"] = (kv,) if whole_qk else (c.head_dim,)
    present = set(tensors)
    return {name: shape for name, shape in shapes.items() if name in present}


# ---- GGUF -------------------------------------------------------------------------------------


def find_gguf(folder: str | Path) -> Path | None:
    """The one .gguf file in `folder`, None if there is none (several: an error naming them)."""
    found = sorted(Path(folder).glob("*.gguf"))
    if len(found) > 1:
        raise CheckpointError(
            f"{folder} holds {len(found)} .gguf files ({', '.join(f.name for f in found[:4])}): "
            "pass the path of the one to load"
        )
    return found[0] if found else None


def read_gguf(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A GGUF file's transformers config (as a dict with `architectures`) and its weights
    under transformers' names, quantized types dequantized (exactly: float32 where a
    16-bit type cannot hold the values).
    transformers' GGUF reader does the mapping (names, llama.cpp's q/k row order, norms)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(path)
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read it as a GGUF model: {e}") from e
    if hasattr(config, "quantization_config"):  # the file's; its weights come out dequantized
        del config.quantization_config
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if arch is None:
        raise CheckpointError(f"{path}: general.architecture gives model_type "
                              f"{config.model_type!r}, which has no causal LM class")
    config.architectures = [arch]
    _read_what_transformers_skips(path, config)
    # A model on the meta device costs nothing and gives the GGUF -> transformers name map.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    weights = tensors["tensors"]
    expected = {k for k in skeleton.state_dict() if not k.startswith("lm_head.")}
    unmapped = sorted(expected - set(weights))
    if unmapped:
        raise MissingTensorError(
            f"{path}: no tensor of it maps to {unmapped[0]!r} ({len(unmapped)} such)"
        )
    # Every value written out, defaults too: a reader need not share transformers' defaults.
    return config.to_dict(), {name: _exact_narrowest(t) for name, t in weights.items()}


def _exact_narrowest(t: torch.Tensor) -> torch.Tensor:
    """`t` in float16 or bfloat16 where that holds every value exactly (an F16/BF16 file's
    tensors come out of the reader as float32: this halves the converted copy), else as is."""
    for dtype in (torch.float16, torch.bfloat16):
        if t.dtype == torch.float32 and torch.equal(t.to(dtype).float(), t):
            return t.to(dtype)
    return t


def _read_what_transformers_skips(path: Path, config) -> None:
    """Set on `config` what llama.cpp writes and transformers' GGUF reader leaves out:
    Gemma's soft-caps, a linear rope scaling, Llama 3's rope frequencies (rope_freqs)."""
    from sgl_nb.runtime.model.gguf_reading import open_gguf

    reader = open_gguf(path)
    arch = reader.fields["general.architecture"].contents()

    def value(key: str):
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else field.contents()

    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if value(key) is not None and hasattr(config, key):
            setattr(config, key, float(value(key)))
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if value("rope.scaling.type") == "linear":
        rope.update(rope_type="linear", factor=float(value("rope.scaling.factor")))
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        rope.update(_llama3_rope(path, np.asarray(freqs.data, dtype=np.float64), rope))
    if rope:
        config.rope_parameters = rope


def _llama3_rope(path: Path, factors: np.ndarray, rope: dict) -> dict:
    """Llama 3's rope scaling (factor, low/high_freq_factor, original context) from the
    per-frequency divisors llama.cpp stores instead (rope_freqs.weight): 1 for short
    wavelengths, `factor` for long ones, 1 / ((1 - s) / factor + s) between, s linear in
    1 / wavelength. low_freq_factor is taken as 1; the others follow (an equivalent form)."""
    dim, theta = 2 * factors.size, float(rope.get("rope_theta", 10000.0))
    inv_wavelen = 1 / (theta ** (np.arange(0, dim, 2) / dim)) / (2 * math.pi)
    factor = float(factors.max())
    between = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    found = None
    if factor > 1 and between.sum() >= 2:
        smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(inv_wavelen[between], smooth, 1)  # smooth = a / wavelen + b
        if b < 0:  # the fit in float32's noise: round to the values a config would hold
            found = dict(rope_type="llama3", factor=factor, low_freq_factor=1.0,
                         high_freq_factor=round(float(1 - 1 / b), 3),
                         original_max_position_embeddings=round(float(-a / b)))
    if found is None or not np.allclose(_llama3_factors(inv_wavelen, found), factors, rtol=1e-4):
        raise CheckpointError(
            f"{path}: tensor 'rope_freqs.weight' ({factors.size} rope divisors, "
            f"{np.round(factors[:4], 3).tolist()} ...) is not Llama 3's rope scaling; sgl-nb "
            "cannot read it"
        )
    return found


def _llama3_factors(inv_wavelen: np.ndarray, p: dict) -> np.ndarray:
    """llama.cpp's rope divisors for Llama 3's scaling (convert_hf_to_gguf.py's formula)."""
    old, low, high, factor = (p["original_max_position_embeddings"], p["low_freq_factor"],
                              p["high_freq_factor"], p["factor"])
    smooth = (old * inv_wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(inv_wavelen > high / old, 1.0,
                    np.where(inv_wavelen < low / old, factor, between))
