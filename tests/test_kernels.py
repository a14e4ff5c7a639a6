"""Attention / KV-store kernels: Triton == torch reference == naive dense attention.

The Triton kernels run on the CPU through Triton's interpreter. TRITON_INTERPRET must be
set before any @triton.jit function is defined (triton checks it at decoration time), so
it comes first, before triton or any Triton module of the project is imported.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from support.paged_kv import indptr as _indptr  # noqa: E402
from support.paged_kv import paged_kv as _paged_kv  # noqa: E402
from support.waits import WAIT  # noqa: E402

import sgl_nb.kernels as kernels  # noqa: E402
from sgl_nb.kernels import decode_attention_triton as decode_tt  # noqa: E402
from sgl_nb.kernels import extend_attention_triton as extend_tt  # noqa: E402
from sgl_nb.kernels import reference  # noqa: E402
from sgl_nb.kernels import store_kv_triton as store_tt  # noqa: E402

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


# --- building paged batches --------------------------------------------------------------





def _naive(q, k_buf, v_buf, qo_lens, kv_lens, kv_indices, scale):
    """Dense per-request attention in float64: gather, matmul, causal mask, softmax."""
    num_q_heads, num_kv_heads = q.shape[1], k_buf.shape[1]
    group = num_q_heads // num_kv_heads
    outs, q_at, kv_at = [], 0, 0
    for q_len, kv_len in zip(qo_lens, kv_lens, strict=True):
        slots = kv_indices[kv_at : kv_at + kv_len]
        k = k_buf[slots].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_buf[slots].double().repeat_interleave(group, dim=1)
        qb = q[q_at : q_at + q_len].double()  # [Lq, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(q_len)[:, None] + (kv_len - q_len)
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        q_at, kv_at = q_at + q_len, kv_at + kv_len
    return torch.cat(outs)


def _ragged(batch: int, lo: int, hi: int, gen) -> list[int]:
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    lens[0] = lo  # always include the shortest length (1 where lo == 1)
    return lens


# --- decode ------------------------------------------------------------------------------

HEADS = [(9, 3), (4, 4)]  # SmolLM2 (GQA 3) and plain multi-head


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_decode_reference_matches_naive(batch, num_q_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(batch * 10 + num_kv_heads)
    kv_lens = _ragged(batch, 1, 90, gen)
    k_buf, v_buf, kv_indptr, kv_indices = _paged_kv(kv_lens, num_kv_heads, 64, torch.float32, gen)
    q = torch.randn(batch, num_q_heads, 64, generator=gen)
    expected = _naive(q, k_buf, v_buf, [1] * batch, kv_lens, kv_indices, 0.125)
    out = reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125)
    torch.testing.assert_close(out, expected.float(), **FP32_TOL)
    # The caller's max_kv_len and int32 index tensors give the same result.
    out32 = reference.decode_attention(
        q, k_buf, v_buf, kv_indptr.int(), kv_indices.int(), 0.125, max(kv_lens)
    )
    torch.testing.assert_close(out32, out, atol=0, rtol=0)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("num_kv_splits", [None, 3])
def test_decode_triton_matches_reference(batch, num_q_heads, num_kv_heads, num_kv_splits):
    gen = torch.Generator().manual_seed(batch * 100 + num_kv_heads)
    kv_lens = _ragged(batch, 1, 90, gen)
    k_buf, v_buf, kv_indptr, kv_indices = _paged_kv(kv_lens, num_kv_heads, 64, torch.float32, gen)
    q = torch.randn(batch, num_q_heads, 64, generator=gen)
    expected = reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125)
    out = decode_tt.decode_attention(
        q, k_buf, v_buf, kv_indptr, kv_indices, 0.125, max(kv_lens), num_kv_splits=num_kv_splits
    )
    torch.testing.assert_close(out, expected, **FP32_TOL)


@pytest.mark.parametrize("head_dim", [80, 128])
def test_decode_triton_other_head_dims(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    kv_lens = [1, 70, 33]
    k_buf, v_buf, kv_indptr, kv_indices = _paged_kv(kv_lens, 2, head_dim, torch.float32, gen)
    q = torch.randn(3, 6, head_dim, generator=gen)
    scale = head_dim**-0.5
    expected = _naive(q, k_buf, v_buf, [1] * 3, kv_lens, kv_indices, scale).float()
    ref = reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, scale)
    out = decode_tt.decode_attention(q, k_buf, v_buf, kv_indptr.int(), kv_indices.int(), scale, 70)
    torch.testing.assert_close(ref, expected, **FP32_TOL)
    torch.testing.assert_close(out, expected, **FP32_TOL)


def test_decode_more_splits_than_tokens():
    # Chunks past a short request's end are empty and must carry no weight in the merge.
    gen = torch.Generator().manual_seed(7)
    kv_lens = [1, 2, 5]
    k_buf, v_buf, kv_indptr, kv_indices = _paged_kv(kv_lens, 3, 64, torch.float32, gen)
    q = torch.randn(3, 9, 64, generator=gen)
    expected = reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125)
    out = decode_tt.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125, num_kv_splits=8)
    torch.testing.assert_close(out, expected, **FP32_TOL)


# --- extend ------------------------------------------------------------------------------


def _extend_case(batch, num_q_heads, num_kv_heads, with_prefix, dtype, gen, head_dim=64):
    # Request 0 has one new token; a batch of 3+ has one request long enough for two tiles.
    qo_lens = _ragged(batch, 1, 40, gen)
    if batch >= 3:
        qo_lens[2] = 70
    if with_prefix:
        prefix_lens = _ragged(batch, 1, 50, gen)
    else:
        prefix_lens = [0] * batch
    kv_lens = [p + n for p, n in zip(prefix_lens, qo_lens, strict=True)]
    k_buf, v_buf, kv_indptr, kv_indices = _paged_kv(kv_lens, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(sum(qo_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    return q, k_buf, v_buf, _indptr(qo_lens), kv_indptr, kv_indices, qo_lens, kv_lens


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("with_prefix", [False, True])
def test_extend_reference_matches_naive(batch, num_q_heads, num_kv_heads, with_prefix):
    gen = torch.Generator().manual_seed(batch * 10 + num_kv_heads + with_prefix)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, qo_lens, kv_lens = _extend_case(
        batch, num_q_heads, num_kv_heads, with_prefix, torch.float32, gen
    )
    expected = _naive(q, k_buf, v_buf, qo_lens, kv_lens, kv_indices, 0.125).float()
    out = reference.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 0.125)
    torch.testing.assert_close(out, expected, **FP32_TOL)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("with_prefix", [False, True])
def test_extend_triton_matches_reference(batch, num_q_heads, num_kv_heads, with_prefix):
    gen = torch.Generator().manual_seed(batch * 100 + num_kv_heads + with_prefix)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, _, _ = _extend_case(
        batch, num_q_heads, num_kv_heads, with_prefix, torch.float32, gen
    )
    expected = reference.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 0.125)
    out = extend_tt.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 0.125)
    torch.testing.assert_close(out, expected, **FP32_TOL)


def test_extend_triton_head_dim_80_and_int32_indices():
    gen = torch.Generator().manual_seed(80)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, qo_lens, kv_lens = _extend_case(
        3, 6, 2, True, torch.float32, gen, head_dim=80
    )
    scale = 80**-0.5
    expected = _naive(q, k_buf, v_buf, qo_lens, kv_lens, kv_indices, scale).float()
    out = extend_tt.extend_attention(
        q, k_buf, v_buf, qo_indptr.int(), kv_indptr.int(), kv_indices.int(), scale
    )
    torch.testing.assert_close(out, expected, **FP32_TOL)


def test_extend_of_one_token_is_decode():
    gen = torch.Generator().manual_seed(11)
    kv_lens = [1, 17, 40]
    k_buf, v_buf, kv_indptr, kv_indices = _paged_kv(kv_lens, 3, 64, torch.float32, gen)
    q = torch.randn(3, 9, 64, generator=gen)
    decode = reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125)
    extend = reference.extend_attention(
        q, k_buf, v_buf, _indptr([1, 1, 1]), kv_indptr, kv_indices, 0.125
    )
    torch.testing.assert_close(extend, decode, **FP32_TOL)


# --- low precision -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision(dtype):
    gen = torch.Generator().manual_seed(16)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, qo_lens, kv_lens = _extend_case(
        3, 9, 3, True, dtype, gen
    )
    expected = _naive(q, k_buf, v_buf, qo_lens, kv_lens, kv_indices, 0.125)
    out = reference.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **BF16_TOL)

    q_dec = q[:3]
    expected = _naive(q_dec, k_buf, v_buf, [1] * 3, kv_lens, kv_indices, 0.125)
    for max_kv_len in (None, max(kv_lens)):
        out = reference.decode_attention(
            q_dec, k_buf, v_buf, kv_indptr, kv_indices, 0.125, max_kv_len
        )
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, **BF16_TOL)


def test_triton_fp16():
    # fp16, not bf16: the interpreter multiplies bf16 bit patterns in tl.dot
    # (triton-lang/triton#11584), so bf16 kernels can only be checked on a GPU.
    gen = torch.Generator().manual_seed(17)
    q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, qo_lens, kv_lens = _extend_case(
        3, 9, 3, True, torch.float16, gen
    )
    expected = _naive(q, k_buf, v_buf, qo_lens, kv_lens, kv_indices, 0.125)
    out = extend_tt.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 0.125)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), expected, **BF16_TOL)

    expected = _naive(q[:3], k_buf, v_buf, [1] * 3, kv_lens, kv_indices, 0.125)
    out = decode_tt.decode_attention(q[:3], k_buf, v_buf, kv_indptr, kv_indices, 0.125)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), expected, **BF16_TOL)


# --- KV store ----------------------------------------------------------------------------


# Not bf16: the interpreter's fp32 -> bf16 cast does not round like torch's (or the GPU's).
@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.float16])
def test_store_kv_triton_matches_reference(buffer_dtype):
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_kv_heads, head_dim = 5, 3, 64
    # k and v as slices of one fused projection output: strided, not contiguous.
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    loc = torch.tensor([4, 1, 9, 2, 7], dtype=torch.int32)
    buffers = [torch.zeros(12, num_kv_heads, head_dim, dtype=buffer_dtype) for _ in range(4)]
    reference.store_kv(buffers[0], buffers[1], loc, k, v)
    store_tt.store_kv(buffers[2], buffers[3], loc, k, v)
    torch.testing.assert_close(buffers[2], buffers[0], atol=0, rtol=0)
    torch.testing.assert_close(buffers[3], buffers[1], atol=0, rtol=0)
    torch.testing.assert_close(buffers[0][loc.long()], k.to(buffer_dtype), atol=0, rtol=0)
    torch.testing.assert_close(buffers[1][loc.long()], v.to(buffer_dtype), atol=0, rtol=0)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[loc.long()] = False
    assert not buffers[0][untouched].any() and not buffers[3][untouched].any()


# --- dispatch ----------------------------------------------------------------------------


def _spy(monkeypatch, module, name, calls=None):
    """Record calls to module.name (in `calls`, shared between spies if given)."""
    calls = [] if calls is None else calls
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def _small_decode_args():
    gen = torch.Generator().manual_seed(5)
    k_buf, v_buf, kv_indptr, kv_indices = _paged_kv([3, 5], 3, 64, torch.float32, gen)
    q = torch.randn(2, 9, 64, generator=gen)
    return q, k_buf, v_buf, kv_indptr, kv_indices, 0.125


def test_dispatch_cpu_goes_to_reference(monkeypatch):
    """Without the C++ CPU kernel (tests/test_cpu_decode.py covers it when it is built)."""
    monkeypatch.delenv("SGL_NB_ATTENTION", raising=False)
    monkeypatch.setenv("SGL_NB_CPU_DECODE", "0")
    calls = _spy(monkeypatch, reference, "decode_attention")
    _spy(monkeypatch, reference, "extend_attention", calls)
    _spy(monkeypatch, reference, "store_kv", calls)
    triton_calls = _spy(monkeypatch, decode_tt, "decode_attention")
    args = _small_decode_args()
    kernels.decode_attention(*args)
    q, k_buf, v_buf, kv_indptr, kv_indices, scale = args
    kernels.extend_attention(q, k_buf, v_buf, _indptr([1, 1]), kv_indptr, kv_indices, scale)
    loc = torch.tensor([1, 2])
    kernels.store_kv(k_buf, v_buf, loc, torch.zeros(2, 3, 64), torch.zeros(2, 3, 64))
    assert calls == ["decode_attention", "extend_attention", "store_kv"]
    assert triton_calls == []


def test_dispatch_env_forces_triton(monkeypatch):
    monkeypatch.setenv("SGL_NB_ATTENTION", "triton")
    calls = _spy(monkeypatch, decode_tt, "decode_attention")
    args = _small_decode_args()
    out = kernels.decode_attention(*args)
    assert calls == ["decode_attention"]
    torch.testing.assert_close(out, reference.decode_attention(*args), **FP32_TOL)

    monkeypatch.setenv("SGL_NB_ATTENTION", "torch")
    ref_calls = _spy(monkeypatch, reference, "decode_attention")
    kernels.decode_attention(*args)
    assert ref_calls == ["decode_attention"]

    monkeypatch.setenv("SGL_NB_ATTENTION", "cuda")
    with pytest.raises(ValueError):
        kernels.decode_attention(*args)


def test_package_functions_survive_submodule_imports():
    # Importing the Triton submodules must not rebind the package's public functions.
    for name in ("store_kv", "decode_attention", "extend_attention"):
        assert callable(getattr(kernels, name)) and not isinstance(
            getattr(kernels, name), type(sys)
        )


def test_package_works_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None  # any import of triton now fails\n"
        "import torch, sgl_nb.kernels as k\n"
        "q = torch.randn(1, 9, 64); kb = torch.randn(4, 3, 64); vb = torch.randn(4, 3, 64)\n"
        "o = k.decode_attention(q, kb, vb, torch.tensor([0, 3]), torch.tensor([1, 2, 3]), 0.1)\n"
        "assert o.shape == (1, 9, 64) and not o.isnan().any()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SGL_NB_ATTENTION"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=WAIT)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_decode_reference_shared_prefix_matches_naive(num_q_heads, num_kv_heads):
    """Requests whose first slots are the same (a radix prefix the batch shares) take the
    prefix-once path; the result must not change."""
    gen = torch.Generator().manual_seed(11)
    head_dim, shared = 64, reference.SHARED_PREFIX_MIN + 37
    own = [1, 5, 30, 2]
    k_buf, v_buf, _, slots = _paged_kv([shared + sum(own)], num_kv_heads, head_dim,
                                       torch.float32, gen)
    prefix, rest = slots[:shared], slots[shared:].split(own)
    kv_indices = torch.cat([torch.cat([prefix, r]) for r in rest])
    kv_lens = [shared + n for n in own]
    kv_indptr = _indptr(kv_lens)
    plan = reference.plan_decode(kv_indptr, kv_indices, num_kv_heads, num_q_heads)
    assert plan.prefix_len == shared
    q = torch.randn(len(own), num_q_heads, head_dim, generator=gen)
    out = reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125, plan=plan)
    want = _naive(q, k_buf, v_buf, [1] * len(own), kv_lens, kv_indices, 0.125)
    torch.testing.assert_close(out, want.float(), **FP32_TOL)


def test_model_forward_on_triton_kernels_equals_torch_path(monkeypatch):
    """The model runner drives the Triton kernels (interpreted here) through the same
    interface as the torch path: prefill, a cached-prefix extend and a batched decode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sgl_nb.runtime.model.forward_batch import build_batch
    from sgl_nb.runtime.model.model import Model
    from sgl_nb.runtime.model.model_config import ModelConfig

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                      max_position_embeddings=128, architectures=["Qwen2ForCausalLM"])
    hf = Qwen2ForCausalLM(cfg)
    model = Model(ModelConfig.from_dict(cfg.to_dict()), hf.state_dict())

    def run() -> list[torch.Tensor]:
        pool = model.new_kv_pool(64)
        a, b = pool.alloc(12), pool.alloc(7)
        ids_a, ids_b = list(range(3, 15)), list(range(40, 47))
        steps = [
            build_batch(False, [ids_a[:8], ids_b], [0, 0], [a[:8], b], [a[:8], b], "cpu"),
            build_batch(False, [ids_a[8:11]], [8], [a[:11]], [a[8:11]], "cpu"),
        ]
        b2 = torch.cat([b, pool.alloc(1)])
        steps.append(build_batch(True, [[ids_a[11]], [9]], [11, 7], [a, b2], [a[11:], b2[7:]],
                                 "cpu"))
        return [model.forward(fb, pool) for fb in steps]

    monkeypatch.setenv("SGL_NB_ATTENTION", "torch")
    want = run()
    monkeypatch.setenv("SGL_NB_ATTENTION", "triton")
    calls: list[str] = []
    for module, name in [(decode_tt, "decode_attention"), (extend_tt, "extend_attention")]:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    got = run()
    assert calls.count("extend_attention") == 2 * 2 and calls.count("decode_attention") == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
