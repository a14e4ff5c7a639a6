"""Attention with a sliding window and a logit soft-cap (Mistral, Gemma 2/3, ...): every
implementation against a dense float64 computation written out here.

The Triton kernels run on the CPU through Triton's interpreter, which must be switched on
before any @triton.jit function is defined (see tests/test_kernels.py).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from support.paged_kv import indptr as _indptr  # noqa: E402
from support.paged_kv import paged_kv as _paged_kv  # noqa: E402
from support.tiny_checkpoint import FAMILIES, tiny_config  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import sgl_nb.kernels as kernels  # noqa: E402
from sgl_nb.kernels import reference  # noqa: E402
from sgl_nb.runtime.model.forward_batch import build_batch  # noqa: E402
from sgl_nb.runtime.model.model import Model, decode_family, fused_step  # noqa: E402
from sgl_nb.runtime.model.model_config import ModelConfig  # noqa: E402

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
WINDOW, SOFTCAP = 16, 2.0
VARIATIONS = [(None, None), (WINDOW, None), (None, SOFTCAP), (WINDOW, SOFTCAP)]
# (query heads, KV heads): GQA groups 1, 2, 4 and 8.
GROUPS = [(4, 4), (4, 2), (8, 2), (8, 1)]





def dense_attention(q, k_buf, v_buf, qo_lens, kv_lens, kv_indices, scale, window, softcap):
    """Per request in float64: scores, soft-cap, causal and window mask, softmax, weights."""
    group = q.shape[1] // k_buf.shape[1]
    outs, q_at, kv_at = [], 0, 0
    for q_len, kv_len in zip(qo_lens, kv_lens, strict=True):
        slots = kv_indices[kv_at : kv_at + kv_len]
        k = k_buf[slots].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_buf[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_at : q_at + q_len].double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos_q = torch.arange(q_len)[:, None] + (kv_len - q_len)
        pos_k = torch.arange(kv_len)[None, :]
        hidden = pos_k > pos_q
        if window is not None:
            hidden |= pos_k <= pos_q - window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        q_at, kv_at = q_at + q_len, kv_at + kv_len
    return torch.cat(outs).float()


def _decode_case(num_q_heads, num_kv_heads, head_dim, gen, kv_lens=(1, 9, 16, 17, 40)):
    kv_lens = list(kv_lens)
    k_buf, v_buf, kv_indptr, kv_indices = _paged_kv(kv_lens, num_kv_heads, head_dim,
                                                    torch.float32, gen)
    # Large enough scores (std ~3) that the soft-cap of 2 changes the result a lot.
    q = 3 * torch.randn(len(kv_lens), num_q_heads, head_dim, generator=gen)
    return q, k_buf, v_buf, kv_indptr, kv_indices, kv_lens


def _extend_case(num_q_heads, num_kv_heads, head_dim, gen):
    # New tokens of 1, 5 and 37 over prefixes of 0, 30 and 3: windows that start inside the
    # prefix, inside the new tokens, and not at all.
    qo_lens, prefix_lens = [1, 5, 37], [0, 30, 3]
    kv_lens = [p + n for p, n in zip(prefix_lens, qo_lens, strict=True)]
    k_buf, v_buf, kv_indptr, kv_indices = _paged_kv(kv_lens, num_kv_heads, head_dim,
                                                    torch.float32, gen)
    q = 3 * torch.randn(sum(qo_lens), num_q_heads, head_dim, generator=gen)
    return q, k_buf, v_buf, _indptr(qo_lens), kv_indptr, kv_indices, qo_lens, kv_lens


# --- the torch reference -----------------------------------------------------------------


@pytest.mark.parametrize("num_q_heads,num_kv_heads", GROUPS)
@pytest.mark.parametrize("window,softcap", VARIATIONS)
def test_reference_decode_matches_dense(num_q_heads, num_kv_heads, window, softcap):
    gen = torch.Generator().manual_seed(num_q_heads * 10 + num_kv_heads)
    q, k_buf, v_buf, kv_indptr, kv_indices, kv_lens = _decode_case(num_q_heads, num_kv_heads,
                                                                   64, gen)
    want = dense_attention(q, k_buf, v_buf, [1] * len(kv_lens), kv_lens, kv_indices, 0.125,
                           window, softcap)
    got = reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125,
                                     window=window, softcap=softcap)
    torch.testing.assert_close(got, want, **FP32_TOL)
    # A plan made for the window, and the caller's max_kv_len, give the same bits.
    plan = reference.plan_decode(kv_indptr, kv_indices, num_kv_heads, num_q_heads,
                                 max(kv_lens), window)
    again = reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125,
                                       max(kv_lens), plan, window=window, softcap=softcap)
    torch.testing.assert_close(again, got, atol=0, rtol=0)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", GROUPS)
@pytest.mark.parametrize("window,softcap", VARIATIONS)
def test_reference_extend_matches_dense(num_q_heads, num_kv_heads, window, softcap):
    gen = torch.Generator().manual_seed(num_q_heads * 10 + num_kv_heads)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, qo_lens, kv_lens = _extend_case(
        num_q_heads, num_kv_heads, 64, gen)
    want = dense_attention(q, k_buf, v_buf, qo_lens, kv_lens, kv_indices, 0.125, window,
                           softcap)
    got = reference.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 0.125,
                                     window=window, softcap=softcap)
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_the_variations_change_the_result():
    """The cases above are ones where a kernel ignoring the window or the soft-cap fails."""
    gen = torch.Generator().manual_seed(1)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, qo_lens, kv_lens = _extend_case(
        8, 2, 64, gen)
    outs = [dense_attention(q, k_buf, v_buf, qo_lens, kv_lens, kv_indices, 0.125, w, c)
            for w, c in VARIATIONS]
    for i in range(len(outs)):
        for j in range(i):
            assert (outs[i] - outs[j]).abs().max() > 0.1


def test_reference_decode_shared_prefix_with_window_and_softcap():
    """Requests sharing a radix prefix longer than the window still share the windowed
    slots when they are equally long (the prefix-once path), and the result is right."""
    gen = torch.Generator().manual_seed(3)
    shared, window = reference.SHARED_PREFIX_MIN + 40, reference.SHARED_PREFIX_MIN + 8
    k_buf, v_buf, _, slots = _paged_kv([shared + 4], 2, 64, torch.float32, gen)
    prefix, own = slots[:shared], slots[shared:]
    kv_indices = torch.cat([torch.cat([prefix, own[i : i + 1]]) for i in range(4)])
    kv_lens = [shared + 1] * 4
    kv_indptr = _indptr(kv_lens)
    plan = reference.plan_decode(kv_indptr, kv_indices, 2, 8, window=window)
    assert plan.prefix_len == window - 1
    q = 3 * torch.randn(4, 8, 64, generator=gen)
    got = reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125, plan=plan,
                                     window=window, softcap=SOFTCAP)
    want = dense_attention(q, k_buf, v_buf, [1] * 4, kv_lens, kv_indices, 0.125, window,
                           SOFTCAP)
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_a_plan_of_another_window_is_refused():
    gen = torch.Generator().manual_seed(4)
    q, k_buf, v_buf, kv_indptr, kv_indices, _ = _decode_case(4, 2, 64, gen)
    plan = reference.plan_decode(kv_indptr, kv_indices, 2, 4)
    with pytest.raises(ValueError, match="window"):
        reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125, plan=plan,
                                   window=WINDOW)


@pytest.mark.parametrize("bad", [{"window": 0}, {"window": 2.5}, {"window": True},
                                 {"softcap": 0.0}, {"softcap": -1.0},
                                 {"softcap": float("nan")}])
def test_bad_variations_are_errors(bad):
    gen = torch.Generator().manual_seed(5)
    q, k_buf, v_buf, kv_indptr, kv_indices, _ = _decode_case(4, 2, 64, gen)
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        kernels.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125, **bad)
    with pytest.raises(ValueError, match=name):
        kernels.extend_attention(q, k_buf, v_buf, _indptr([1] * 5), kv_indptr, kv_indices,
                                 0.125, **bad)


# --- the package's dispatch (whichever implementation it picks) --------------------------


@pytest.mark.parametrize("attention", ["auto", "torch", "triton"])
@pytest.mark.parametrize("window,softcap", VARIATIONS)
def test_package_functions_honour_the_variations(monkeypatch, attention, window, softcap):
    """No path (C++ on the CPU where it is built, torch, Triton) ignores an argument."""
    monkeypatch.setenv("SGL_NB_ATTENTION", attention)
    gen = torch.Generator().manual_seed(6)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, qo_lens, kv_lens = _extend_case(
        8, 2, 64, gen)
    want = dense_attention(q, k_buf, v_buf, qo_lens, kv_lens, kv_indices, 0.125, window,
                           softcap)
    got = kernels.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 0.125,
                                   window=window, softcap=softcap)
    torch.testing.assert_close(got, want, **FP32_TOL)

    q, k_buf, v_buf, kv_indptr, kv_indices, kv_lens = _decode_case(8, 2, 64, gen)
    want = dense_attention(q, k_buf, v_buf, [1] * len(kv_lens), kv_lens, kv_indices, 0.125,
                           window, softcap)
    plan = kernels.plan_decode(kv_indptr, kv_indices, 2, 8, max(kv_lens), window)
    got = kernels.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125, max(kv_lens),
                                   plan, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, **FP32_TOL)



# --- Triton (interpreted) ----------------------------------------------------------------

TRITON_SHAPES = [(d, hq, hkv) for d in (64, 128, 256) for hq, hkv in GROUPS]


@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", TRITON_SHAPES)
@pytest.mark.parametrize("window,softcap", VARIATIONS)
def test_triton_decode_matches_reference(head_dim, num_q_heads, num_kv_heads, window, softcap):
    from sgl_nb.kernels import decode_attention_triton as decode_tt

    gen = torch.Generator().manual_seed(head_dim + num_q_heads * 10 + num_kv_heads)
    q, k_buf, v_buf, kv_indptr, kv_indices, kv_lens = _decode_case(num_q_heads, num_kv_heads,
                                                                   head_dim, gen)
    scale = 8 / head_dim  # scores of about the same size at any head_dim
    want = reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, scale,
                                      window=window, softcap=softcap)
    # Three splits: the windowed range is cut in chunks too, some of them empty.
    got = decode_tt.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, scale,
                                     max(kv_lens), num_kv_splits=3, window=window,
                                     softcap=softcap)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", TRITON_SHAPES)
@pytest.mark.parametrize("window,softcap", VARIATIONS)
def test_triton_extend_matches_reference(head_dim, num_q_heads, num_kv_heads, window, softcap):
    from sgl_nb.kernels import extend_attention_triton as extend_tt

    gen = torch.Generator().manual_seed(head_dim + num_q_heads * 10 + num_kv_heads)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, _, _ = _extend_case(
        num_q_heads, num_kv_heads, head_dim, gen)
    scale = 8 / head_dim
    want = reference.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale,
                                      window=window, softcap=softcap)
    got = extend_tt.extend_attention(q, k_buf, v_buf, qo_indptr.int(), kv_indptr.int(),
                                     kv_indices.int(), scale, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_triton_fp16_with_window_and_softcap():
    # fp16, not bf16: the interpreter's bf16 tl.dot is wrong (see tests/test_kernels.py).
    from sgl_nb.kernels import decode_attention_triton as decode_tt
    from sgl_nb.kernels import extend_attention_triton as extend_tt

    gen = torch.Generator().manual_seed(16)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, qo_lens, kv_lens = _extend_case(
        8, 2, 64, gen)
    q, k_buf, v_buf = q.half(), k_buf.half(), v_buf.half()
    want = dense_attention(q, k_buf, v_buf, qo_lens, kv_lens, kv_indices, 0.125, WINDOW,
                           SOFTCAP)
    got = extend_tt.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 0.125,
                                     window=WINDOW, softcap=SOFTCAP)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    want = dense_attention(q[:3], k_buf, v_buf, [1] * 3, kv_lens, kv_indices, 0.125, WINDOW,
                           SOFTCAP)
    got = decode_tt.decode_attention(q[:3], k_buf, v_buf, kv_indptr, kv_indices, 0.125,
                                     window=WINDOW, softcap=SOFTCAP)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


# --- C++ CPU kernel (kernels/cpu_decode.cpp) ---------------------------------------------

CPU_SHAPES = [(64, 4, 4), (64, 8, 1), (128, 4, 2), (256, 8, 2)]


def _ext():
    from sgl_nb.kernels import cpu_decode

    ext = cpu_decode.load()
    if ext is None:
        pytest.skip("no C++ compiler: the torch path runs")
    return ext


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", CPU_SHAPES)
@pytest.mark.parametrize("window,softcap", [(None, SOFTCAP), (WINDOW, None), (200, SOFTCAP)])
def test_cpu_kernel_matches_reference(dtype, head_dim, num_q_heads, num_kv_heads, window,
                                      softcap):
    """Decode and extend, over contexts of several 128-key chunks (merged afterwards) and
    windows shorter and longer than a chunk."""
    ext = _ext()
    gen = torch.Generator().manual_seed(head_dim + num_q_heads)
    kv_lens = [1, 130, 16, 300]
    k_buf, v_buf, kv_indptr, kv_indices = _paged_kv(kv_lens, num_kv_heads, head_dim, dtype, gen)
    scale = 8 / head_dim
    tol = FP32_TOL if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    q = 3 * torch.randn(len(kv_lens), num_q_heads, head_dim, generator=gen)
    got = ext.decode_attention(q * scale, k_buf, v_buf, kv_indptr, kv_indices, window or 0,
                               softcap or 0.0)
    want = reference.decode_attention(q.to(dtype), k_buf, v_buf, kv_indptr, kv_indices, scale,
                                      window=window, softcap=softcap)
    torch.testing.assert_close(got.float(), want.float(), **tol)

    # Extend: the last 1, 100, 16 and 50 tokens of the same requests are new.
    qo_lens = [1, 100, 16, 50]
    qs = 3 * torch.randn(sum(qo_lens), num_q_heads, head_dim, generator=gen)
    got_ext = ext.extend_attention(qs * scale, k_buf, v_buf, _indptr(qo_lens), kv_indptr,
                                   kv_indices, window or 0, softcap or 0.0)
    want = reference.extend_attention(qs.to(dtype), k_buf, v_buf, _indptr(qo_lens), kv_indptr,
                                      kv_indices, scale, window=window, softcap=softcap)
    torch.testing.assert_close(got_ext.float(), want.float(), **tol)
    # A token's result has the same bits whether it is a prefill's last token or a decode.
    last = _indptr(qo_lens)[1:] - 1
    decoded = ext.decode_attention(qs[last] * scale, k_buf, v_buf, kv_indptr, kv_indices,
                                   window or 0, softcap or 0.0)
    assert torch.equal(decoded, got_ext[last])


def test_package_routes_variations_to_the_cpu_kernel(monkeypatch):
    """With the kernel built, calls with a window or soft-cap on the CPU take it (its bits)."""
    ext = _ext()
    monkeypatch.delenv("SGL_NB_ATTENTION", raising=False)
    gen = torch.Generator().manual_seed(8)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, _, _ = _extend_case(8, 2, 64, gen)
    got = kernels.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 0.125,
                                   window=WINDOW, softcap=SOFTCAP)
    want = ext.extend_attention(q * 0.125, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices,
                                WINDOW, SOFTCAP)
    assert torch.equal(got, want)
    q, k_buf, v_buf, kv_indptr, kv_indices, _ = _decode_case(8, 2, 64, gen)
    got = kernels.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125,
                                   window=WINDOW)
    assert torch.equal(got, ext.decode_attention(q * 0.125, k_buf, v_buf, kv_indptr,
                                                 kv_indices, WINDOW, 0.0))


# Each family's fused decode against its own layer loop; the tolerance covers the step's
# different sum orders and exp/tanh approximations (bf16: one rounding apart here and there).
FUSED_TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=1e-4),
                   torch.bfloat16: dict(atol=0.1, rtol=0.05)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_decode_step_matches_the_layer_loop(family, dtype):
    """Every family prefills and decodes through cpu_decode.cpp's fused step (its Family:
    windows, soft-caps, post-norms, q/k norms, partial or no RoPE, multipliers, gelu, routed
    experts) and gets the logits of the model's torch layer loop, over prompts longer than
    the window; a step built without the family's differences does not."""
    ext = _ext()
    hf = tiny_config(family)
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(hf).state_dict()
    config = ModelConfig.from_dict(hf.to_dict())
    model = Model(config, weights, dtype=dtype)
    step = fused_step(ext, model)
    # Routed experts in bf16: over a 40-token prompt some token's top-k is a near-tie that
    # one rounding apart flips (12% of a prefill row's logits then differ, seen), so there
    # both paths decode from the layer loop's prefill.
    prefill = not (dtype == torch.bfloat16 and config.num_experts)
    want = _decode_steps(model, fused=False, fused_prefill=prefill)
    got = _decode_steps(model, fused=step, fused_prefill=prefill)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, **FUSED_TOLERANCE[dtype])
    if family != "llama":  # Llama's step is the plain one
        plain = ext.Family()
        real = decode_family(ext, model)
        for name in ("routers", "expert_kinds", "expert_tensors", "top_k", "norm_topk_prob"):
            setattr(plain, name, getattr(real, name))  # a MoE layer has no dense MLP to run
        plain = fused_step(ext, model, plain)
        llama_shaped = _decode_steps(model, fused=plain, fused_prefill=prefill)
        assert max((p - w).abs().max().item() for p, w in zip(llama_shaped, want)) > 1e-2


def test_fused_decode_step_refuses_a_wrong_family():
    ext = _ext()
    config = ModelConfig.from_dict(tiny_config("mistral").to_dict())
    model = Model(config, AutoModelForCausalLM.from_config(tiny_config("mistral")).state_dict())
    family = ext.Family()
    family.windows = [8]
    with pytest.raises(RuntimeError, match="windows must have 1 per layer"):
        fused_step(ext, model, family)
    family = ext.Family()
    family.rotary_dim = 63
    with pytest.raises(RuntimeError, match="rotary_dim even"):
        fused_step(ext, model, family)
    moe_config = ModelConfig.from_dict(tiny_config("qwen3_moe").to_dict())
    moe = Model(moe_config, AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).state_dict())
    with pytest.raises(RuntimeError, match="layer 0 has neither a dense MLP nor experts"):
        fused_step(ext, moe, ext.Family())


def _decode_steps(model, fused, fused_prefill: bool = True) -> list[torch.Tensor]:
    """Logits of the prefill of two requests (prompts of 40 and 5 tokens), then of 4 decode
    steps; `fused`: the step running them (False: the layer loop), the prefill too unless
    fused_prefill is False (then it is the layer loop's, and left out)."""
    model.use_fused_decode(fused if fused_prefill else False)
    pool = model.new_kv_pool(128)
    slots = [torch.arange(1, 41), torch.arange(60, 65)]
    prompts = [list(range(300, 340)), list(range(400, 405))]
    out = [model.forward(build_batch(False, prompts, [0, 0], slots, slots, "cpu"), pool)]
    if not fused_prefill:
        out = []
        model.use_fused_decode(fused)
    for step in range(4):
        slots = [torch.cat([s, torch.tensor([70 + 2 * step + b])]) for b, s in enumerate(slots)]
        batch = build_batch(True, [[500 + step], [600 + step]], [s.numel() - 1 for s in slots],
                            slots, [s[-1:] for s in slots], "cpu")
        out.append(model.forward(batch, pool))
    return out
