"""Triton paged decode attention, split over the KV length (flash-decoding).

Decode has one query token per request, so a program per (request, head) leaves most of the
GPU idle when the batch is small and the context long. Stage 1 splits each request's KV into
`num_splits` contiguous chunks; a program handles one (request, KV head, chunk) for all the
query heads of that KV head (GQA: K/V are loaded once per group) and writes the chunk's
normalised partial output plus its log-sum-exp. Stage 2 merges the chunks of one
(request, query head) with the log-sum-exp weights.

A sliding window makes the request's KV its last `window` slots: the chunks split those
only. The soft-cap is applied to the scaled scores before the masking.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_MAX_SPLITS = 16
_MIN_TOKENS_PER_SPLIT = 64


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap), tanh written as 1 - 2 / (exp(2y) + 1): finite for every x
    (exp overflowing to inf gives 1) and in every Triton backend, the interpreter's too."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * (x / cap)) + 1.0))


@triton.jit
def _decode_split_kernel(
    Q,
    KBuf,
    VBuf,
    KvIndptr,
    KvIndices,
    MidO,
    MidLse,
    scale,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_kbuf_s,
    stride_kbuf_h,
    stride_vbuf_s,
    stride_vbuf_h,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    num_splits,
    group: tl.constexpr,
    head_dim: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * group + offs_g
    head_mask = offs_g < group
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    kv_start = tl.load(KvIndptr + req)
    kv_len = tl.load(KvIndptr + req + 1) - kv_start
    if HAS_WINDOW:
        # The query sits at position kv_len - 1 and sees the last `window` positions.
        first = tl.maximum(kv_len - window, 0)
        kv_start += first
        kv_len -= first
    split_len = tl.cdiv(kv_len, num_splits)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    q_ptrs = Q + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(KBuf.dtype.element_ty)  # tl.dot wants both operands in one dtype

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(KvIndices + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            KBuf + slots[:, None] * stride_kbuf_s + kv_head * stride_kbuf_h + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        # "ieee": fp32 inputs must not be truncated to tf32 (ignored for bf16/fp16).
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if HAS_SOFTCAP:
            qk = soft_cap(qk, softcap)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        # The loop only runs on non-empty blocks, so m_new is finite from the first one on.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            VBuf + slots[:, None] * stride_vbuf_s + kv_head * stride_vbuf_h + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # An empty chunk (short request) writes a zero output with weight exp(-inf) = 0.
    has_kv = l_i > 0
    out = acc / tl.where(has_kv, l_i, 1.0)[:, None]
    lse = tl.where(has_kv, m_i + tl.log(tl.where(has_kv, l_i, 1.0)), float("-inf"))
    mo_ptrs = (
        MidO
        + req * stride_mo_b
        + heads[:, None] * stride_mo_h
        + split * stride_mo_s
        + offs_d[None, :]
    )
    tl.store(mo_ptrs, out, mask=head_mask[:, None] & d_mask[None, :])
    tl.store(MidLse + req * stride_ml_b + heads * stride_ml_h + split, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    MidO,
    MidLse,
    Out,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ob,
    stride_oh,
    num_splits,
    head_dim: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    lse = tl.load(
        MidLse + req * stride_ml_b + head * stride_ml_h + offs_s, mask=s_mask, other=float("-inf")
    )
    m = tl.max(lse, 0)
    # A request with no KV at all has every lse at -inf; keep exp() finite and output 0.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    partial = tl.load(
        MidO
        + req * stride_mo_b
        + head * stride_mo_h
        + offs_s[:, None] * stride_mo_s
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * partial, 0) / tl.where(denom > 0, denom, 1.0)
    o_ptrs = Out + req * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # TRITON_INTERPRET on the CPU: any small number will do


def _choose_num_splits(
    batch: int, num_kv_heads: int, max_kv_len: int | None, device: torch.device
) -> int:
    # Enough programs to fill the GPU about twice over, but no chunk shorter than
    # _MIN_TOKENS_PER_SPLIT tokens where the longest request is known.
    splits = triton.cdiv(2 * _num_sms(device), batch * num_kv_heads)
    if max_kv_len is not None:
        splits = min(splits, triton.cdiv(max_kv_len, _MIN_TOKENS_PER_SPLIT))
    return max(1, min(splits, _MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    max_kv_len: int | None = None,
    num_kv_splits: int | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per request against its paged KV. q: [B, Hq, D] -> [B, Hq, D].

    num_kv_splits overrides the split heuristic (tests use it to cover the merge).
    window and softcap: see kernels/__init__.py.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_q_heads % num_kv_heads == 0
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    assert q.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    if window is not None and max_kv_len is not None:
        max_kv_len = min(max_kv_len, window)
    num_splits = num_kv_splits or _choose_num_splits(batch, num_kv_heads, max_kv_len, q.device)

    mid_o = torch.empty(
        batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        mid_o,
        mid_lse,
        scale,
        window or 0,
        softcap or 0.0,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        num_splits,
        group=group,
        head_dim=head_dim,
        # tl.dot needs at least 16 rows; unused head rows are masked.
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64 if block_d <= 64 else 32,
        BLOCK_D=block_d,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        mid_o,
        mid_lse,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        head_dim=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )
    return out
