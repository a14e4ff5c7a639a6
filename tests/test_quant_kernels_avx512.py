"""The AVX-512 VNNI quantized kernels (kernels/cpu_quant_matmul.h) against the AVX2 ones.

Where the build has AVX-512 VNNI, the int8 and Q8_0 blocks (one row of x against a panel
of 8 weight rows, up to 4 rows against 2) and the int4 panels (up to 4 rows against 8; from
8 rows of x on, two panels at once) take dpbusd; their float part is the AVX2 kernels', so
the two give the same bits, and a row decoded alone gets the bits it gets in a batch. The
module's set_isa switches between them in one build. Our kernels take N a multiple of 8
only (an int8 layer of other N goes to torch's kernel: tests/test_cpu_decode.py).
"""

from __future__ import annotations

import pytest
import torch

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.model.linear import Int4Linear, Int8Linear, make_linear
from sgl_nb.runtime.model.quantize import INT4_GROUP, dequantize, quantize

ext = cpu_decode.load()
VNNI = "avx512_vnni"
pytestmark = pytest.mark.skipif(
    ext is None or VNNI not in ext.kernel_isas(),
    reason="no AVX-512 VNNI kernels here: the CPU lacks avx512f/bw/vl/vnni (or no C++ "
           "compiler), and the AVX2 kernels are the only ones built",
)


@pytest.fixture
def isa():
    """ext.set_isa, with the default (the widest) put back afterwards."""
    before = ext.kernel_isa()
    yield ext.set_isa
    ext.set_isa(before)


def q8_0(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """GGUF's Q8_0 blocks of w: int8 values and an fp16 scale per group of 32 inputs."""
    n, k = w.shape
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    scale = (groups.abs().amax(-1) / 127).clamp(min=1e-6).half()
    q = torch.round(groups / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q.view(n, k), "scale": scale}


def layer_of(form: str, n: int, k: int):
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[:, 5] *= 20  # an outlier column, as real layers have
    t = q8_0(w) if form == "q8_0" else quantize(w, form)
    # A Q8_0 weight takes its own kernel in any mode (quantize.form_of).
    layer, why = make_linear(w, None, torch.bfloat16, "cpu", "int4" if form == "q8_0" else form, t)
    assert why is None and isinstance(layer, Int4Linear | Int8Linear)
    assert layer.native  # our kernel, not torch's
    return layer, dequantize(t)


def assert_close_to_dequantized(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """x is rounded to int8 per group of 32: error <= sum |w| * half a step."""
    rows, k = x.shape
    want = x.float() @ w.T
    step = x.float().view(rows, -1, INT4_GROUP).abs().amax(-1, keepdim=True) / 127
    bound = (step / 2).expand(rows, k // INT4_GROUP, INT4_GROUP).reshape(rows, k) @ w.abs().T
    assert ((got.float() - want).abs() <= bound + 2e-2 * want.abs().max()).all()
    assert (got.float() - want).abs().mean() < 0.02 * want.abs().mean()


SHAPES = [(form, n, k) for form, ns in [("int4", (16, 48, 96)), ("q8_0", (8, 40, 104)),
                                        ("int8", (8, 104))]
          for n in ns for k in (576, 1536, 64, 128, 96)]


@pytest.mark.parametrize("form,n,k", SHAPES)
def test_vnni_gives_the_avx2_bits_and_the_batch_bits(isa, form, n, k):
    layer, w = layer_of(form, n, k)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    for rows in (1, 2, 5, 8, 17):
        isa("avx2")
        avx2 = layer(x[:rows])
        isa(VNNI)
        vnni = layer(x[:rows])
        assert torch.equal(vnni, avx2), (form, n, k, rows)
        assert_close_to_dequantized(vnni, x[:rows], w)
    # Decode (one row, a panel of 8) gives a row the bits a batch (blocks of up to 4 rows
    # against 2 weight rows) gives it, with either instruction set.
    isa("avx2")
    batch = layer(x)
    isa(VNNI)
    for i in (0, 6, 16):
        assert torch.equal(layer(x[i : i + 1])[0], batch[i])


def test_vnni_is_the_default_and_a_bad_name_lists_the_choices(isa):
    assert ext.kernel_isas() == [VNNI, "avx2"]
    assert ext.kernel_isa() == VNNI
    isa("avx2")
    assert ext.kernel_isa() == "avx2"
    with pytest.raises(RuntimeError, match="no instruction set 'avx512' in this build "
                                           r"\(avx512_vnni, avx2\)"):
        isa("avx512")
    assert ext.kernel_isa() == "avx2"
