"""The GGUF files `sgl-nb bench peers` runs both engines on: the default model's own Q4_1
file, and Q4_0, Q8_0 and F32 files written from it (gguf-py, no llama.cpp tool).

Each written file keeps the Q4_1 file's metadata (tokenizer, chat template, shapes) and
tensor names; its Q4_1 tensors are dequantized and stored as the target type (Q4_0 rounds
them onto its own grid: a lossy file, for speed only; Q8_0 and F32 keep them to within
Q8_0's rounding and exactly). The token embedding stays Q8_0 in the quantized files, as
llama.cpp's quantize leaves a Q8_0 embedding; F32 stores every tensor as F32. Written once
into the cache folder's bench_peers/.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# target type -> (general.file_type: llama.cpp's LLAMA_FTYPE_*, the types of 2-D tensors)
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "F32": 0}
SKIPPED_KEYS = ("GGUF.", "general.architecture", "general.file_type")


def variant_path(qtype: str) -> Path:
    """The default model's GGUF of `qtype`: the shipped Q4_1 file, or one written here."""
    from sgl_nb.runtime.model.model_loader import cache_dir, default_gguf_path

    source = default_gguf_path()
    if qtype == "Q4_1":
        return source
    if qtype not in FILE_TYPES:
        raise ValueError(f"no GGUF variant {qtype!r}; known: {', '.join(FILE_TYPES)}")
    path = cache_dir() / "bench_peers" / source.name.replace(".Q4_1.", f".{qtype}.")
    if not path.is_file():
        print(f"writing {path.name} from {source.name} ...", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_variant(source, partial, qtype)
        partial.rename(path)
    return path


def _encode(tensor, qtype: str) -> tuple[np.ndarray, object]:
    """(the data to store, its raw GGML type or None for a float array)."""
    from gguf import GGMLQuantizationType, quants

    kind = tensor.tensor_type
    if kind == GGMLQuantizationType.F32 and qtype != "F32":
        return tensor.data, None  # norms stay F32 in every file
    values = quants.dequantize(tensor.data, kind).astype(np.float32)
    if qtype == "F32":
        return values, None
    if tensor.name == "token_embd.weight":
        target = GGMLQuantizationType.Q8_0
        if kind == target:
            return tensor.data, target
    else:
        target = GGMLQuantizationType[qtype]
    return quants.quantize(values, target), target


def write_variant(source: Path, out: Path, qtype: str) -> None:
    import gguf

    from sgl_nb.runtime.model.gguf_reading import open_gguf

    reader = open_gguf(source)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith(SKIPPED_KEYS):
            continue
        sub = field.types[-1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    w.add_file_type(FILE_TYPES[qtype])
    for tensor in reader.tensors:
        data, raw = _encode(tensor, qtype)
        w.add_tensor(tensor.name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
