"""What one model step computes: the flattened new tokens of a batch and where their KV lives."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


@dataclass
class ForwardBatch:
    """One engine step. Every tensor is on the model's device.

    Invariants: input_ids, positions and out_cache_loc have one entry per new token (T);
    kv_indptr has B+1 entries and request b's KV slots (its cached prefix and its new
    tokens, in position order) are kv_indices[kv_indptr[b]:kv_indptr[b+1]];
    logits_at holds, per request, the row of its last new token.
    Decode-shaped (is_decode): one token per row, B == T; a step of drafts may run so
    (scheduled_batch._drafts_as_decodes), its rows then more than its requests, logits_at
    picking each request's last.
    Decoding ahead (ahead > 1, decode-shaped): request b's KV slots end with the slots of
    its `ahead` new tokens, out_cache_loc holding the first; step s computes the token at
    positions + s, the first step input_ids, each later one the greedy pick of the step
    before (Model.forward_ahead; step_of gives step s alone).
    """

    is_decode: bool
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 slots the new tokens' K/V are written to
    kv_indptr: torch.Tensor  # [B+1] int64
    kv_indices: torch.Tensor  # [sum of kv lengths] int64
    qo_indptr: torch.Tensor  # [B+1] int64; for decode it is arange(B+1)
    max_kv_len: int
    logits_at: torch.Tensor  # [B] int64 rows of the new tokens whose logits are wanted
    # Rows whose logits are also returned (prompt scoring: the logprob of given tokens).
    score_rows: torch.Tensor | None = None
    ahead: int = 1  # decode steps this batch computes (see above)

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.numel() - 1

    def token_ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, ends) [T]: new token t sees the slots kv_indices[first[t]:ends[t]], its
        request's cached prefix and its new tokens up to itself (causal)."""
        q_lens = self.qo_indptr[1:] - self.qo_indptr[:-1]
        req = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q_lens.device), q_lens)
        t = torch.arange(req.numel(), device=req.device)
        return self.kv_indptr[:-1][req], self.kv_indptr[1:][req] - self.qo_indptr[1:][req] + t + 1

    def step_of(self, s: int, input_ids: torch.Tensor) -> ForwardBatch:
        """Step s of a batch that decodes ahead, as a one-step decode batch: each request's
        KV range without the slots of the steps after s."""
        later = self.ahead - 1 - s
        ends = self.kv_indptr[1:] - later
        keep = torch.cat([self.kv_indices[a:e] for a, e in zip(self.kv_indptr[:-1].tolist(),
                                                                 ends.tolist())])
        lens = ends - self.kv_indptr[:-1]
        indptr = torch.cat([self.kv_indptr[:1] * 0, lens.cumsum(0)])
        return ForwardBatch(True, input_ids, self.positions + s, self.kv_indices[ends - 1],
                            indptr, keep, self.qo_indptr, self.max_kv_len - later,
                            self.logits_at)


# Rows' alternatives as the fused step computes them: each row's k best ids, their logits,
# and its logsumexp, as the kernels' top_logits gives them.
Alternatives = tuple[list[list[int]], list[list[float]], list[float]]


class AheadLogits(NamedTuple):
    """What a batch that decodes ahead gives (ForwardBatch.ahead)."""

    rows: torch.Tensor  # [ahead, B, vocab] fp32: the logits of each step
    tokens: torch.Tensor  # [ahead - 1, B] int64: the picks steps 1 ... ahead - 1 took as input
    # Where the fused CPU step computed them, rows in [ahead][B] order.
    alternatives: Alternatives | None = None


def greedy_picks(rows: torch.Tensor) -> torch.Tensor:
    """Each row's greedy pick: the sampler's, decode ahead's torch path, and the rule the
    fused step's C++ follows (first_argmax): numpy's argmax, the first maximum (or the first
    NaN). numpy's is vectorised: 8 us a row of 49152 against torch's 128 (measured)."""
    return torch.from_numpy(rows.float().cpu().numpy().argmax(-1)).to(rows.device)


def build_batch(
    is_decode: bool,
    tokens: list[list[int]],
    starts: list[int],
    slots: list[torch.Tensor],
    out_loc: list[torch.Tensor],
    device: torch.device | str,
    score_rows: list[int] | None = None,
) -> ForwardBatch:
    """tokens[b]: request b's new tokens, at positions starts[b]...; slots[b]: all its KV slots
    (prefix + new); out_loc[b]: the slots of the new tokens (the tail of slots[b]).

    The small index tensors are views of one array made from one Python list: between two
    decode steps a torch op costs ~10 us (the step's weight reads left the interpreter's
    data out of cache), and the 16 it took here were a third of the Python of an int4 step."""
    device = torch.device(device)
    qo_lens = [len(t) for t in tokens]
    kv_lens = [s.numel() for s in slots]
    qo_indptr = [0, *itertools.accumulate(qo_lens)]
    parts = [
        [t for toks in tokens for t in toks],  # input_ids
        [p for s, n in zip(starts, qo_lens) for p in range(s, s + n)],  # positions
        qo_indptr,
        [0, *itertools.accumulate(kv_lens)],  # kv_indptr
        [i - 1 for i in qo_indptr[1:]],  # logits_at
        score_rows or [],
    ]
    # numpy for the list and the CPU views: half the cost of torch's tensor() and slicing.
    flat = np.array([x for part in parts for x in part], dtype=np.int64)
    bounds = [0, *itertools.accumulate(len(part) for part in parts)]
    if device.type == "cpu":
        views = [torch.from_numpy(flat[a:b]) for a, b in itertools.pairwise(bounds)]
    else:
        on_device = torch.from_numpy(flat).to(device, non_blocking=True)
        views = [on_device[a:b] for a, b in itertools.pairwise(bounds)]
    ids, positions, qo, kv_indptr, logits_at, scored = views

    def joined(ts: list[torch.Tensor]) -> torch.Tensor:
        t = ts[0] if len(ts) == 1 else torch.cat(ts)
        return t if device.type == "cpu" else t.to(device, non_blocking=True)

    return ForwardBatch(
        is_decode=is_decode,
        input_ids=ids,
        positions=positions,
        out_cache_loc=joined(out_loc),
        kv_indptr=kv_indptr,
        kv_indices=joined(slots),
        qo_indptr=qo,
        max_kv_len=max(kv_lens),
        logits_at=logits_at,
        score_rows=None if score_rows is None else scored,
    )
