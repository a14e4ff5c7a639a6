"""The model runner's linear layers, behind one call: y = layer(x), x [T, K] -> [T, N].

Four implementations: dense fp32, dense bf16 (DenseLinear in either dtype), int8 weight-only
(per-output-channel scales, or GGUF Q8_0's fp16 scale per 32 inputs) and int4 weight-only
(groups of 32 inputs with an fp16 scale and min: GGUF's Q4_1 block). The quantized forms are
runtime/model/quantize.py's.

`make_linear` builds one from a weight and, for int8/int4, its quantized form
(runtime/model/quantize.py), with the kernel runtime/model/kernel_rules.py picks for its shape, once
that kernel and shape have passed a check in a probe process (runtime/model/kernel_probe.py); it
falls back to the dense layer, with a warning, when no kernel takes the shape or the check
failed (a crash there kills the probe process, never the caller).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.model import kernel_rules
from sgl_nb.runtime.model.kernel_probe import Probe, check_layer, verdicts
from sgl_nb.runtime.model.kernel_rules import OURS_INT4, OURS_INT8, OURS_Q8_0, aligned
from sgl_nb.runtime.model.quantize import (
    INT4_GROUP,
    QUANTIZATIONS,
    form_of,
    int4_shape_error,
    unpack_int4,
    weight_shape,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Bound once: calling an OpOverload directly skips the overload resolution of the packet.
_int8_mm = torch.ops.aten._weight_int8pack_mm.default
_int4_mm_cpu = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_int4_mm_cuda = torch.ops.aten._weight_int4pack_mm.default


def check_quantization(quantization: str | None) -> str | None:
    if quantization is None or quantization in QUANTIZATIONS:
        return quantization
    raise ValueError(
        f"quantization must be one of {list(QUANTIZATIONS)} or None, got {quantization!r}"
    )


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device | str, quantization: str | None
) -> torch.dtype:
    """The activation and KV-cache dtype. None: bf16 on CUDA or with int8/int4 weights,
    fp32 otherwise (bf16 matmuls on CPUs without bf16 instructions are slower than fp32
    beyond a few rows; README "Precision modes" has the figures). int8/int4 with fp32
    activations is the CPU kernels' exact path (kernels/cpu_quant_matmul.h); CUDA's
    quantized kernels take 16-bit activations only."""
    quantization = check_quantization(quantization)
    if dtype is None:
        cuda = torch.device(device).type == "cuda"
        return torch.bfloat16 if cuda or quantization else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if quantization and dtype == torch.float32 and torch.device(device).type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} on {torch.device(device).type} computes with 16-bit "
            "activations: pass dtype='bfloat16' (or 'float16'), or leave dtype unset"
        )
    return dtype


class DenseLinear:
    """Plain weight matmul (fp32 or bf16 weights), optional bias.

    On CPU every call takes kernels/cpu_dense_matmul.h's kernel, the weight kept only in its
    panel layout (`panels`, `weight` None): 1.5-2x ATen's fp32 GEMM from 16 to 400 rows and
    8x its bf16 matmul on CPUs without bf16 instructions, at one row reading the weight at
    about the memory's speed (measured). Like the quantized kernels it gives each row the
    same bits in any batch, prefill or decode. ATen's matmul elsewhere (CUDA, fp16, or an
    output size not a multiple of 16).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.contiguous()
        usable = (weight.device.type == "cpu" and self.out_features % PANEL == 0
                  and weight.dtype in (torch.float32, torch.bfloat16))
        self._ext = cpu_decode.load() if usable and cpu_decode.available() else None
        self.panels = None if self._ext is None else dense_panels(weight)
        self.weight = weight.contiguous() if self._ext is None else None
        self._no_bias = torch.empty(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._ext is not None:
            bias = self._no_bias if self.bias is None else self.bias
            return self._ext.dense_linear(x, self.panels, bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def native(self) -> bool:
        """Whether our kernel (kernels/cpu_dense_matmul.h) computes this layer,
        rather than ATen's matmul."""
        return self._ext is not None

    def kernel_tensors(self) -> list[torch.Tensor]:
        """The weights our CPU kernel streams at each call, in order (none for ATen's)."""
        return [] if self.panels is None else [self.panels]

    def move_to(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """kernel_tensors() replaced by their copies place(t) (runtime/model/weight_arena.py)."""
        if self.panels is not None:
            self.panels = place(self.panels)

    @property
    def read_bytes(self) -> int:
        """Bytes of weights (and bias) one call reads, whatever the number of rows."""
        return _nbytes(self.panels if self.weight is None else self.weight, self.bias)


PANEL = 16  # output columns per panel of cpu_dense_matmul.h's weight layout


def dense_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K, 16]: panel p holds columns 16p..16p+15 of the output, k-major."""
    n, k = weight.shape
    return weight.view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


class Int8Linear:
    """int8 weights, one scale per output channel, y = (x @ q.T) * scale (+ bias), or one
    fp16 scale per group of 32 inputs (GGUF's Q8_0, scale [N, K / 32]; our kernel only).

    `kernel` is runtime/model/kernel_rules.py's name (None: its choice for the shape). Ours,
    kernels/cpu_quant_matmul.h (1.5-3x torch's at 1 to 256 rows, measured), gives each row
    the same bits in any batch and keeps the weight only in its interleaved layout
    (`panels`, `qweight` None). torch's gets both operands contiguous at a 64-byte boundary:
    its AVX-512 path loads them with aligned loads.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, kernel: str | None = None):
        self.out_features, self.in_features = qweight.shape
        form = "q8_0" if scale.dim() == 2 else "int8"
        self.kernel = kernel or _chosen(form, *qweight.shape, dtype, qweight.device)
        # Ours takes Q8_0's fp16 scales as the file holds them, a row's scale in fp32;
        # torch's a row's scale in the activations' dtype.
        ours = self.kernel in (OURS_INT8, OURS_Q8_0)
        row_dtype = torch.float32 if ours else dtype
        self.scale = (scale.half() if form == "q8_0" else scale.to(row_dtype)).contiguous()
        self.bias = None if bias is None else bias.to(dtype).contiguous()
        self._ext = cpu_decode.load() if ours else None
        self.panels = None if self._ext is None else interleave_rows(qweight, INT4_GROUP)
        self.qweight = aligned(qweight) if self._ext is None else None
        self._no_bias = torch.empty(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._ext is not None:
            bias = self._no_bias if self.bias is None else self.bias
            return self._ext.int8_linear(x, self.panels, self.scale, bias)
        y = _int8_mm(aligned(x), self.qweight, self.scale)
        if self.bias is not None:
            y += self.bias  # in place: no second output tensor
        return y

    @property
    def native(self) -> bool:
        """Whether our kernel (kernels/cpu_quant_matmul.h) computes this layer,
        rather than torch's int8 kernel."""
        return self._ext is not None

    def kernel_tensors(self) -> list[torch.Tensor]:
        return [] if self.panels is None else [self.panels, self.scale]

    def move_to(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.panels is not None:
            self.panels, self.scale = place(self.panels), place(self.scale)

    @property
    def read_bytes(self) -> int:
        return _nbytes(self.qweight if self.panels is None else self.panels, self.scale,
                       self.bias)



class Int4Linear:
    """int4 weights in groups of 32 inputs, each with an fp16 scale and min.

    With our kernel (runtime/model/kernel_rules.py's choice on CPU for an input size that is
    a multiple of 32) the weight is also kept in kernels/cpu_quant_matmul.h's layout
    (`small`: nibbles, scale, min in panels of 8 rows, group_nibbles and panel_groups) and every
    call takes it: 1.5-3x torch's from 1 to 256 rows (measured) and, unlike it, giving each
    row the same bits in any batch, so a request's tokens never depend on what it ran with.
    torch's kernel takes scale and zero point = min + 8 scale in the activations' dtype.
    """

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None, group: int = INT4_GROUP,
                 small: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 kernel: str = kernel_rules.TORCH_INT4):
        self.packed = packed  # torch's kernel's own layout
        self.scale_zeros = scale_zeros  # [K / group, N, 2], the activations' dtype
        self.group = group
        self.kernel = kernel
        self._out, self._in = out_features, scale_zeros.shape[0] * group
        self.bias = bias
        self._mm = _int4_mm_cuda if packed.is_cuda else _int4_mm_cpu
        self.small = small
        self._ext = cpu_decode.load() if small is not None else None
        self._no_bias = torch.empty(0)

    @classmethod
    def from_quantized(cls, t: dict[str, torch.Tensor], bias: torch.Tensor | None,
                       dtype: torch.dtype, device: torch.device,
                       kernel: str | None = None) -> Int4Linear:
        q = t["qweight"].to(device)
        n = q.shape[0]
        kernel = kernel or _chosen("int4", n, q.shape[1] * 2, dtype, device)
        if device.type == "cuda":
            # tinygemm takes the nibble-packed uint8 form directly; K must be a multiple of
            # 16 * inner_k_tiles (2, 4 or 8), and K % 32 == 0 already holds.
            k = q.shape[1] * 2
            tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack(q.contiguous(), tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(q), 1)
        scale = t["scale"].float()
        sz = torch.stack([scale, t["min"].float() + 8 * scale], dim=-1).transpose(0, 1)
        sz = sz.to(device=device, dtype=dtype).contiguous()
        b = None if bias is None else bias.to(device=device, dtype=dtype).contiguous()
        small = None
        if kernel == OURS_INT4:
            small = (group_nibbles(q), panel_groups(t["scale"]), panel_groups(t["min"]))
        return cls(packed, sz, n, b, small=small, kernel=kernel)

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def in_features(self) -> int:
        return self._in

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._ext is not None:
            bias = self._no_bias if self.bias is None else self.bias
            return self._ext.int4_linear(x, *self.small, bias)
        y = self._mm(x, self.packed, self.group, self.scale_zeros)
        if self.bias is not None:
            y += self.bias
        return y

    @property
    def native(self) -> bool:
        """Whether our kernel (kernels/cpu_quant_matmul.h) computes this layer,
        rather than torch's int4 kernel."""
        return self._ext is not None

    def kernel_tensors(self) -> list[torch.Tensor]:
        return [] if self.small is None else list(self.small)

    def move_to(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.small is not None:
            self.small = tuple(place(t) for t in self.small)

    @property
    def read_bytes(self) -> int:
        if self.small is not None:
            return _nbytes(*self.small, self.bias)
        return _nbytes(self.packed, self.scale_zeros, self.bias)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)



def group_nibbles(q: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """runtime/model/quantize.py's int4 bytes [N, K / 2] -> cpu_quant_matmul.h's [N / 8,
    K / 32, 128]: per row and group of 32 inputs 16 bytes, byte i holding input i (low
    nibble) and input i + 16 (high nibble); per panel of 8 rows and group, unit u (32 bytes)
    holds bytes 4u..4u+3 of the 8 rows in turn, so that a 32-bit lane is one row."""
    v = unpack_int4(q).to(torch.uint8)
    n, k = v.shape
    v = v.view(n, k // group, 2, group // 2)
    rows = v[:, :, 0] | v[:, :, 1] << 4  # [N, G, 16]
    return rows.view(n // ROW_PANEL, ROW_PANEL, k // group, 4, 4).permute(0, 2, 3, 1, 4).reshape(
        n // ROW_PANEL, k // group, ROW_PANEL * group // 2).contiguous()


ROW_PANEL = 8  # weight rows per panel of cpu_quant_matmul.h's interleaved layouts


def interleave_rows(w: torch.Tensor, unit_bytes: int) -> torch.Tensor:
    """[N, U * unit_bytes] -> [N / 8, U, 8 * unit_bytes]: per panel of 8 rows, unit u of rows
    0..7 side by side (cpu_quant_matmul.h's int8 layout: one stream for a block of 8 rows)."""
    n, width = w.shape
    u = width // unit_bytes
    return w.view(n // ROW_PANEL, ROW_PANEL, u, unit_bytes).transpose(1, 2).reshape(
        n // ROW_PANEL, u, ROW_PANEL * unit_bytes).contiguous()


def panel_groups(t: torch.Tensor) -> torch.Tensor:
    """[N, G] per-group values -> fp16 [N / 8, G, 8]: a panel's 8 rows side by side per group,
    as the CPU int4 kernel scales a group of 8 rows at once."""
    n, g = t.shape
    return t.to(torch.float16).view(n // ROW_PANEL, ROW_PANEL, g).transpose(1, 2).contiguous()


Linear = DenseLinear | Int8Linear | Int4Linear


class LogitsHead:
    """The LM head, fp32 logits [T, vocab] from the final hidden states.

    A bf16 matmul rounds its output to ~0.4% (0.06 at a logit of 16), which flips the greedy
    choice between near-tied tokens: on the evaluation text (tests/test_quantization.py)
    bf16 agreed with fp32 on 96.6% of the greedy choices with bf16 logits, 97.9% with these
    recomputed. With 16-bit activations the `refine` best candidates of each row are
    recomputed with fp32 accumulation and output from the 16-bit weight rows; the head's own
    matmul (16-bit, or int8: half the bytes to read) only has to rank them.
    """

    def __init__(self, linear: Linear, weight16: torch.Tensor | None, refine: int = 16,
                 native: bool = True):
        """`native` False: the refinement takes torch's ops even where our kernel would
        (the tests compare the two)."""
        self.linear = linear
        self.weight16 = weight16  # None: fp32 activations, the matmul is already exact
        self.refine = min(refine, linear.out_features)
        usable = (native and weight16 is not None and weight16.device.type == "cpu"
                  and weight16.dtype == torch.bfloat16)
        # On CPU kernels/cpu_logits.h does the refinement in one call (torch's topk alone
        # took ~0.25 ms of a decode step); torch's ops elsewhere.
        self._ext = cpu_decode.load() if usable and cpu_decode.available() else None

    @property
    def native(self) -> bool:
        """Whether our kernel (kernels/cpu_logits.h) does the refinement, rather than
        torch's ops."""
        return self._ext is not None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.linear(h).float()
        if self.weight16 is None:
            return logits
        if self._ext is not None:
            self._ext.refine_top_logits(logits, h, self.weight16, self.refine)
            return logits
        top = logits.topk(self.refine, dim=-1, sorted=False).indices  # [T, r]
        rows = self.weight16.index_select(0, top.view(-1)).view(*top.shape, -1).float()
        # Multiply and sum rather than bmm: bmm's result for a row changes with the number
        # of rows in the batch (measured), the sum over the last dim does not.
        exact = (rows * h.float().unsqueeze(1)).sum(-1)
        return logits.scatter_(1, top, exact)


def shape_error(n: int, k: int, quantization: str) -> str | None:
    """Why an [n, k] weight has no `quantization` form (None: it has); int4 groups 32 inputs
    and its kernels take outputs in sixteens."""
    if quantization == "q8_0" and k % INT4_GROUP:
        return f"input size {k} is not a multiple of the group size {INT4_GROUP}"
    return int4_shape_error(n, k) if quantization == "int4" else None


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str | None = None,
    quantized: dict[str, torch.Tensor] | None = None,
    dense: torch.Tensor | None = None,
) -> tuple[Linear, str | None]:
    """A linear layer for `weight` [N, K] (any dtype, any device) computing in `dtype`.

    With quantization, `quantized` is the weight's quantized form (None: the shape was
    rejected); its own form (quantize.form_of: a GGUF's Q8_0 blocks in int4 mode) picks the
    kernel. `dense`, if given, is the weight already in `dtype` on `device`, for the
    dense layer. Returns the layer and, when it fell back to dense, why. On CPU a kernel
    and shape not checked yet are checked first in a probe process (check_kernels does a
    whole model's at once).
    """
    device = torch.device(device)
    dense_bias = None if bias is None else bias.to(device=device, dtype=dtype)

    def dense_layer() -> DenseLinear:
        return DenseLinear(dense if dense is not None else weight.to(device, dtype), dense_bias)

    if quantization is None:
        return dense_layer(), None
    n, k = weight.shape
    if quantized is not None:
        quantization = form_of(quantized)
    kernel, why = _kernel_for(quantization, quantized is not None, n, k, dtype, device)
    if why is None:
        try:
            layer = quantized_linear(quantized, bias, dtype, device, quantization, kernel)
            if device.type != "cpu":  # no probe process there: checked here, on these weights
                why = _check_here(layer, quantized, dense_bias, kernel, n, k, dtype, device)
        except RuntimeError as e:  # the kernel rejected the input: use the dense layer
            why = (f"{kernel_rules.describe(kernel)} raised on "
                   f"{kernel_rules.shape_text(n, k, dtype)}: {str(e).splitlines()[0]}")
        if why is None:
            return layer, None
    return dense_layer(), why


def check_kernels(layers: Iterable[tuple[str, dict[str, torch.Tensor]]], dtype: torch.dtype,
                  device: torch.device | str) -> None:
    """Check, in one probe process, the CPU kernel of every (quantization, quantized weight)
    layer whose kernel and shape have no verdict yet, so that the make_linear calls after
    it find theirs cached (one process per model load, not one per layer). The kernel is
    the one for the weight's own form (quantize.form_of), as in make_linear."""
    device = torch.device(device)
    if device.type != "cpu":
        return
    probes = []
    for _, t in layers:
        quantization = form_of(t)
        n, k = weight_shape(t)
        if shape_error(n, k, quantization) is None:
            kernel, _ = kernel_rules.choose(quantization, n, k, dtype, device)
            if kernel is not None:
                probes.append(Probe.of(kernel, n, k, dtype))
    verdicts(probes)


def _kernel_for(quantization: str, have_weights: bool, n: int, k: int, dtype: torch.dtype,
                device: torch.device) -> tuple[str | None, str | None]:
    """(kernel, None) for a quantized [n, k] layer, or why it stays dense: no quantized form,
    no kernel that takes the shape, or a failed check in the probe process."""
    why = shape_error(n, k, quantization) or (None if have_weights else "no quantized weight")
    if why is not None:
        return None, why
    kernel, why = kernel_rules.choose(quantization, n, k, dtype, device)
    if kernel is None or device.type != "cpu":
        return kernel, why
    probe = Probe.of(kernel, n, k, dtype)
    return kernel, verdicts([probe])[probe]


def _chosen(quantization: str, n: int, k: int, dtype: torch.dtype, device) -> str:
    kernel, why = kernel_rules.choose(quantization, n, k, dtype, device)
    if kernel is None:
        raise ValueError(why)
    return kernel


def quantized_linear(t: dict[str, torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype,
                     device: torch.device, quantization: str, kernel: str) -> Linear:
    if quantization in ("int8", "q8_0"):
        return Int8Linear(t["qweight"].to(device), t["scale"].to(device),
                          None if bias is None else bias.to(device), dtype, kernel)
    return Int4Linear.from_quantized(t, bias, dtype, device, kernel)


def _check_here(layer: Linear, t, bias, kernel: str, n: int, k: int, dtype, device) -> str | None:
    return check_layer(layer, t, Probe.of(kernel, n, k, dtype), device=device, bias=bias)
