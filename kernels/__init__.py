"""Attention and KV-store ops: Triton kernels on CUDA, torch everywhere else.

KV layout: one buffer per layer for K and one for V, [num_slots, num_kv_heads, head_dim];
slot 0 is reserved as padding. Page size 1: a request's KV is the list of its slot ids in
position order (kv_indices[kv_indptr[b]:kv_indptr[b + 1]]).

On CPU, prefill attention takes cpu_decode.cpp's kernel where it is built (the fused decode
step has its own copy of the same), and so does decode attention with a window or soft-cap
(the layer loop of a model the fused step does not take). SGL_NB_ATTENTION=torch|triton
forces one implementation (triton on CPU tensors needs TRITON_INTERPRET=1). Triton is
imported only when a Triton path is taken, so this package imports without it.

Per-layer variations, keyword arguments of both attention functions: `window` (sliding
window: a query at position p sees key positions k with p - window < k <= p, positions
being indices in the request's kv_indices list) and `softcap` (scores become
softcap * tanh(scores / softcap) after the scale, before the mask and softmax, as Gemma 2's
attn_logit_softcapping). The pool keeps every position's KV; the window only masks.

The Triton modules are named *_triton: a submodule named like a function of this package
(e.g. `decode_attention`) would replace that function as a package attribute on import.
"""

from __future__ import annotations

import os

import torch

from . import cpu_decode, reference

__all__ = ["decode_attention", "extend_attention", "plan_decode", "store_kv"]


def _use_triton(t: torch.Tensor) -> bool:
    # Read at every call (a dict lookup) so tests and notebooks can flip it at run time.
    forced = os.environ.get("SGL_NB_ATTENTION", "").strip().lower()
    if forced == "torch":
        return False
    if forced == "triton":
        return True
    if forced not in ("", "auto"):
        raise ValueError(f"SGL_NB_ATTENTION must be torch, triton or auto, got {forced!r}")
    return t.is_cuda


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v, in place, cast to the buffers' dtype.

    loc: int64/int32 [T] slot ids; k, v: [T, Hkv, D].
    """
    if _use_triton(k_buffer):
        from .store_kv_triton import store_kv as impl
    else:
        impl = reference.store_kv
    impl(k_buffer, v_buffer, loc, k, v)


def plan_decode(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_heads: int,
    num_q_heads: int,
    max_kv_len: int | None = None,
    window: int | None = None,
) -> reference.DecodePlan | None:
    """Gather indices for the torch decode path, computed once per step and shared by all
    layers of one `window` (layers of another window need their own plan); None on the
    Triton path (its kernels read kv_indices themselves)."""
    _check_variations(window, None)
    if _use_triton(kv_indices):
        return None
    return reference.plan_decode(
        kv_indptr, kv_indices, num_kv_heads, num_q_heads, max_kv_len, window)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    max_kv_len: int | None = None,
    plan: reference.DecodePlan | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Paged decode attention, one query token per request: q [B, Hq, D] -> [B, Hq, D].

    Request b attends to slots kv_indices[kv_indptr[b]:kv_indptr[b + 1]] (its current token
    included, already stored). GQA: query head h uses KV head h // (Hq // Hkv).
    max_kv_len, the longest request's KV length if the caller knows it, saves a
    device-to-host read. Softmax and accumulation are fp32; the result has q's dtype.
    `window` and `softcap`: see the module's docstring; a `plan` must be made for the
    same window.
    """
    _check_variations(window, softcap)
    if plan is not None and plan.window != window:
        raise ValueError(f"decode_attention: the plan was made for window {plan.window}, "
                         f"the call asks for window {window} (one plan per window)")
    if _use_triton(q):
        from .decode_attention_triton import decode_attention as impl

        return impl(q, k_buffer, v_buffer, kv_indptr, kv_indices, scale, max_kv_len,
                    window=window, softcap=softcap)
    if (window is not None or softcap is not None) and _use_cpu_kernel(q, k_buffer):
        # Plain calls keep the torch path: it is what the fused decode step is measured
        # against (tests/test_cpu_decode.py), and a model that can take the fused step does.
        out = cpu_decode.load().decode_attention(
            q.float() * scale, k_buffer, v_buffer, kv_indptr, kv_indices, window or 0,
            softcap or 0.0)
        return out.to(q.dtype)
    return reference.decode_attention(
        q, k_buffer, v_buffer, kv_indptr, kv_indices, scale, max_kv_len, plan,
        window=window, softcap=softcap,
    )


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
    """Causal attention of new tokens over a cached prefix plus themselves: [T, Hq, D] -> same.

    Request b's queries are q[qo_indptr[b]:qo_indptr[b + 1]]; its KV slots (prefix, then the
    new tokens, all already stored) are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]. Query i
    of request b sits at position prefix_len_b + i (prefix_len_b = kv_len_b - qo_len_b)
    and sees KV positions <= that (and > that - window). Softmax and accumulation are fp32;
    result in q's dtype.
    """
    _check_variations(window, softcap)
    if _use_triton(q):
        from .extend_attention_triton import extend_attention as impl

        return impl(q, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, scale, max_kv_len,
                    window=window, softcap=softcap)
    if _use_cpu_kernel(q, k_buffer):
        # cpu_decode.cpp's attention: a token's result does not depend on how its prompt was
        # split into prefill chunks or batched (SDPA's does, in the last bits).
        out = cpu_decode.load().extend_attention(
            q.float() * scale, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
            window or 0, softcap or 0.0)
        return out.to(q.dtype)
    return reference.extend_attention(
        q, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, scale, max_kv_len,
        window=window, softcap=softcap)

def _check_variations(window: int | None, softcap: float | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"attention window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention softcap must be a positive number or None, got {softcap!r}")


def _use_cpu_kernel(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    forced = os.environ.get("SGL_NB_ATTENTION", "").strip().lower() == "torch"
    return (not forced and not q.is_cuda and q.shape[-1] % 8 == 0
            and k_buffer.dtype in (torch.float32, torch.bfloat16) and cpu_decode.available())
