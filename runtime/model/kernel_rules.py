"""Which native kernel may take a quantized [N, K] weight, decided before any call.

A native kernel called on a shape it does not handle can crash the process that called it
(in a notebook, the user's Jupyter kernel and everything in it), so every quantized layer's
kernel is chosen here from rules read off each kernel's source; a shape no kernel is known
to take stays dense. What passes is then run once per CPU in a probe process
(runtime/model/kernel_probe.py) before the layer is used.

- Ours (kernels/cpu_quant_matmul.h, bf16 or fp32 activations): int8 and q8_0 (a GGUF's
  Q8_0 blocks: int8 with an fp16 scale per 32 inputs) take K % 32 == 0 (one group of 32
  inputs per 32-byte unit) and N % 8 == 0 (panels of 8 weight rows); int4 takes K % 32 == 0
  (one group of a panel's 8 rows per 128 bytes) and N % 8 == 0. Unaligned loads only;
  each call checks the layout it is given and raises, not crashes, when it does not fit.
  q8_0 has no other kernel: a layer ours does not take stays dense.
- torch's `_weight_int8pack_mm` (aten/src/ATen/native/cpu/int8mm_kernel.cpp, torch 2.13):
  its AVX-512 bf16 path reads 16 inputs at a time with no tail and aligned loads
  (`_mm256_load_si256` on each activation row, `_mm_load_si128` on each weight row: a
  `vmovdqa` in the built library), its AVX2 path 8 with an aligned activation load. So
  K % 16 == 0, and the layer hands it both operands contiguous at a 64-byte boundary
  (`aligned`): a tensor read from a safetensors file can sit 8 bytes off one, and that
  segfaulted the LM head of a cached int8 load. N: any (blocks of 4 outputs, the
  remainder handled).
- torch's `_weight_int4pack_mm_for_cpu` (int4mm_kernel.cpp): unaligned loads, groups of
  32/64/128/256 inputs (K % 32 == 0 here), N in blocks of 16 to 64 (N % 16 == 0; its
  packing raises otherwise).
"""

from __future__ import annotations

import torch

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.model.quantize import INT4_GROUP

OURS_INT8, TORCH_INT8 = "ours-int8", "torch-int8"
OURS_INT4, TORCH_INT4 = "ours-int4", "torch-int4"
OURS_Q8_0 = "ours-q8_0"
CUDA_INT8, CUDA_INT4 = "torch-cuda-int8", "torch-cuda-int4"

ALIGN = 64  # bytes: the CPU allocator's own alignment, and more than any load here needs

_NAMES = {
    OURS_INT8: "our int8 kernel", TORCH_INT8: "torch's int8 kernel",
    OURS_INT4: "our int4 kernel", TORCH_INT4: "torch's int4 kernel",
    OURS_Q8_0: "our Q8_0 kernel",
    CUDA_INT8: "torch's CUDA int8 kernel", CUDA_INT4: "torch's CUDA int4 kernel",
}
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def describe(kernel: str) -> str:
    return _NAMES[kernel]


def shape_text(n: int, k: int, dtype: torch.dtype | str) -> str:
    """"[N, K] bf16": how warnings and verdicts name a shape."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return f"[{n}, {k}] {_DTYPES.get(dtype, str(dtype))}"


def choose(quantization: str, n: int, k: int, dtype: torch.dtype,
           device: torch.device | str) -> tuple[str | None, str | None]:
    """(the kernel for a quantized [n, k] weight, None), or (None, why none takes it)."""
    device = torch.device(device)
    ours = (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and n % 8 == 0
            and cpu_decode.available())
    if quantization == "q8_0":
        if ours and k % INT4_GROUP == 0:
            return OURS_Q8_0, None
        return None, (f"no kernel takes GGUF Q8_0 blocks on {device.type} for "
                      f"{shape_text(n, k, dtype)} (ours: CPU, bf16 or fp32, inputs a multiple "
                      f"of {INT4_GROUP}, outputs of 8)")
    if device.type == "cuda":
        return (CUDA_INT8 if quantization == "int8" else CUDA_INT4), None
    if device.type != "cpu":
        return None, f"no {quantization} kernel on {device.type}"
    if quantization == "int8":
        if ours and k % INT4_GROUP == 0:
            return OURS_INT8, None
        if k % 16 == 0:
            return TORCH_INT8, None
        return None, (f"no int8 kernel takes {shape_text(n, k, dtype)}: torch's needs an input "
                      f"size that is a multiple of 16 (ours: of 32, with outputs of 8)")
    if ours and k % INT4_GROUP == 0:
        return OURS_INT4, None
    if k % INT4_GROUP == 0 and n % 16 == 0:
        return TORCH_INT4, None
    return None, (f"no int4 kernel takes {shape_text(n, k, dtype)}: torch's needs inputs a "
                  f"multiple of {INT4_GROUP} and outputs of 16")


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous at an ALIGN-byte boundary: itself when it is, else a copy."""
    t = t.contiguous()
    return t if t.data_ptr() % ALIGN == 0 else t.clone()
