"""Turn a batch of next-token logits into tokens, each row with its own parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.model.forward_batch import greedy_picks
from sgl_nb.runtime.sampling_params import SamplingParams


@dataclass
class Sampled:
    token: int
    logprob: float | None = None  # log-softmax of the raw logits (before temperature)
    top: list[tuple[int, float]] | None = None  # (token, logprob) alternatives, most likely first
    error: str | None = None  # why this row could not be sampled (its request fails alone)
    forced: bool = False  # a jump-forward draft token the model's logits chose too


@dataclass
class TopK:
    """Each row's k most likely tokens, taken before the grammar mask (what the model itself
    offered; runtime/token_choice.py), and each row's logsumexp: a logit minus it is that
    token's logprob. Python lists: what is left to do per step is a few numbers a row, and
    a torch op costs more than the arithmetic it would save."""

    ids: list[list[int]]
    logits: list[list[float]]
    lse: list[float]
    masked: list[list[bool]] | None = None  # once the rows are masked
    # Ranked by the CPU kernels' rule (the first NaN, else the largest, ties the lower id):
    # then ids[b][0] is numpy's argmax of row b, the greedy pick (greedy_picks' rule).
    argmax_first: bool = False

    def greedy(self) -> list[int] | None:
        """Each row's greedy pick, where ids[b][0] is it: ranked by the kernels' rule and
        no mask applied since (a mask may remove the best); else None."""
        if not self.argmax_first or self.masked is not None:
            return None
        return [ids[0] for ids in self.ids]

    def mark_masked(self, rows: torch.Tensor) -> None:
        """Read the mask off the masked rows: an alternative is masked where its logit is
        now -inf and was not before (a penalty's -inf is not the grammar's)."""
        now = torch.isneginf(rows.gather(1, torch.tensor(self.ids))).tolist()
        self.masked = [[m and x > -math.inf for m, x in zip(row, logits)]
                       for row, logits in zip(now, self.logits)]

    def select(self, keep: list[int]) -> TopK:
        masked = None if self.masked is None else [self.masked[i] for i in keep]
        return TopK([self.ids[i] for i in keep], [self.logits[i] for i in keep],
                    [self.lse[i] for i in keep], masked, self.argmax_first)

    def lists(self, rows: torch.Tensor, tokens: list[int]) -> list[tuple]:
        """Per row (ids, logprobs, masked, chosen token's logprob), the logprobs to
        LOGPROB_DECIMALS. rows: the masked rows (a chosen token was allowed, so its logit
        is the one the alternatives were taken from)."""
        arr, d = rows.numpy(), LOGPROB_DECIMALS
        masked = self.masked or [[False] * len(ids) for ids in self.ids]
        out = []
        for b, (ids, logits, lse, t) in enumerate(zip(self.ids, self.logits, self.lse, tokens)):
            chosen = float(arr[b, max(t, 0)]) - lse
            out.append((ids, [round(x - lse, d) for x in logits], masked[b], round(chosen, d)))
        return out


# Recorded logprobs keep 5 decimals (1e-5 nats, a probability to 0.001%): a float32's own
# digits ("-1.2345678806304932") were most of a trace's bytes for a token's alternatives.
LOGPROB_DECIMALS = 5
# Measured on a 2-core CPU, one thread as the engine runs it, rows of 151,936 logits
# (Qwen2.5): torch.topk (k=5) 0.3 ms a row, against 0.05 for the chunk maxima of _topk;
# torch.logsumexp over [16, vocab] 1.9 ms, against 1.1 for _logsumexp (its temporaries the
# size of the batch, 10 MB, are allocated and leave the cache; one row's stays in L2).
TOPK_CHUNK = 64


def float_cpu(rows: torch.Tensor) -> torch.Tensor:
    """rows as contiguous float32 on the CPU: the tensor itself where it is one already (a
    conversion that changes nothing is still a torch op, ~15 us between two decode steps:
    the step's weight reads left torch's code and data out of cache)."""
    if rows.dtype == torch.float32 and rows.device.type == "cpu" and rows.is_contiguous():
        return rows
    return rows.float().cpu().contiguous()


def top_alternatives(rows: torch.Tensor, k: int) -> TopK:
    """rows: [B, vocab] float32 logits; the k most likely tokens of each row (ties: the lower
    id), and its logsumexp. Through the CPU kernels' top_logits where they are loaded: one
    pass a row, where torch takes ~10 ops at ~10 us each between two decode steps."""
    k = min(k, rows.shape[-1])
    native = cpu_decode.loaded()
    if native is not None and rows.device.type == "cpu" and k > 0:
        return TopK(*native.top_logits(float_cpu(rows), k), argmax_first=True)
    logits, ids = _topk(rows, k)
    logits = logits.tolist()
    return TopK(ids, logits, _logsumexp(rows, [row[0] for row in logits]))


def _logsumexp(rows: torch.Tensor, peaks: list[float]) -> list[float]:
    """torch.logsumexp(rows, -1), given each row's maximum: a row at a time through one
    buffer."""
    buf, out = torch.empty(rows.shape[1]), []
    for row, peak in zip(rows, peaks):
        peak = max(peak, -1e30)  # a row of -inf only: -inf, not nan
        total = torch.sub(row, peak, out=buf).exp_().sum().item()
        out.append(peak + math.log(total) if total > 0 else -math.inf)
    return out


def _topk(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, list[list[int]]]:
    """torch.topk's values and ids, batched, from a pass of chunk maxima: the k largest
    logits lie in the k chunks with the largest maxima (a chunk left out has k chunks
    whose maxima are at least its own), so topk only looks at those k chunks' logits (and
    the tail, when the vocabulary is not a multiple of the chunk)."""
    b, vocab = rows.shape
    c = TOPK_CHUNK
    n = vocab // c
    if n <= k:
        values, ids = torch.topk(rows, k, -1)
        return values, ids.tolist()
    body = rows[:, : n * c].reshape(b, n, c)
    best = torch.topk(body.amax(-1), k, -1).indices  # [B, k] chunks
    cand = body[torch.arange(b)[:, None], best].reshape(b, k * c)
    if n * c < vocab:
        cand = torch.cat([cand, rows[:, n * c :]], 1)
    values, at = torch.topk(cand, k, -1)
    tail = n * c - k * c  # a candidate past the k chunks is tail logit (j - k * c)
    ids = [[chunks[j // c] * c + j % c if j < k * c else j + tail for j in row]
           for chunks, row in zip(best.tolist(), at.tolist())]
    return values, ids


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row of logits, with temperature, top-k, top-p and min-p applied (-inf outside)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cum - sorted_logits.softmax(-1) >= p.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    all_logprobs: bool = False,
    top: TopK | None = None,
) -> list[Sampled]:
    """logits: [B, vocab] float32 on the CPU. Greedy rows take the argmax; the others draw
    with their own generator, so a seeded request draws the same tokens whatever batch it
    is in.
    all_logprobs: every row's logprob, asked or not (someone listens to token events).
    top: the rows' alternatives, where taken: their best is the greedy pick where
    TopK.greedy says so (numpy's own pass over a decode ahead's rows, cold by then, cost
    ~6 us a token)."""
    greedy = top.greedy() if top is not None else None
    if greedy is None and any(p.greedy for p in params):
        greedy = greedy_picks(logits).tolist()
    out: list[Sampled] = []
    for b, p in enumerate(params):
        if p.greedy:
            out.append(Sampled(greedy[b]))
            continue
        probs = filter_logits(logits[b], p).softmax(-1)
        try:
            out.append(Sampled(int(torch.multinomial(probs, 1, generator=generators[b]))))
        except RuntimeError as e:  # no finite probability left in this row
            out.append(Sampled(-1, error=f"no token could be sampled ({e}); temperature "
                                         f"{p.temperature} with its penalties and filters "
                                         "left no finite probability"))
    tokens = [s.token for s in out]
    wanted = [b for b, p in enumerate(params)
              if (all_logprobs or p.logprobs or p.top_logprobs) and out[b].error is None]
    if wanted:
        logp = torch.log_softmax(logits[wanted], -1)
        for row, b in enumerate(wanted):
            out[b].logprob = float(logp[row, tokens[b]])
            k = params[b].top_logprobs
            if k:
                vals, ids = torch.topk(logp[row], k)
                out[b].top = list(zip(ids.tolist(), vals.tolist()))
    return out
