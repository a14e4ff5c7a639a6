"""One engine step as the scheduler chose it: its requests, the tokens each computes, the
model's ForwardBatch, and which extra rows of logits score a prompt or check drafts.

The model returns the logits of each request's last new token, and, when the step asks
for them (ForwardBatch.score_rows), the logits of further rows: first the scored ones,
then the jump-forward ones, in the order of `scored` and `drafts`.

A step of drafts only (jump-forward, prompt lookup: every request checks its drafts) can
run decode-shaped: each new token a row of its own whose KV range ends at itself, so that
the model's decode path computes it (on CPU the fused C++ step, which gives every row the
bits a decode of that token alone would: the output is the one decoding gives, in every
dtype, and one pass reads the weights once for all the drafts). The flattened rows are
the same either way, so `scored`, `drafts` and logits_at index them alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from sgl_nb.runtime.model.forward_batch import ForwardBatch, build_batch
from sgl_nb.runtime.request import Request


class ScoredRows(NamedTuple):
    """A scoring request's rows in this step: the logits at positions first_pos ...
    first_pos + n - 1, each giving the logprob of the prompt token after it."""

    req: Request
    first_pos: int
    n: int


class DraftRows(NamedTuple):
    """A jump-forward request's rows in this step: extra rows first_row ... first_row +
    n - 1 check its draft tokens (its last row is its last new token's, at logits_at)."""

    req: Request
    first_row: int
    n: int


@dataclass
class ScheduledBatch:
    reqs: list[Request]
    new_lens: list[int]  # tokens each request computes in this step
    forward: ForwardBatch
    scored: list[ScoredRows]
    drafts: list[DraftRows]
    # A decode step (one token per running request); a step of drafts is not one, even
    # when its forward is decode-shaped (forward.is_decode).
    is_decode: bool

    def draft_logits(self, i: int, last: torch.Tensor,
                     extra: torch.Tensor | None) -> torch.Tensor:
        """Request i (one with drafts): its logits after each of its new tokens, the rows
        that check its drafts first, its last new token's row last."""
        own = last[i : i + 1]
        d = next((d for d in self.drafts if d.req is self.reqs[i]), None)
        if d is None:  # it decoded this step (its drafts waited): its last token's row
            return own
        return torch.cat([extra[d.first_row : d.first_row + d.n], own])


def make_batch(is_decode: bool, chosen: list[tuple[Request, int]],
               device: torch.device, drafts_as_decodes: bool = False) -> ScheduledBatch:
    """chosen: (request, tokens it computes); its slots already include the new ones.
    drafts_as_decodes: a step whose every request checks drafts runs decode-shaped.
    A decode of more than one token a request decodes ahead (every request as many)."""
    reqs = [r for r, _ in chosen]
    lens = [n for _, n in chosen]
    starts = [r.fill_len - n for r, n in chosen]
    if is_decode and lens[0] > 1:
        return _decode_ahead(reqs, starts, lens[0], device)
    tokens = [r.all_ids[s : s + n] for r, s, n in zip(reqs, starts, lens)]
    out_loc = [r.slots[s:] for r, s in zip(reqs, starts)]
    rows: list[int] = []
    scored = _score_rows(reqs, starts, lens, rows)
    drafts = [] if is_decode else _draft_rows(reqs, starts, lens, rows)
    if drafts_as_decodes and not is_decode and not scored and all(r.draft_ids for r in reqs):
        fb = _drafts_as_decodes(reqs, tokens, starts, lens, device, rows or None)
    else:
        fb = build_batch(
            is_decode, tokens, starts, [r.slots for r in reqs], out_loc, device, rows or None,
        )
    return ScheduledBatch(reqs, lens, fb, scored, drafts, is_decode)


def _decode_ahead(reqs: list[Request], starts: list[int], ahead: int,
                  device: torch.device) -> ScheduledBatch:
    """A decode of `ahead` steps (ForwardBatch.ahead): each request's slots already end
    with those of its `ahead` new tokens; its one known input is its last output token."""
    ids = [r.all_ids[s] for r, s in zip(reqs, starts)]
    fb = build_batch(True, [[t] for t in ids], starts, [r.slots for r in reqs],
                     [r.slots[s : s + 1] for r, s in zip(reqs, starts)], device)
    fb.ahead = ahead
    return ScheduledBatch(reqs, [ahead] * len(reqs), fb, [], [], True)


def _drafts_as_decodes(reqs: list[Request], tokens: list[list[int]], starts: list[int],
                       lens: list[int], device: torch.device,
                       score_rows: list[int] | None) -> ForwardBatch:
    """The decode-shaped forward of a step of drafts: the token at position p of a request
    is a row that sees the request's slots up to p (its own included: the decode path
    stores every row's KV before any row attends)."""
    fb = build_batch(
        True,
        [[t] for toks in tokens for t in toks],
        [p for s, n in zip(starts, lens) for p in range(s, s + n)],
        [r.slots[: p + 1] for r, s, n in zip(reqs, starts, lens) for p in range(s, s + n)],
        [r.slots[p : p + 1] for r, s, n in zip(reqs, starts, lens) for p in range(s, s + n)],
        device,
        score_rows,
    )
    fb.logits_at = torch.tensor(lens).cumsum(0).sub_(1).to(device)
    return fb


def _score_rows(reqs: list[Request], starts: list[int], lens: list[int],
                rows: list[int]) -> list[ScoredRows]:
    """Append to rows the rows (in the flattened step) whose logits score a request's next
    prompt token."""
    scored = []
    offset = 0
    for r, start, n in zip(reqs, starts, lens):
        if r.logprob_start is not None:
            # Position p's logits predict token p + 1; the last token predicts nothing.
            first = max(start, r.logprob_start - 1)
            last = min(start + n, r.seq_len - 1)
            if last > first:
                rows.extend(range(offset + first - start, offset + last - start))
                scored.append(ScoredRows(r, first, last - first))
        offset += n
    return scored


def _draft_rows(reqs: list[Request], starts: list[int], lens: list[int],
                rows: list[int]) -> list[DraftRows]:
    """Append to rows the rows whose logits check a jump's draft tokens: from its last
    output token's position to the one before its last new token (that one's logits
    come anyway)."""
    drafts = []
    offset = 0
    for r, start, n in zip(reqs, starts, lens):
        first, last = max(start, r.committed_len - 1), start + n - 1
        if r.draft_ids and last > first:
            drafts.append(DraftRows(r, len(rows), last - first))
            rows.extend(range(offset + first - start, offset + last - start))
        offset += n
    return drafts
