"""Paged K/V buffers for the kernel tests: requests' tokens at scattered slots."""

from __future__ import annotations

import torch


def indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)


def paged_kv(kv_lens, num_kv_heads, head_dim, dtype, gen):
    """K/V buffers holding the requests' tokens at scattered slots: (k_buf, v_buf, kv_indptr,
    kv_indices).

    Every slot no request owns (slot 0 included) is NaN: a kernel that reads a padding or
    foreign slot into its result fails the comparison instead of passing by luck.
    """
    total = sum(kv_lens)
    num_slots = total + 17
    k_buf = torch.full((num_slots, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_buf = torch.full_like(k_buf, float("nan"))
    slots = torch.randperm(num_slots - 1, generator=gen)[:total] + 1
    k_buf[slots] = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buf[slots] = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_buf, v_buf, indptr(kv_lens), slots
