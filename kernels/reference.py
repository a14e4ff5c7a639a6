"""Torch implementations of the KV store and paged attention.

These are the CPU engine's hot path (and the oracle the Triton kernels are tested against),
so they are written for a small CPU: no Python loop over heads or tokens, gathers through
`index_select` (several times faster than advanced indexing on CPU), and one batched
computation for all decode requests.

KV layout: one buffer per layer for K and one for V, [num_slots, num_kv_heads, head_dim].
Only the slots a request lists are read, so slots never written may hold anything.

Two per-layer variations (see kernels/__init__.py): a sliding `window` (a query at position
p sees keys at p - window < k <= p) and a `softcap` (scores become
softcap * tanh(scores / softcap) after the scale, before the mask and softmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v, in place, cast to the buffers' dtype."""
    loc = loc.long()
    k_buffer.index_copy_(0, loc, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, loc, v.to(v_buffer.dtype))


def _rows(k_buffer: torch.Tensor) -> torch.Tensor:
    # [num_slots * Hkv, D]: row slot * Hkv + h is head h of a slot, so a gather can produce
    # head-major K/V ([..., Hkv, L, D]) directly, which is what bmm wants.
    return k_buffer.reshape(-1, k_buffer.shape[-1])


def _padded_slots(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, max_len] slot ids and the [B, max_len] mask of the real ones.

    Padding repeats the request's first slot rather than slot 0: it is masked out of the
    scores and weighted by exactly 0 in the output, which is only harmless if its V is
    finite, and a pool allocated with torch.empty may hold NaN bits in slots never written.
    """
    starts = kv_indptr[:-1, None]
    pos = torch.arange(max_len, device=kv_indptr.device)
    valid = pos < kv_indptr[1:, None] - starts
    flat = torch.where(valid, starts + pos, starts)
    return kv_indices.take(flat), valid


@dataclass
class DecodePlan:
    """Gather indices for one decode step, shared by every layer (the slots are the same)."""

    rows: torch.Tensor  # [B * Hkv * L] row ids into the [num_slots * Hkv, D] buffer view
    bags: torch.Tensor  # [B * Hq, L] the same rows, once per query head, for embedding_bag
    pad: torch.Tensor | None  # [B, 1, L] True at padding positions; None when B == 1
    batch: int
    seq_len: int  # L: the per-request part (everything after the shared prefix)
    # The first prefix_len slots, identical in every request (a radix-cache prefix the
    # batch shares): read once for all queries instead of once per request.
    prefix_rows: torch.Tensor | None = None  # [Hkv * P], head-major
    prefix_len: int = 0
    # The sliding window the slots were cut to (None: all of each request's slots). A layer
    # of another window needs a plan of its own.
    window: int | None = None


# Below this many shared slots the separate prefix pass costs more than it saves.
SHARED_PREFIX_MIN = 64


def _shared_prefix_len(slots: torch.Tensor, valid: torch.Tensor) -> int:
    same = ((slots == slots[:1]) & valid).all(0)
    shared = int(same.int().cumprod(0).sum())
    # Every request keeps at least one token of its own (its current one) in the suffix.
    return min(shared, int(valid.sum(1).min()) - 1)


def window_slots(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's last `window` slots (all of them when it is shorter): what a decode
    query at the request's last position sees through a sliding window."""
    kv_indptr, kv_indices = kv_indptr.long(), kv_indices.long()
    lens = (kv_indptr[1:] - kv_indptr[:-1]).clamp(max=window)
    starts = kv_indptr[1:] - lens
    new_indptr = torch.zeros_like(kv_indptr)
    torch.cumsum(lens, 0, out=new_indptr[1:])
    offsets = torch.arange(int(new_indptr[-1]), device=kv_indptr.device)
    offsets -= new_indptr[:-1].repeat_interleave(lens)
    return new_indptr, kv_indices.take(starts.repeat_interleave(lens) + offsets)


def plan_decode(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_heads: int,
    num_q_heads: int,
    max_kv_len: int | None = None,
    window: int | None = None,
) -> DecodePlan:
    batch = kv_indptr.numel() - 1
    kv_indptr, kv_indices = kv_indptr.long(), kv_indices.long()
    if window is not None:
        kv_indptr, kv_indices = window_slots(kv_indptr, kv_indices, window)
        max_kv_len = None if max_kv_len is None else min(max_kv_len, window)
    prefix_len = 0
    if batch == 1:
        # One request: its slots are all valid, so no padding and no mask.
        start, end = kv_indptr.tolist()
        slots, pad = kv_indices[start:end][None, :], None
    else:
        if max_kv_len is None:
            max_kv_len = int((kv_indptr[1:] - kv_indptr[:-1]).max())
        slots, valid = _padded_slots(kv_indptr, kv_indices, max_kv_len)
        prefix_len = _shared_prefix_len(slots, valid)
        if prefix_len >= SHARED_PREFIX_MIN:
            prefix = slots[0, :prefix_len]
            slots, valid = slots[:, prefix_len:], valid[:, prefix_len:]
        pad = ~valid[:, None, :]
    seq_len = slots.shape[1]
    head_ids = torch.arange(num_kv_heads, device=slots.device)
    rows = slots[:, None, :] * num_kv_heads + head_ids[:, None]  # [B, Hkv, L]
    group = num_q_heads // num_kv_heads
    bags = rows[:, :, None, :].expand(batch, num_kv_heads, group, seq_len)
    plan = DecodePlan(rows.reshape(-1), bags.reshape(-1, seq_len), pad, batch, seq_len,
                      window=window)
    if batch > 1 and prefix_len >= SHARED_PREFIX_MIN:
        plan.prefix_rows = (head_ids[:, None] + prefix[None, :] * num_kv_heads).reshape(-1)
        plan.prefix_len = prefix_len
    return plan


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    max_kv_len: int | None = None,
    plan: DecodePlan | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per request against its paged KV. q: [B, Hq, D] -> [B, Hq, D].

    max_kv_len, if given, must be at least the longest request's KV length. `plan`
    (from plan_decode) saves recomputing the gather indices in every layer; it must have
    been made for the same `window`.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if batch == 0:
        return torch.empty_like(q)
    if plan is None:
        plan = plan_decode(kv_indptr, kv_indices, num_kv_heads, num_q_heads, max_kv_len, window)
    elif plan.window != window:
        raise ValueError(f"decode_attention: the plan was made for window {plan.window}, "
                         f"the call asks for window {window} (one plan per window)")
    if plan.prefix_len:
        return _decode_shared_prefix(q, k_buffer, v_buffer, scale, plan, softcap)
    group, seq_len = num_q_heads // num_kv_heads, plan.seq_len

    # GQA as a view: the `group` query heads of one KV head are the rows of one small matmul.
    qf = (q.float() * scale).view(batch * num_kv_heads, group, head_dim)
    k = _rows(k_buffer).index_select(0, plan.rows)
    k = k.view(batch * num_kv_heads, seq_len, head_dim).float()
    scores = _soft_cap(torch.bmm(qf, k.transpose(1, 2)), softcap)  # [B * Hkv, G, L]
    if plan.pad is not None:
        scores.view(batch, num_q_heads, seq_len).masked_fill_(plan.pad, float("-inf"))
    probs = torch.softmax(scores, dim=-1)

    if v_buffer.dtype == torch.float32:
        # embedding_bag sums the weighted V rows without materialising the gathered V:
        # one pass over V instead of gather + write + read.
        out = F.embedding_bag(
            plan.bags,
            _rows(v_buffer),
            per_sample_weights=probs.view(batch * num_q_heads, seq_len),
            mode="sum",
        )
    else:
        # Low-precision V: upcast the gathered rows so the weighted sum is done in fp32.
        v = _rows(v_buffer).index_select(0, plan.rows)
        out = torch.bmm(probs, v.view(batch * num_kv_heads, seq_len, head_dim).float())
    return out.view(batch, num_q_heads, head_dim).to(q.dtype)


def _soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """softcap * tanh(scores / softcap), in place (Gemma 2's attention logit soft-capping)."""
    if softcap is None:
        return scores
    return scores.div_(softcap).tanh_().mul_(softcap)


def _decode_shared_prefix(q, k_buffer, v_buffer, scale: float, plan: DecodePlan,
                          softcap: float | None):
    """Decode attention split in two and merged by log-sum-exp: the shared prefix for all
    queries at once (its K/V read once), then each request's own tokens."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group, p_len, s_len = num_q_heads // num_kv_heads, plan.prefix_len, plan.seq_len
    qf = q.float() * scale

    # Prefix: every request's query heads of one KV head are rows of one matmul.
    qh = qf.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
    qh = qh.reshape(num_kv_heads, batch * group, head_dim)
    kp = _rows(k_buffer).index_select(0, plan.prefix_rows).view(num_kv_heads, p_len, head_dim)
    vp = _rows(v_buffer).index_select(0, plan.prefix_rows).view(num_kv_heads, p_len, head_dim)
    sp = _soft_cap(torch.bmm(qh, kp.float().transpose(1, 2)), softcap)  # [Hkv, B * G, P]
    mp = sp.amax(-1, keepdim=True)
    ep = (sp - mp).exp_()
    op = torch.bmm(ep, vp.float())  # [Hkv, B * G, D], not yet normalised

    def per_request(t: torch.Tensor, width: int) -> torch.Tensor:  # -> [B, Hkv, G, width]
        return t.view(num_kv_heads, batch, group, width).transpose(0, 1)

    lp = per_request(ep.sum(-1, keepdim=True), 1)
    mp, op = per_request(mp, 1), per_request(op, head_dim)

    # Each request's own tokens (at least its current one, so the max is finite).
    ks = _rows(k_buffer).index_select(0, plan.rows).view(batch * num_kv_heads, s_len, head_dim)
    ss = torch.bmm(qf.view(batch * num_kv_heads, group, head_dim), ks.float().transpose(1, 2))
    ss = _soft_cap(ss, softcap)
    ss.view(batch, num_q_heads, s_len).masked_fill_(plan.pad, float("-inf"))
    ms = ss.amax(-1, keepdim=True)
    es = (ss - ms).exp_()
    vs = _rows(v_buffer).index_select(0, plan.rows).view(batch * num_kv_heads, s_len, head_dim)
    os_ = torch.bmm(es, vs.float())
    shape = (batch, num_kv_heads, group)
    ms, ls, os_ = ms.view(*shape, 1), es.sum(-1, keepdim=True).view(*shape, 1), os_.view(*shape, -1)

    m = torch.maximum(mp, ms)
    wp, ws = (mp - m).exp_(), (ms - m).exp_()
    out = (op * wp + os_ * ws) / (lp * wp + ls * ws)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


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
    holds prefix_len_b = kv_len_b - qo_len_b cached tokens followed by its new tokens.
    """
    del max_kv_len  # each request's lengths are read on the host anyway
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    kv_indices = kv_indices.long()
    compute_dtype = torch.float32 if q.dtype in _LOW_PRECISION else q.dtype
    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    head_ids = torch.arange(num_kv_heads, device=q.device)

    qo_bounds = qo_indptr.tolist()
    kv_bounds = kv_indptr.tolist()
    for b in range(len(qo_bounds) - 1):
        q_start, q_end = qo_bounds[b], qo_bounds[b + 1]
        kv_start, kv_end = kv_bounds[b], kv_bounds[b + 1]
        q_len, kv_len = q_end - q_start, kv_end - kv_start
        if q_len == 0:
            continue
        prefix_len = kv_len - q_len
        # Keys before the first query's window are seen by no query: not even gathered.
        first = 0 if window is None else max(0, prefix_len + 1 - window)
        slots = kv_indices[kv_start + first : kv_end]
        # [Hkv, L, D] straight from the gather (see _rows).
        rows = (slots[None, :] * num_kv_heads + head_ids[:, None]).view(-1)
        k = _rows(k_buffer).index_select(0, rows).view(num_kv_heads, -1, head_dim)
        v = _rows(v_buffer).index_select(0, rows).view(num_kv_heads, -1, head_dim)
        # GQA as a view: query heads of one KV head stacked as [Hkv, G * q_len, D], so
        # SDPA sees plain multi-head attention (no enable_gqa, no repeated K/V).
        qb = q[q_start:q_end].view(q_len, num_kv_heads, group, head_dim)
        qb = qb.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        mask = _extend_mask(prefix_len, first, kv_len, window, q.device)
        if mask is not None:
            mask = mask.repeat(group, 1)
        qb, k, v = qb.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
        if softcap is None:
            ob = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
        else:  # SDPA has no soft-cap: the scores are written out
            scores = _soft_cap(torch.bmm(qb, k.transpose(1, 2)).mul_(scale), softcap)
            if mask is not None:
                scores.masked_fill_(~mask, float("-inf"))
            ob = torch.bmm(torch.softmax(scores, dim=-1), v)
        ob = ob.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[q_start:q_end] = ob.reshape(q_len, num_q_heads, head_dim)
    return out


def _extend_mask(
    prefix_len: int, first: int, kv_len: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """[q_len, kv_len - first] True where query i (at position prefix_len + i) sees key
    first + j; None when every query sees every key."""
    q_len = kv_len - prefix_len
    if q_len == 1 and (window is None or kv_len - first <= window):
        return None
    pos_q = torch.arange(prefix_len, kv_len, device=device)[:, None]
    pos_k = torch.arange(first, kv_len, device=device)[None, :]
    mask = pos_k <= pos_q
    if window is not None:
        mask &= pos_k > pos_q - window
    return mask
