"""The fused CPU decode step (kernels/cpu_decode.cpp) against the torch path.

Its attention against the torch reference (ragged, GQA 1 and 3, chunks merged), its int8
and int4 kernels against the dequantized weight and across batch sizes, and the whole
decode step of the default model against the torch path in fp32, bf16 and int4.
"""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch

from sgl_nb.kernels import cpu_decode, reference
from sgl_nb.runtime.kv_pool import KVPool
from sgl_nb.runtime.model.forward_batch import build_batch, greedy_picks
from sgl_nb.runtime.model.linear import DenseLinear, Int4Linear, Int8Linear, LogitsHead, make_linear
from sgl_nb.runtime.model.model import Model
from sgl_nb.runtime.model.quantize import dequantize, quantize
from sgl_nb.runtime.sampler import sample, top_alternatives
from sgl_nb.runtime.sampling_params import SamplingParams

ext = cpu_decode.load()
pytestmark = pytest.mark.skipif(ext is None, reason="no C++ compiler: the torch path runs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,heads", [(3, 3), (3, 9)])
def test_attention_matches_the_torch_reference(dtype, kv_heads, heads):
    gen = torch.Generator().manual_seed(0)
    lens = [1, 130, 7, 300]  # 130 and 300 span several 128-token chunks, merged afterwards
    slots = torch.randperm(2000, generator=gen)[: sum(lens)] + 1
    k = torch.randn(2001, kv_heads, 64, generator=gen).to(dtype)
    v = torch.randn(2001, kv_heads, 64, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, 64, generator=gen)
    indptr = torch.tensor([0, *lens]).cumsum(0)
    got = ext.decode_attention(q * 0.125, k, v, indptr, slots)
    want = reference.decode_attention(q.to(dtype), k, v, indptr, slots, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # A request's result does not depend on the others in the batch.
    own = slots[indptr[1] : indptr[2]]
    alone = ext.decode_attention(q[1:2] * 0.125, k, v, torch.tensor([0, lens[1]]), own)
    assert torch.equal(alone[0], got[1])
    # Nor on how the pool lays out its rows (KVPool's head-major buffers).
    kh, vh = head_major(k), head_major(v)
    assert torch.equal(ext.decode_attention(q * 0.125, kh, vh, indptr, slots), got)


def head_major(buf: torch.Tensor) -> torch.Tensor:
    """buf's values in a head-major buffer seen [slots, kv_heads, head_dim] (KVPool's)."""
    out = torch.empty(buf.shape[1], buf.shape[0], buf.shape[2], dtype=buf.dtype).permute(1, 0, 2)
    out.copy_(buf)
    assert out.stride(0) == buf.shape[2] and torch.equal(out, buf)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_attention_matches_the_reference_and_any_split(dtype):
    import sgl_nb.kernels as kernels

    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1001, 3, 64, generator=gen).to(dtype)
    v = torch.randn(1001, 3, 64, generator=gen).to(dtype)
    slots = torch.randperm(1000, generator=gen)[:300] + 1
    q = torch.randn(300, 9, 64, generator=gen).to(dtype)
    # Two requests: 40 new tokens over a 160-token prefix, and 100 tokens from scratch.
    qo, kv = torch.tensor([0, 40, 140]), torch.tensor([0, 200, 300])
    idx = torch.cat([slots[:200], slots[200:]])
    qs = torch.cat([q[160:200], q[200:300]])
    got = kernels.extend_attention(qs, k, v, qo, kv, idx, 0.125)
    want = kernels.reference.extend_attention(qs, k, v, qo, kv, idx, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # The first request's 200 tokens prefilled at once give its last 40 the same bits.
    whole = kernels.extend_attention(q[:200], k, v, torch.tensor([0, 200]),
                                     torch.tensor([0, 200]), slots[:200], 0.125)
    assert torch.equal(whole[160:], got[:40])
    # Tokens that read a whole chunk of keys are computed two at a time; each alone (a
    # decode) gets the same bits, whichever token it was paired with.
    for i in (128, 171, 199):
        alone = ext.decode_attention(q[i : i + 1].float() * 0.125, k, v,
                                     torch.tensor([0, i + 1]), slots[: i + 1])
        assert torch.equal(alone[0].to(dtype), whole[i])
    heads = kernels.extend_attention(qs, head_major(k), head_major(v), qo, kv, idx, 0.125)
    assert torch.equal(heads, got)


def quantized_layer(quantization: str, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[:, 5] *= 20  # an outlier column, as real layers have
    t = quantize(w, quantization)
    layer, why = make_linear(w, None, torch.bfloat16, "cpu", quantization, t)
    assert why is None and isinstance(layer, Int4Linear | Int8Linear)
    assert layer.native  # our kernel, not torch's
    return layer, dequantize(t, quantization)  # int4's fp16 scale and min: the kernel's own


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 32])
def test_quantized_kernel_matches_the_dequantized_weight(quantization, rows):
    layer, w = quantized_layer(quantization, 192, 576)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = layer(x).float()
    want = x.float() @ w.T
    # Activations are rounded to int8 per group of 32: error <= sum |w| * half a step.
    step = x.float().view(rows, -1, 32).abs().amax(-1, keepdim=True) / 127
    bound = (step / 2).expand(rows, 18, 32).reshape(rows, 576) @ w.abs().T
    assert ((got - want).abs() <= bound + 2e-2 * want.abs().max()).all()
    assert (got - want).abs().mean() < 0.02 * want.abs().mean()


@pytest.mark.parametrize("quantization,n,dtype", [
    ("int8", 96, torch.bfloat16), ("int8", 104, torch.bfloat16), ("int4", 96, torch.bfloat16),
    ("int4", 96, torch.float32)])
def test_quantized_kernel_gives_a_row_the_same_bits_in_any_batch(quantization, n, dtype):
    """n = 104: 13 panels of 8 weight rows, an odd count for two threads. One row of int4
    takes its own path (int4_row: x prepared by each thread), more rows the blocks."""
    layer, _ = quantized_layer(quantization, n, 1536, seed=1)
    x = torch.randn(7, 1536, generator=torch.Generator().manual_seed(2)).to(dtype)
    batch = layer(x)
    for i in range(7):
        assert torch.equal(layer(x[i : i + 1])[0], batch[i])
        assert torch.equal(layer(x[i:])[0], batch[i])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", [0, 1], ids=["silu", "gelu_tanh"])
def test_gate_up_and_its_activation_in_one_pass(dtype, activation):
    """The fused step's int4 gate_up computes act(gate) * up as it goes (cpu_gated_int4.h):
    the matmul's own outputs, rounded as the torch path rounds them, and a row's bits the
    same in any batch."""
    layer, _ = quantized_layer("int4", 2 * 104, 576, seed=3)  # 13 panels a half
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = ext.int4_gated(x, *layer.small[:3], activation)
    gate, up = layer(x).float().chunk(2, dim=-1)
    act = torch.nn.functional.silu if activation == 0 else (
        lambda g: torch.nn.functional.gelu(g, approximate="tanh"))
    want = (act(gate).to(dtype).float() * up).to(dtype)
    # Our exp and torch's differ in the last bits of fp32 (so a bf16 rounding may flip).
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-2 if bf16 else 1e-5)
    assert not bf16 or (got == want).float().mean() > 0.97
    for i in range(6):
        assert torch.equal(ext.int4_gated(x[i : i + 1], *layer.small[:3], activation)[0], got[i])


def test_int8_layer_whose_outputs_fill_no_whole_panel_takes_torchs_kernel():
    w = torch.randn(90, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    t = quantize(w, "int8")
    layer, why = make_linear(w, None, torch.bfloat16, "cpu", "int8", t)
    assert why is None and isinstance(layer, Int8Linear)
    assert not layer.native and layer.panels is None and layer.qweight.shape == (90, 64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = x.float() @ dequantize(t, "int8").T
    assert (layer(x).float() - want).abs().max() <= 2e-2 * want.abs().max()


def test_int4_layer_of_an_odd_number_of_groups_takes_our_kernel():
    """Our kernel reads a panel's 8 weight rows one group of 32 inputs at a time: K = 96
    (three groups) is ours, with bf16 and with fp32 activations."""
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    t = quantize(w, "int4")
    layer, why = make_linear(w, None, torch.bfloat16, "cpu", "int4", t)
    assert why is None and isinstance(layer, Int4Linear) and layer.native
    for dtype, tol in [(torch.bfloat16, 3e-2), (torch.float32, 1e-5)]:
        x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
        want = x.float() @ dequantize(t, "int4").T
        assert (layer(x).float() - want).abs().max() <= tol * want.abs().max(), dtype
        for i in range(3):  # a row alone (int4_row's path) as in the batch
            assert torch.equal(layer(x[i : i + 1])[0], layer(x)[i]), dtype


def test_int4_layer_takes_torchs_kernel_where_ours_is_off(monkeypatch):
    """Without our kernel (SGL_NB_CPU_DECODE=0, or no compiler) an int4 layer takes torch's,
    which needs outputs in blocks of 16."""
    monkeypatch.setenv("SGL_NB_CPU_DECODE", "0")
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    t = quantize(w, "int4")
    layer, why = make_linear(w, None, torch.bfloat16, "cpu", "int4", t)
    assert why is None and isinstance(layer, Int4Linear) and not layer.native
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = x.float() @ dequantize(t, "int4").T
    assert (layer(x).float() - want).abs().max() <= 3e-2 * want.abs().max()


def dense_layer(dtype: torch.dtype, n: int, k: int) -> tuple[DenseLinear, torch.Tensor]:
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05).to(dtype)
    layer = DenseLinear(w)
    assert layer.native and layer.weight is None  # our kernel, weight in panels
    return layer, w


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 40])
def test_dense_kernel_matches_torch(dtype, tol, rows):
    """7 panels of 16 outputs (one row takes them 4 at a time: a narrower last block), an
    input size that is no multiple of 8, rows of x across block edges; bf16 rounds only its
    output (fp32 accumulation)."""
    layer, w = dense_layer(dtype, 112, 577)
    x = torch.randn(rows, 577, generator=torch.Generator().manual_seed(rows)).to(dtype)
    want = x.float() @ w.float().T
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 112)
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_kernel_gives_a_row_the_same_bits_in_any_batch(dtype):
    layer, _ = dense_layer(dtype, 112, 1536)
    x = torch.randn(15, 1536, generator=torch.Generator().manual_seed(3)).to(dtype)
    batch = layer(x)
    for i in range(15):
        assert torch.equal(layer(x[i : i + 1])[0], batch[i])
        assert torch.equal(layer(x[i:])[0], batch[i])


def test_dense_layer_whose_outputs_fill_no_whole_panel_takes_atens_matmul():
    w = torch.randn(101, 64, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(101, generator=torch.Generator().manual_seed(1))
    layer = DenseLinear(w, bias)
    assert not layer.native and layer.panels is None
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(layer(x), x @ w.T + bias, atol=1e-5)


def decode_logits(model: Model, fused: bool, steps: int = 6,
                  pool: KVPool | None = None) -> list[torch.Tensor]:
    """Logits of a few decode steps of two requests over a prefilled prompt, fed the same
    tokens on both paths (into `pool`, else a new one of the model's)."""
    model.use_fused_decode(fused)
    pool = pool or model.new_kv_pool(512)
    prompts = [list(range(100, 140)), list(range(300, 317))]
    slots = [torch.arange(1, 41), torch.arange(200, 217)]
    extend = build_batch(False, prompts, [0, 0], slots, slots, model.device)
    logits = [model.forward(extend, pool)]
    for step in range(steps):
        nxt = [1000 + 7 * step, 2000 + 5 * step]
        slots = [torch.cat([s, torch.tensor([400 + 2 * step + b])]) for b, s in enumerate(slots)]
        starts = [s.numel() - 1 for s in slots]
        batch = build_batch(True, [[t] for t in nxt], starts, slots, [s[-1:] for s in slots],
                            model.device)
        logits.append(model.forward(batch, pool))
    assert model.fused_decode_ready() == fused
    return logits


@pytest.mark.slow
def test_decode_step_matches_the_torch_path_in_fp32(model_path):
    """The same linear layers on both paths; the rest (norms, RoPE, attention, SiLU)
    differs only in fp32 rounding."""
    model = Model.load(model_path)
    want, got = decode_logits(model, fused=False), decode_logits(model, fused=True)
    for w, g in zip(want, got):
        assert (w - g).abs().max() < 1e-4 * w.abs().max()
        assert torch.equal(w.argmax(-1), g.argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [{}, {"dtype": "bfloat16"}, {"quantization": "int8"},
                                  {"quantization": "int4"}], ids=["fp32", "bf16", "int8", "int4"])
def test_a_prompt_writes_the_kv_its_tokens_decoded_one_by_one_write(model_path, mode):
    """Extends run the fused step's layers too (Model.forward): a prompt in one extend, in
    two chunks, or fed token by token through decode steps leaves the same bits in every
    layer's K and V, so which way a token came in never changes what follows it."""
    model = Model.load(model_path, **mode)
    assert model.fused_decode_ready()
    prompt, n = list(range(100, 140)), 40
    slots = torch.arange(1, n + 1)

    def extend(pool, begin: int, end: int):
        return model.forward(build_batch(False, [prompt[begin:end]], [begin], [slots[:end]],
                                         [slots[begin:end]], model.device), pool)

    whole, chunked, decoded = (model.new_kv_pool(64) for _ in range(3))
    extend(whole, 0, n)
    extend(chunked, 0, 17)
    extend(chunked, 17, n)
    extend(decoded, 0, 1)
    for i in range(1, n):
        model.forward(build_batch(True, [[prompt[i]]], [i], [slots[: i + 1]], [slots[i : i + 1]],
                                  model.device), decoded)
    for pool in (chunked, decoded):
        for layer in range(model.config.num_layers):
            assert torch.equal(pool.k_buffers[layer][slots], whole.k_buffers[layer][slots])
            assert torch.equal(pool.v_buffers[layer][slots], whole.v_buffers[layer][slots])


@pytest.mark.slow
def test_the_step_gives_the_same_bits_over_either_pool_layout(model_path):
    """The fused step reads the pool through its strides: a head-major pool (what
    Model.new_kv_pool gives it) and a slot-major one hold the same K and V and give the same
    logits, prompt and decode steps alike."""
    model = Model.load(model_path, quantization="int4")
    c = model.config
    pools = [KVPool(c.num_layers, 512, c.num_kv_heads, c.head_dim, model.dtype,
                    head_major=major) for major in (True, False)]
    assert pools[0].k_buffers[0].stride(0) == c.head_dim
    assert model.new_kv_pool(8).k_buffers[0].stride(0) == c.head_dim
    runs = [decode_logits(model, fused=True, pool=pool) for pool in pools]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    for layer in range(c.num_layers):
        assert torch.equal(pools[0].k_buffers[layer], pools[1].k_buffers[layer])
        assert torch.equal(pools[0].v_buffers[layer], pools[1].v_buffers[layer])


@pytest.mark.slow
def test_decode_step_rejects_a_token_outside_the_vocabulary_and_serves_on(model_path):
    """The step checks its token ids before touching the KV pool; the next step of the
    same request gives the bits it gave before (its reused buffers are intact)."""
    model = Model.load(model_path)
    pool = model.new_kv_pool(64)
    slots = torch.arange(1, 9)
    prompt = list(range(100, 107))
    model.forward(build_batch(False, [prompt], [0], [slots[:7]], [slots[:7]], model.device), pool)

    def step(token: int):
        return build_batch(True, [[token]], [7], [slots], [slots[-1:]], model.device)

    before = model.forward(step(500), pool)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        model.forward(step(model.config.vocab_size), pool)
    assert model.fused_decode_ready()
    assert torch.equal(model.forward(step(500), pool), before)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [{"dtype": "bfloat16"}, {"quantization": "int8"},
                                  {"quantization": "int4"}])
def test_decode_step_is_as_accurate_as_the_torch_path(model_path, mode):
    """In 16-bit modes the two paths round differently after every layer, and over 30
    layers those differences grow to the size of the mode's own error (about 1 logit in
    int8, measured): so each is measured against fp32, and the fused path must be about as
    close to it as the torch path is, step by step."""
    ref = decode_logits(Model.load(model_path), fused=False)
    model = Model.load(model_path, **mode)
    want, got = decode_logits(model, fused=False), decode_logits(model, fused=True)
    for r, w, g in zip(ref, want, got):
        err_torch, err_fused = (w - r).abs().max(), (g - r).abs().max()
        print(f"{mode}: max logit error vs fp32, torch path {err_torch:.2f}, "
              f"fused {err_fused:.2f}")
        assert err_fused <= 1.5 * err_torch + 0.01 * r.abs().max()
        # The fused path's greedy token is fp32's, or near-tied with it there.
        top, picked = r.max(-1).values, r.gather(1, g.argmax(-1, keepdim=True))[:, 0]
        assert (top - picked <= 2 * err_torch).all()


def test_logits_head_refinement_in_the_module_matches_torchs():
    """LogitsHead's best-candidate recomputation (kernels/cpu_logits.h) against its torch ops,
    on rows whose head matmul (bf16) only approximates the fp32 logits: above the 16th best
    head logit every entry is recomputed, below it none (at a tie either may be)."""
    gen = torch.Generator().manual_seed(0)
    w16 = (torch.randn(1000, 64, generator=gen) * 0.2).bfloat16()
    h = torch.randn(5, 64, generator=gen).bfloat16()
    head = LogitsHead(DenseLinear(w16), w16, refine=16)
    assert head.native
    torch_ops = LogitsHead(DenseLinear(w16), w16, refine=16, native=False)
    base = head.linear(h).float()
    exact = h.float() @ w16.float().T
    sixteenth = base.topk(16, dim=-1).values[:, -1:]
    above, below = base > sixteenth, base < sixteenth
    for got in (head(h), torch_ops(h)):
        assert torch.allclose(got[above], exact[above], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[below], base[below])
    assert (above.sum(-1) >= 12).all()  # the test has teeth: most of the 16 are strictly above


def test_the_refinements_pick_is_numpys_argmax_of_the_refined_row():
    """The pick a decode ahead takes from the refinement (the best of the refined entries
    and of the rest, cpu_logits.h) is numpy's argmax of the row it leaves: where the
    refinement lowers every candidate below the 17th, at ties, and with a NaN."""
    gen = torch.Generator().manual_seed(1)
    w16 = (torch.randn(1000, 64, generator=gen) * 0.2).bfloat16()
    h = torch.randn(5, 64, generator=gen)
    logits = h @ w16.float().T
    logits[0, :16] = 100.0  # candidates the refinement brings back down: the 17th wins
    logits[1, 900:] = logits[1].max() + 1  # a tie at the top, past the candidates
    logits[2, 500] = float("nan")  # numpy's argmax: the first NaN ...
    h[2, 7] = float("nan")  # ... of the refined candidates, all NaN then
    logits[3] = logits[3].round()  # ties everywhere
    rows = logits.clone()
    picks = ext.refine_top_logits(rows, h, w16, 16)
    assert picks == rows.numpy().argmax(-1).tolist()
    assert picks[0] >= 16 and rows[2].isnan().sum() == 16
    assert not torch.equal(rows[0, :16], logits[0, :16])  # the refinement ran


def test_greedy_picks_taken_from_the_alternatives_are_numpys_argmax():
    """sample() takes a greedy row's pick from its alternatives' best (TopK.greedy) when
    they were ranked by the kernels' rule and nothing masked the rows since: numpy's
    argmax, ties and NaN included."""
    rows = _rows_with_ties_and_infinities()
    rows[0, 333] = float("nan")
    top = top_alternatives(rows, 5)
    params = [SamplingParams(temperature=0.0)] * rows.shape[0]
    got = [s.token for s in sample(rows, params, [None] * rows.shape[0], top=top)]
    assert top.greedy() == got == greedy_picks(rows).tolist()
    top.mark_masked(rows)
    assert top.greedy() is None  # a mask may have removed the best


def _rows_with_ties_and_infinities() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 49157, generator=gen) * 4  # not a multiple of 8: the tail too
    rows[1, ::7] = rows[1].max()  # ties at the top: the lower ids first
    rows[2, 100:] = float("-inf")  # a penalized row: 100 finite logits left
    rows[3] = float("-inf")  # nothing left: logsumexp -inf
    rows[4] = rows[4].round()  # many ties everywhere
    rows[5, 49150:] += 30  # the best in the tail
    return rows


@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_logits_matches_torch(k):
    """top_logits (kernels/cpu_logits.h), the token picker's alternatives: the ids, values and
    logsumexp of torch.topk and torch.logsumexp; at ties the lower id comes first."""
    rows = _rows_with_ties_and_infinities()
    ids, values, lse = ext.top_logits(rows, k)
    for b, row in enumerate(rows):
        order = sorted(range(row.numel()), key=lambda i: (-row[i].item(), i))[:k]
        assert ids[b] == order
        assert values[b] == row[order].tolist()
        want = torch.logsumexp(row.double(), 0).item()
        assert lse[b] == want or abs(lse[b] - want) < 1e-5 * max(1, abs(want))


def test_top_logits_ranks_a_nan_first_and_takes_short_rows():
    row = torch.tensor([[1.0, float("nan"), 3.0]])
    ids, values, lse = ext.top_logits(row, 5)
    assert ids == [[1, 2, 0]] and math.isnan(values[0][0]) and math.isnan(lse[0])
    with pytest.raises(RuntimeError, match="k >= 1"):
        ext.top_logits(row, 0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ext.top_logits(row.double(), 1)


def test_the_pickers_alternatives_are_the_same_from_the_module_and_torch(monkeypatch):
    rows = _rows_with_ties_and_infinities()[[0, 2, 5]]
    native = top_alternatives(rows, 5)
    monkeypatch.setattr(cpu_decode, "loaded", lambda: None)
    torch_ops = top_alternatives(rows, 5)
    assert native.ids == torch_ops.ids and native.logits == torch_ops.logits
    assert native.lse == pytest.approx(torch_ops.lse, rel=1e-6)


@pytest.mark.parametrize("quantization,n", [("int8", 8), ("int8", 104), ("int4", 4096)])
def test_quantized_kernel_gives_the_same_bits_on_one_thread_and_on_two(quantization, n):
    """The worker pool hands out chunks of each thread's part and lets a thread take what
    is left of the other's (kernels/cpu_worker_pool.h): every output is computed once,
    by whichever thread, to the bits one thread alone gives."""
    layer, _ = quantized_layer(quantization, n, 576, seed=3)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    try:
        ext.set_num_threads(1)
        alone = [layer(x[:1]), layer(x)]
        ext.set_num_threads(2)
        for _ in range(20):  # jobs back to back, the worker awake or not
            assert torch.equal(layer(x[:1]), alone[0]) and torch.equal(layer(x), alone[1])
    finally:
        ext.set_num_threads(0)


def test_a_forked_child_runs_the_kernels_on_workers_of_its_own(tmp_path):
    """A child forked after the parent's jobs has none of the parent's worker threads: its
    first job starts its own (kernels/cpu_worker_pool.h, told by a fork handler), gives the
    parent's bits, and the child exits with its own exit code."""
    layer, _ = quantized_layer("int4", 4096, 576, seed=5)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(6)).bfloat16()
    try:
        ext.set_num_threads(2)
        want = layer(x)  # the parent's workers exist from here on
        out = tmp_path / "child.pt"
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                torch.save([layer(x) for _ in range(5)], out)
                ext.stop_workers()
                code = 7
            finally:
                os._exit(code)
        status = _exit_status(pid, deadline=time.monotonic() + 300)
    finally:
        ext.set_num_threads(0)
    assert status == 7, "the child hung" if status is None else f"the child exited {status}"
    assert all(torch.equal(got, want) for got in torch.load(out))


def _exit_status(pid: int, deadline: float) -> int | None:
    """The child's exit code; None if it is still running at the deadline (a hang: it is
    killed then, so that the suite goes on)."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.slow
def test_decode_step_reports_where_its_time_went(model_path):
    """phase_seconds: every phase of a step by name, the matmuls' and attention's time
    counted, zeroed once read."""
    model = Model.load(model_path, quantization="int4")
    decode_logits(model, fused=True, steps=2)
    phases = model.decode_phase_seconds()
    assert {"qkv matmul", "attention", "o matmul", "gate_up matmul", "down matmul",
            "lm head matmul", "norms and residual adds"} <= phases.keys()
    assert all(phases[p] > 0 for p in ("qkv matmul", "attention", "down matmul",
                                       "lm head matmul"))
    assert set(model.decode_phase_seconds().values()) == {0.0}
