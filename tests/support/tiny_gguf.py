"""Write a tiny checkpoint folder as a GGUF file laid out as llama.cpp's convert_hf_to_gguf.py
writes one (its tensor names, its q/k row order for Llama, its metadata keys), with the
tokenizer fields of the default model's own GGUF: no llama.cpp, no download.

    weights = write_gguf(folder, tmp_path / "m.gguf", "Q8_0")

returns the weights under transformers' names as the file holds them (a quantized type's
values after its round trip), which is what a GGUF loader must give back.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import torch

# transformers model_type -> GGUF architecture; Llama's q/k rows are reordered for
# llama.cpp's rope (convert_hf_to_gguf.py's LlamaModel.permute), Qwen2's are not.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "phi3": "phi3", "gemma2": "gemma2"}
PERMUTES_QK = {"llama"}
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (transformers' reader subtracts the 1).
NORM_PLUS_ONE = {"gemma2"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two rotary halves interleaved."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _llama3_rope_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for Llama 3's rope scaling: per frequency, 1 for
    short wavelengths, the factor for long ones, interpolated between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@functools.cache
def _default_tokenizer_fields() -> tuple[tuple, ...]:
    """The default model's tokenizer keys (key, value, type, sub-type), read once a process."""
    from sgl_nb.runtime.model.gguf_reading import open_gguf
    from sgl_nb.runtime.model.model_loader import default_gguf_path

    fields = open_gguf(default_gguf_path()).fields
    return tuple((key, field.contents(), field.types[0],
                  field.types[-1] if len(field.types) > 1 else None)
                 for key, field in fields.items() if key.startswith("tokenizer."))


def _tokenizer_fields(writer) -> None:
    for key, value, kind, sub in _default_tokenizer_fields():
        writer.add_key_value(key, value, kind, sub_type=sub)


def _encode(w: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, the values it decodes to) for one tensor of type `qtype`."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[qtype]
    if w.ndim == 1 or qtype == "F32":  # llama.cpp keeps norms and biases in F32
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == "F16":
        return w.astype(np.float16), w.astype(np.float16)
    if qtype == "Q4_K":  # gguf-py cannot quantize to Q4_K: random blocks of valid scales
        return _random_q4_k(w.shape)
    stored = quants.quantize(w.astype(np.float32), kind)
    return stored, quants.dequantize(stored, kind)


def _random_q4_k(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    from gguf import GGMLQuantizationType, quants

    rows, cols = shape
    rng = np.random.default_rng(rows * 7919 + cols)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    # d and dmin (two f16s opening each block) small, so the weights stay around 0.05.
    scales = rng.uniform(0.001, 0.004, size=(rows, cols // 256, 2)).astype(np.float16)
    blocks[..., :4] = scales.view(np.uint8).reshape(rows, cols // 256, 4)
    stored = blocks.reshape(rows, -1)
    return stored, quants.dequantize(stored, GGMLQuantizationType.Q4_K)


def write_gguf(folder: str | Path, out: str | Path, qtype: str = "F32") -> dict[str, torch.Tensor]:
    """`folder`'s model (a family of GGUF_ARCH) as a GGUF file at `out`, its 2D weights
    stored as `qtype` (F32, F16, Q8_0, Q4_0, Q4_K, ...); returns the weights it decodes to."""
    import gguf
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = GGUF_ARCH[model_type]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{model_type}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    if arch in NORM_PLUS_ONE:  # Gemma: head_dim and the window are keys of their own
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg["sliding_window"])
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if rope.get("rope_type") == "llama3":  # llama.cpp stores the divisors, not the numbers
        w.add_tensor("rope_freqs.weight", _llama3_rope_divisors(rope, head_dim))
    _tokenizer_fields(w)
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg["num_hidden_layers"])
    decoded: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        array = t.float().numpy()
        if arch in NORM_PLUS_ONE and base.endswith("norm"):
            array = array + 1
        stored, values = _encode(array, qtype)
        if arch in PERMUTES_QK and base.endswith(("q_proj", "k_proj")):
            # Row-wise quantization commutes with reordering rows: reorder what is stored.
            stored = _permute(stored, heads if base.endswith("q_proj") else kv_heads)
        raw = None if stored.dtype in (np.float32, np.float16) else gguf.GGMLQuantizationType[qtype]
        w.add_tensor(f"{names.get_name(base)}.{suffix}", stored, raw_dtype=raw)
        if arch in NORM_PLUS_ONE and base.endswith("norm"):
            values = values - 1
        decoded[name] = torch.from_numpy(np.ascontiguousarray(values))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded
