"""Triton KV store: k_buffer[loc] = k, v_buffer[loc] = v (paged, page size 1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KBuf,
    VBuf,
    Loc,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbuf_s,
    stride_kbuf_h,
    stride_vbuf_s,
    stride_vbuf_h,
    num_heads: tl.constexpr,
    head_dim: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: all its heads at once, so the slot id is loaded once.
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)

    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kdst = KBuf + slot * stride_kbuf_s + offs_h[:, None] * stride_kbuf_h + offs_d[None, :]
    vdst = VBuf + slot * stride_vbuf_s + offs_h[:, None] * stride_vbuf_h + offs_d[None, :]
    tl.store(kdst, k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(vdst, v.to(VBuf.dtype.element_ty), mask=mask)


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v, in place, cast to the buffers' dtype."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    # The kernel indexes the head_dim axis with unit stride; k/v are often slices of a fused
    # qkv projection, which keeps that axis contiguous, so this rarely copies.
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_buffer,
        v_buffer,
        loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        num_heads=num_heads,
        head_dim=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
