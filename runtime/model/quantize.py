"""Weight-only quantization of one matrix, in a device-independent form (what the cache keeps).

- int8: symmetric per output channel. q int8 [N, K] in [-127, 127], scale fp32 [N];
  w ~= q * scale[:, None].
- int4: asymmetric in groups of INT4_GROUP consecutive inputs. q holds two 4-bit values per
  byte, uint8 [N, K/2] (column 2j in the high nibble, 2j+1 in the low one); scale and zero
  fp32 [N, K/G]; w ~= (q - 8) * scale + zero, the convention of torch's int4 kernels, whose
  packed layouts are derived from this at load (runtime/model/linear.py).

The int4 scheme (min/max per 32 inputs, 15 steps) is the one GGUF's Q4_1 uses, so weights
that were Q4_1 come back on the same grid.
"""

from __future__ import annotations

import torch

INT4_GROUP = 32
QUANTIZATIONS = ("int8", "int4")


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    w = w.float()
    # An all-zero row would divide by zero: any positive scale reproduces it.
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q.contiguous(), "scale": scale.contiguous()}


def dequantize_int8(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return t["qweight"].float() * t["scale"][:, None]


def int4_shape_error(n: int, k: int, group: int = INT4_GROUP) -> str | None:
    """Why the int4 kernels cannot take an [n, k] weight, or None if they can."""
    if k % group:
        return f"input size {k} is not a multiple of the group size {group}"
    if n % 16:
        return f"output size {n} is not a multiple of 16"
    return None


def weight_shape(t: dict[str, torch.Tensor], quantization: str) -> tuple[int, int]:
    """[N, K] of the weight whose quantized form is `t`."""
    n, width = t["qweight"].shape
    return (n, width * 2) if quantization == "int4" else (n, width)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> dict[str, torch.Tensor]:
    n, k = w.shape
    assert int4_shape_error(n, k, group) is None, int4_shape_error(n, k, group)
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)  # a constant group: any positive scale
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(n, k)
    return {
        "qweight": (q[:, 0::2] << 4 | q[:, 1::2]).contiguous(),
        "scale": scale.contiguous(),
        "zero": (lo + 8 * scale).contiguous(),
    }


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int32 [N, K] values 0..15."""
    n = packed.shape[0]
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(n, -1).to(torch.int32)


def dequantize_int4(t: dict[str, torch.Tensor]) -> torch.Tensor:
    q = unpack_int4(t["qweight"]).float()
    n, k = q.shape
    groups = t["scale"].shape[1]
    q = q.view(n, groups, k // groups)
    w = (q - 8) * t["scale"][..., None] + t["zero"][..., None]
    return w.view(n, k)


def quantize(w: torch.Tensor, quantization: str) -> dict[str, torch.Tensor]:
    if quantization == "int8":
        return quantize_int8(w)
    if quantization == "int4":
        return quantize_int4(w)
    raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")


def dequantize(t: dict[str, torch.Tensor], quantization: str) -> torch.Tensor:
    return dequantize_int8(t) if quantization == "int8" else dequantize_int4(t)
