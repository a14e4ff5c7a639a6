"""Triton extend (prefill) attention over a cached prefix plus the new tokens, causal.

Every request's KV, prefix and new tokens alike, is already in the paged buffers, so one
loop over kv_indices covers both. A program handles one tile of BLOCK_M new tokens of one
request for one query head. Tiles are numbered over the whole batch (a request of n new
tokens owns cdiv(n, BLOCK_M) consecutive tiles), so ragged batches launch no idle
(request, tile) pairs and the grid needs no device-to-host sync.

A sliding window also hides keys at or before q_pos - window; the loop starts at the
tile's first visible key. The soft-cap is applied to the scaled scores before the masking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention_triton import soft_cap


@triton.jit
def _extend_kernel(
    Q,
    KBuf,
    VBuf,
    Out,
    QoIndptr,
    KvIndptr,
    KvIndices,
    TileReq,
    TileStart,
    scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_kbuf_s,
    stride_kbuf_h,
    stride_vbuf_s,
    stride_vbuf_h,
    stride_ot,
    stride_oh,
    num_requests,
    group: tl.constexpr,
    head_dim: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(TileReq + tile)
    if req >= num_requests:  # the grid is an upper bound on the number of tiles
        return
    m_block = tile - tl.load(TileStart + req)
    kv_head = head // group

    q_start = tl.load(QoIndptr + req)
    q_len = tl.load(QoIndptr + req + 1) - q_start
    kv_start = tl.load(KvIndptr + req)
    kv_len = tl.load(KvIndptr + req + 1) - kv_start
    prefix_len = kv_len - q_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_ptrs = Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(KBuf.dtype.element_ty)  # tl.dot wants both operands in one dtype
    # Query row i sits at KV position prefix_len + i and sees positions <= that.
    q_pos = prefix_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the tile's last query position are masked for every row: skip them.
    hi = tl.minimum(kv_len, prefix_len + (m_block + 1) * BLOCK_M)
    lo = 0
    if HAS_WINDOW:
        # Keys before the tile's first query's window are masked for every row: skip them.
        lo = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0)
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
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        # Every row sees key 0 (q_pos >= 0), so after the first block m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        shift = m_new
        if HAS_WINDOW:
            # Not so with a window: a row may see nothing in the tile's first blocks, where
            # exp(-inf - -inf) would be NaN; shifting by 0 there gives exp(-inf) = 0.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - shift)
        p = tl.exp(qk - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            VBuf + slots[:, None] * stride_vbuf_s + kv_head * stride_vbuf_h + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    max_kv_len: int | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """New tokens of each request against its cached prefix plus themselves, causal.

    q: [T, Hq, D] -> [T, Hq, D]. Request b's KV (kv_indices[kv_indptr[b]:kv_indptr[b+1]])
    holds kv_len_b - qo_len_b cached tokens followed by its new tokens. window and softcap:
    see kernels/__init__.py.
    """
    del max_kv_len  # the grid is sized from T, not from the KV lengths
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_q_heads % num_kv_heads == 0
    out = torch.empty_like(q)
    num_requests = qo_indptr.numel() - 1
    if num_tokens == 0 or num_requests == 0:
        return out
    assert q.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1

    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = 64 if block_d <= 64 else 32
    block_n = 64 if block_d <= 64 else 32
    # Tile t belongs to the request whose [tile_start, tile_end) holds t; tiles past the
    # total get request id num_requests and exit at once.
    tiles = (qo_indptr[1:] - qo_indptr[:-1] + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    max_tiles = (num_tokens + num_requests * (block_m - 1)) // block_m
    tile_ids = torch.arange(max_tiles, device=q.device, dtype=tile_end.dtype)
    tile_req = torch.searchsorted(tile_end, tile_ids, right=True)

    _extend_kernel[(max_tiles, num_q_heads)](
        q,
        k_buffer,
        v_buffer,
        out,
        qo_indptr,
        kv_indptr,
        kv_indices,
        tile_req,
        tile_start,
        scale,
        window or 0,
        softcap or 0.0,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        out.stride(0),
        out.stride(1),
        num_requests,
        group=num_q_heads // num_kv_heads,
        head_dim=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    return out
