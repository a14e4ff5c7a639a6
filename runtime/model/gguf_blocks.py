"""A GGUF file's own quantized blocks, so that int8 / int4 loads compute with them.

A GGUF is converted once into a checkpoint folder of dequantized weights
(runtime/model/model_loader.py). Quantizing those again would put weights that were Q4_1
onto another grid. Instead `save_blocks` keeps, beside the converted weights, the file's
blocks of the three types our kernels compute with as they are (ggml-quants.c, 32 weights
a block):

- Q4_0: {fp16 d; 16 bytes: byte i holds weight i (low nibble) and i + 16 (high)},
  w = d (q - 8): quantize.py's int4 form with scale d, min -8 d (exact in fp16).
- Q4_1: {fp16 d, fp16 m; the same nibbles}, w = d q + m: int4 with scale d, min m.
- Q8_0: {fp16 d; 32 int8}, w = d q: the q8_0 form (an fp16 scale per 32 inputs; a
  per-row int8 scale cannot hold them).

and, for every quantized tensor of another type (Q4_K, Q6_K, Q5_0, ...), which type it is,
so that its re-quantization is reported at load.

Weights are found by content: each row of every quantized tensor is keyed by a hash of its
dequantized values (gguf's own dequantization, which transformers' reader gives the
converted folder). A weight the runner quantizes (a fused q/k/v, an LM head, an expert) whose
rows are all rows of one block type takes the file's blocks, checked value for value; so the
GGUF's names, transformers' renaming and its q/k row reordering do not matter.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sgl_nb.runtime.model.quantize import dequantize, pack_int4

BLOCKS_FILE = "gguf_blocks/blocks.safetensors"  # in the converted folder; not a *.safetensors there
OWN_TYPES = ("Q4_0", "Q4_1", "Q8_0")
UNQUANTIZED_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def own_form(data: np.ndarray, qtype: str) -> dict[str, torch.Tensor]:
    """One tensor's blocks (uint8 [rows, row bytes], as gguf's reader gives them) in
    quantize.py's form: int4 for Q4_0 / Q4_1, q8_0 for Q8_0."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, BLOCK_BYTES[qtype])

    def fp16_at(byte: int) -> torch.Tensor:  # [rows, groups], each block's fp16 at `byte`
        return torch.from_numpy(blocks[..., byte:byte + 2].copy().view(np.float16)[..., 0])

    d = fp16_at(0)
    if qtype == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows, -1)
        return {"qweight": q, "scale": d}
    nibbles = torch.from_numpy(blocks[..., -16:].copy())  # [rows, groups, 16]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(rows, -1)  # weights in order
    low = -8 * d if qtype == "Q4_0" else fp16_at(2)
    return {"qweight": pack_int4(q), "scale": d, "min": low}


def row_keys(w: torch.Tensor | np.ndarray) -> list[bytes]:
    """Each row's key: a hash of its float32 values (the same in every process)."""
    a = w.float().contiguous().numpy() if isinstance(w, torch.Tensor) else \
        np.ascontiguousarray(w, dtype=np.float32)
    return [hashlib.blake2b(row.tobytes(), digest_size=8).digest() for row in a]


def _keys_tensor(keys: list[bytes]) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(b"".join(keys), dtype=np.int64).copy())


def save_blocks(gguf: Path, target: Path) -> None:
    """Write `gguf`'s blocks (OWN_TYPES) and every quantized tensor's row keys and type into
    the converted folder `target` (an empty file when it holds no quantized tensor)."""
    from gguf import dequantize as gguf_dequantize
    from safetensors.torch import save_file

    from sgl_nb.runtime.model.gguf_reading import open_gguf

    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for t in open_gguf(gguf).tensors:
        qtype = t.tensor_type.name
        if qtype in UNQUANTIZED_TYPES or len(t.shape) < 2:
            continue
        types[t.name] = qtype
        data = t.data.reshape(-1, t.data.shape[-1])  # rows (a MoE's experts one after another)
        values = gguf_dequantize(data, t.tensor_type)
        tensors[f"{t.name}/keys"] = _keys_tensor(row_keys(values))
        form = own_form(data, qtype) if qtype in OWN_TYPES else {}
        if all(v.isfinite().all() for v in form.values() if v.is_floating_point()):
            # (Q4_0's min -8 d leaves fp16 beyond |d| = 8188: that tensor is re-quantized.)
            tensors.update({f"{t.name}/{part}": v for part, v in form.items()})
    path = target / BLOCKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"types": json.dumps(types), "file": gguf.name})
    tmp.replace(path)


@dataclass
class Requantized:
    """A weight with rows from the file's quantized tensors that kept none of its blocks."""
    sources: list[str]  # tensor names, "blk.0.attn_q.weight (Q6_K)"
    error: float  # ||w' - w|| / ||w||, w the file's weight, w' what the kernels use


@dataclass
class FileBlocks:
    """The blocks of the GGUF a checkpoint folder was converted from (`read`), found by
    content (`form_of`); what could not keep its blocks is noted for `report`."""
    file: str
    types: dict[str, str]  # tensor -> its GGUF type
    keys: dict[bytes, list[tuple[str, int]]]  # row key -> (tensor, row) holding those values
    forms: dict[str, dict[str, torch.Tensor]]  # OWN_TYPES tensors in quantize.py's form
    requantized: list[Requantized] = field(default_factory=list)

    @classmethod
    def read(cls, folder: str | Path) -> FileBlocks | None:
        """The folder's blocks, None when it was converted from no quantized GGUF."""
        from safetensors import safe_open

        path = Path(folder) / BLOCKS_FILE
        if not path.is_file():
            return None
        forms: dict[str, dict[str, torch.Tensor]] = {}
        keys: dict[bytes, list[tuple[str, int]]] = {}
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            for name in f.keys():
                tensor, part = name.rsplit("/", 1)
                if part != "keys":
                    forms.setdefault(tensor, {})[part] = f.get_tensor(name)
                    continue
                raw = f.get_tensor(name).numpy().tobytes()
                for row in range(len(raw) // 8):
                    keys.setdefault(raw[8 * row: 8 * row + 8], []).append((tensor, row))
        types = json.loads(meta["types"])
        return cls(meta["file"], types, keys, forms) if types else None

    def form_of(self, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """`w` [N, K] in the file's own form, when every row of it is a row of tensors of
        one of OWN_TYPES; else None (and, if rows of it were the file's, that is noted)."""
        w = w.float()
        found = [self.keys.get(k, []) for k in row_keys(w)]
        for qtype in OWN_TYPES:
            picks = [next((s for s in f if s[0] in self.forms and self.types[s[0]] == qtype),
                          None) for f in found]
            if all(p is not None for p in picks):
                form = self._gather(picks)
                if torch.equal(dequantize(form), w):  # never trust a hash alone
                    return form
        return None

    def note(self, w: torch.Tensor, t: dict[str, torch.Tensor]) -> None:
        """`t`, the quantized form `w` got instead of the file's blocks: noted for `report`
        when rows of `w` are the file's quantized ones."""
        w = w.float()
        names = {s[0] for k in row_keys(w) for s in self.keys.get(k, [])[:1]}
        if names:
            err = (dequantize(t) - w).norm() / w.norm().clamp(min=1e-30)
            self.requantized.append(Requantized(
                sorted(f"{n} ({self.types[n]})" for n in names), float(err)))

    def report(self, quantization: str) -> str | None:
        """What the load re-quantized of the file's weights and the error it made, or None."""
        if not self.requantized:
            return None
        errors = [r.error for r in self.requantized]
        worst = max(self.requantized, key=lambda r: r.error)
        kinds: dict[str, int] = {}
        for r in self.requantized:
            for s in r.sources:
                kind = s.rsplit("(", 1)[1].rstrip(")")
                kinds[kind] = kinds.get(kind, 0) + 1
        counts = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        return (f"{quantization}: {len(errors)} weight(s) of {self.file} ({counts} tensors) "
                f"were quantized again to {quantization} from their dequantized values (no "
                f"kernel computes with blocks of their type, or a fused layer mixes types): "
                f"relative RMS error against the file's weights "
                f"{statistics.mean(errors):.3g} mean, {worst.error:.3g} max "
                f"({', '.join(worst.sources)}). Q4_0, Q4_1 and Q8_0 tensors keep their blocks")

    def _gather(self, picks: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        """The rows `picks` ((tensor, row) per output row) of the file's forms, stacked."""
        by_tensor: dict[str, tuple[list[int], list[int]]] = {}
        for i, (name, row) in enumerate(picks):
            at, rows = by_tensor.setdefault(name, ([], []))
            at.append(i)
            rows.append(row)
        first = self.forms[picks[0][0]]
        out = {part: v.new_empty((len(picks), *v.shape[1:])) for part, v in first.items()}
        for name, (at, rows) in by_tensor.items():
            for part, v in self.forms[name].items():
                out[part][torch.tensor(at)] = v[torch.tensor(rows)]
        return out

