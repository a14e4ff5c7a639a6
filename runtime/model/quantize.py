"""Weight-only quantization of one matrix, in a device-independent form (what the cache keeps).

The modes a user asks for are int8 and int4; a layer's quantized form is one of three, told
apart by its tensors (`form_of`):

- int8: symmetric per output channel. q int8 [N, K] in [-127, 127], scale fp32 [N];
  w ~= q * scale[:, None].
- int4: asymmetric in groups of INT4_GROUP consecutive inputs, GGUF's Q4_1 block: q holds two
  4-bit values per byte, uint8 [N, K/2] (column 2j in the high nibble, 2j+1 in the low one);
  scale and min fp16 [N, K/G]; w = q * scale + min. A Q4_0 block (w = d (q - 8)) is the
  same with min = -8 d.
- q8_0: GGUF's Q8_0 block, int8 with one scale per group: q int8 [N, K], scale fp16
  [N, K/G]; w = q * scale. Only a GGUF's own blocks take it (runtime/model/gguf_blocks.py).

The kernels compute with these values as they are (fp16 scale and min, kernels/
cpu_quant_matmul.h), so a GGUF's Q4_0 / Q4_1 / Q8_0 blocks run unchanged, and `dequantize`
gives bit for bit the weight that gguf's own dequantization gives.
"""

from __future__ import annotations

import torch

INT4_GROUP = 32
QUANTIZATIONS = ("int8", "int4")  # the modes
FORMS = ("int8", "int4", "q8_0")  # a layer's quantized form
FP16_MAX = 65504.0


def form_of(t: dict[str, torch.Tensor]) -> str:
    """Which of FORMS the quantized weight `t` is in."""
    if "min" in t:
        return "int4"
    return "q8_0" if t["scale"].dim() == 2 else "int8"


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    w = w.float()
    # An all-zero row would divide by zero: any positive scale reproduces it.
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q.contiguous(), "scale": scale.contiguous()}


def dequantize_int8(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return t["qweight"].float() * t["scale"][:, None]


def dequantize_q8_0(t: dict[str, torch.Tensor]) -> torch.Tensor:
    q = t["qweight"]
    n, k = q.shape
    groups = t["scale"].shape[1]
    return (q.float().view(n, groups, k // groups) * t["scale"].float()[..., None]).view(n, k)


def int4_shape_error(n: int, k: int, group: int = INT4_GROUP) -> str | None:
    """Why the int4 kernels cannot take an [n, k] weight, or None if they can."""
    if k % group:
        return f"input size {k} is not a multiple of the group size {group}"
    if n % 16:
        return f"output size {n} is not a multiple of 16"
    return None


def weight_shape(t: dict[str, torch.Tensor], quantization: str | None = None) -> tuple[int, int]:
    """[N, K] of the weight whose quantized form is `t`."""
    n, width = t["qweight"].shape
    return (n, width * 2) if form_of(t) == "int4" else (n, width)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> dict[str, torch.Tensor]:
    """Q4_1's scheme (min and max per group, 15 steps), with q rounded against the fp16
    scale and min the kernels compute with."""
    n, k = w.shape
    assert int4_shape_error(n, k, group) is None, int4_shape_error(n, k, group)
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    if max(-lo.min().item(), hi.max().item()) > FP16_MAX:
        raise ValueError(f"int4 keeps scale and min in fp16: a weight of magnitude "
                         f"{max(-lo.min().item(), hi.max().item()):.3g} is beyond its range")
    scale, low = ((hi - lo) / 15).half(), lo.half()
    s, m = scale.float()[..., None], low.float()[..., None]
    # A constant group has scale 0: q = 0 gives back its min.
    q = torch.where(s > 0, torch.round((g - m) / s), torch.zeros_like(g))
    q = q.clamp(0, 15).reshape(n, k)
    return {"qweight": pack_int4(q), "scale": scale.contiguous(), "min": low.contiguous()}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] values 0..15 -> uint8 [N, K/2], column 2j in the high nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4 | q[:, 1::2]).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int32 [N, K] values 0..15."""
    n = packed.shape[0]
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(n, -1).to(torch.int32)


def dequantize_int4(t: dict[str, torch.Tensor]) -> torch.Tensor:
    q = unpack_int4(t["qweight"]).float()
    n, k = q.shape
    groups = t["scale"].shape[1]
    q = q.view(n, groups, k // groups)
    # A product, then a sum (two roundings, no fused multiply-add): gguf's d * q + m.
    w = q * t["scale"].float()[..., None] + t["min"].float()[..., None]
    return w.view(n, k)


def quantize(w: torch.Tensor, quantization: str, exact=None) -> dict[str, torch.Tensor]:
    """`w` in the form of `quantization`; with `exact` (gguf_blocks.FileBlocks), in the GGUF
    file's own form where w is exactly the file's blocks (whichever mode was asked), and
    a re-quantization of the file's other quantized weights noted for its report."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got "
                         f"{quantization!r}")
    own = None if exact is None else exact.form_of(w)
    if own is not None:
        return own
    t = quantize_int8(w) if quantization == "int8" else quantize_int4(w)
    if exact is not None:  # rows of w may be the file's, of a type no kernel takes
        exact.note(w, t)
    return t


def dequantize(t: dict[str, torch.Tensor], quantization: str | None = None) -> torch.Tensor:
    """The fp32 weight of the quantized form `t` (its form read off its tensors)."""
    form = form_of(t)
    if form == "int4":
        return dequantize_int4(t)
    return dequantize_q8_0(t) if form == "q8_0" else dequantize_int8(t)
