"""Reading a checkpoint: config.json (with generation_config.json's stop ids), the safetensors
weights (sharded through model.safetensors.index.json too) and a GGUF file's config and
weights. Every error names the file, the field or the tensor that is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

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
    """config.json's `architectures`, checked against `model_type` and transformers."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type, archs = config.get("model_type"), config.get("architectures")
    if model_type is None and not archs:
        raise CheckpointError(
            f"{path}: neither 'model_type' nor 'architectures' is set, so the model's family "
            "is unknown (a transformers config.json names both)"
        )
    if model_type is not None and model_type not in CONFIG_MAPPING_NAMES:
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is unknown to transformers "
            f"{transformers.__version__} (a model that needs trust_remote_code is not supported)"
        )
    if not archs:
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise CheckpointError(
                f"{path}: 'architectures' is not set and model_type {model_type!r} has no causal "
                "LM class in transformers (sgl-nb runs decoder-only causal LMs)"
            )
        return [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{path}: 'architectures' must be a list of class names, got "
                              f"{archs!r}")
    unknown = [a for a in archs if not hasattr(transformers, a)]
    if unknown:
        raise CheckpointError(
            f"{path}: architectures {unknown} name no class of transformers "
            f"{transformers.__version__} (a model that needs trust_remote_code is not supported)"
        )
    return archs


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
    """The shape a ModelConfig's numbers give each Llama-layout tensor among `tensors` (the
    checkpoint's names): embedding, q/k/v/o (and biases), gate/up/down, the norms, the LM
    head. Names of other layouts (fused qkv, experts) are left to the family's own check; a
    tensor the runner reads and the checkpoint lacks is named when it is read (Weights)."""
    c = config
    hidden, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (c.vocab_size, hidden)}
    for i in range(c.num_layers):
        layer = f"model.layers.{i}."
        att, mlp = layer + "self_attn.", layer + "mlp."
        for n, rows in (("q", q), ("k", kv), ("v", kv), ("o", hidden)):
            shapes[f"{att}{n}_proj.weight"] = (rows, q if n == "o" else hidden)
            shapes[f"{att}{n}_proj.bias"] = (rows,)
        shapes[f"{mlp}gate_proj.weight"] = (c.intermediate_size, hidden)
        shapes[f"{mlp}up_proj.weight"] = (c.intermediate_size, hidden)
        shapes[f"{mlp}down_proj.weight"] = (hidden, c.intermediate_size)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"{layer}{norm}.weight"] = (hidden,)
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
    under transformers' names, quantized types dequantized (to float32; F16/BF16 kept).
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
    return config.to_diff_dict(), weights
