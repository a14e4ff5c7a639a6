"""Prompt lookup (n-gram speculation): where the output copies its context (extraction,
RAG answers, code edits), the tokens that followed the latest earlier occurrence of the
request's last few tokens are good guesses for the next ones.

The guesses are drafts, exactly as jump-forward's are: the scheduler computes them with
the request's last token in one extend step, and the picker keeps each one the model's own
pick agrees with (runtime/token_picker.py), so the output is the one token-by-token
decoding gives. What this file decides is only what to propose, and when proposing is
worth an extend step.

The n-grams: transformers' prompt lookup matches the last max_matching_ngram_size (2)
tokens at their first occurrence and proposes prompt_lookup_num_tokens (10) after it;
llama.cpp's lookup decoding keeps n-gram caches of sizes 1-4 and drafts the most frequent
continuation. Here the longest match wins (3 tokens, then 2: a single token matches
almost anywhere and its continuation is rarely what follows), at its latest occurrence
(recent text is what output copies: the line being edited, the field being extracted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# The n-gram sizes matched, the longest first.
MAX_NGRAM, MIN_NGRAM = 3, 2
# What a verify pass costs against a decode step, on the default model (SmolLM2-135M), one
# request with 300 tokens of context, on the 2-core CPU, through the torch extend path
# (medians of 12 interleaved rounds on a loaded machine: the ratios are what matter):
#   fp32: decode 197 ms; extend of 1+k tokens: k=1 282, k=2 318, k=4 351, k=6 371, k=8 382,
#         k=10 396, k=12 446, k=16 508 ms: a verify of 1+10 costs 2.0 decodes.
#   int4: decode 87 ms; k=1 179, k=2 206, k=4 264, k=6 266, k=8 349, k=10 304, k=12 364,
#         k=16 458 ms: 3.5 decodes.
# Checked decode-shaped through the fused step (scheduled_batch.py), a verify costs about
# a decode plus a fixed cost per further row: the weights are read once, and each row adds
# its arithmetic, ~0.2 of a decode at fp32 (the matmuls wait on memory), ~0.3 with int4's
# bf16 kernels. The engine measures both as it runs (StepCosts), so the rule below holds
# for fp32, int4 and CUDA.
# A request's draft length: FIRST_DRAFT, doubled (up to MAX_DRAFT) after a verify that took
# every draft, halved after one that took none. Copies come in runs (a field, a line of
# code): inside one every draft is taken and longer drafts save more steps; past its end
# none is, and a short draft costs the least. On bench copy's workload (128 tokens a
# request) and on 4 prompts that copy nothing, decode work saved (a decode costs 1, a
# verify of k drafts 1 + 0.18 k, fp32's): fixed 10 drafts 1.49x and 0.97x; this, from 8
# up to 16, 1.65x and 1.01x; from 4 up to 16 1.73x and 1.03x (from 2: 1.62x; up to 8:
# 1.59x; up to 32: 1.48x); a length fitted to each request's acceptance rate (a
# geometric model, which misses the runs) 1.57x and 1.02x.
FIRST_DRAFT, MAX_DRAFT = 4, 16
# After a verify that did not pay (fewer tokens than its cost in decodes), the request
# drafts nothing for this many of its next tokens, doubling at each further such verify up
# to MAX_BACKOFF; a verify that paid resets it. Text that does not copy then costs a
# failed verify now and then, not every step.
FIRST_BACKOFF, MAX_BACKOFF = 2, 64
# Until a verify has been timed: what a further row costs in decodes (fp32's, above).
DEFAULT_ROW_COST = 0.2
COST_EMA = 0.1  # the weight of each new step time in its running average
# Drafting waits for steps of at most this many requests: beside other decodes, a request
# with drafts takes an extend step that they sit out (runtime/scheduler.py), and a batched
# decode step already shares its weight reads among its requests.
MAX_BATCH = 2


@dataclass
class NgramIndex:
    """Where each n-gram of a token sequence last occurred with a token after it, grown
    one token at a time (a lookup and an append cost O(MAX_NGRAM), whatever the length)."""

    tokens: list[int] = field(default_factory=list)
    # follows[n][ngram]: the position just after its latest occurrence that has a token
    # there (so the sequence's own last n tokens are never their own match).
    follows: dict[int, dict[tuple[int, ...], int]] = field(
        default_factory=lambda: {n: {} for n in range(MIN_NGRAM, MAX_NGRAM + 1)})

    def extend(self, ids: list[int]) -> None:
        for t in ids:
            i = len(self.tokens)
            for n, table in self.follows.items():
                if i >= n:
                    table[tuple(self.tokens[i - n : i])] = i
            self.tokens.append(t)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest
        matching tail. The copy may overlap its own source (a repeating phrase drafts its
        next repetitions), as an LZ77 match does."""
        seq = self.tokens
        end = len(seq)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if end <= n:
                continue
            at = self.follows[n].get(tuple(seq[end - n :]))
            if at is None:
                continue
            out: list[int] = []
            while len(out) < k:
                out.append(seq[at + len(out)] if at + len(out) < end
                           else out[at + len(out) - end])
            return out
        return []


@dataclass
class StepCosts:
    """Running averages of a decode step's seconds and of the seconds each row past the
    first adds to a verify step (the engine times both): a verify of k drafts costs
    about 1 + k * row / decode decodes."""

    decode: float = 0.0
    row: float | None = None  # None: no verify timed yet

    def add_decode(self, seconds: float) -> None:
        self.decode = _ema(self.decode or None, seconds)

    def add_verify(self, seconds: float, rows: int) -> None:
        if self.decode > 0.0 and rows > 1:
            self.row = _ema(self.row, max(seconds - self.decode, 0.0) / (rows - 1))

    def ratio(self, drafts: int) -> float:
        """What a verify of `drafts` drafts costs, in decodes."""
        return 1.0 + drafts * self.row_cost

    @property
    def row_cost(self) -> float:
        if self.row is None or self.decode == 0.0:
            return DEFAULT_ROW_COST
        return self.row / self.decode


def _ema(now: float | None, seconds: float) -> float:
    return seconds if now is None else (1 - COST_EMA) * now + COST_EMA * seconds


@dataclass
class RequestLookup:
    """One request's index and how its drafts fared."""

    index: NgramIndex = field(default_factory=NgramIndex)
    prompt_len: int = 0
    pending: int = 0  # drafts of its current proposal not yet checked (0: none of ours)
    resume_at: int = 0  # no drafting before its output has this many tokens
    backoff: int = FIRST_BACKOFF
    length: int = FIRST_DRAFT  # of its next draft


class PromptLookup:
    """The drafting state of every request that has drafted; the engine forgets a
    request when it finishes."""

    def __init__(self) -> None:
        self._requests: dict[int, RequestLookup] = {}
        self.costs = StepCosts()

    def propose(self, rid: int, prompt_ids: list[int], output_ids: list[int], limit: int,
                allowed: Callable[[list[int]], list[int]] | None = None) -> list[int]:
        """Drafts for the request's next tokens (at most `limit`), or []. allowed: cuts
        the drafts to the prefix a grammar accepts."""
        state = self._requests.get(rid)
        if state is None:
            state = self._requests[rid] = RequestLookup(prompt_len=len(prompt_ids))
            state.index.extend(prompt_ids)
        if len(output_ids) < state.resume_at or limit <= 0:
            return []
        seen = len(state.index.tokens) - state.prompt_len
        state.index.extend(output_ids[seen:])
        drafts = state.index.draft(min(state.length, limit))
        if drafts and allowed is not None:
            drafts = allowed(drafts)
        state.pending = len(drafts)
        return drafts

    def clear(self, rid: int) -> None:
        """The request has none of our drafts (any it had were dropped unchecked)."""
        state = self._requests.get(rid)
        if state is not None:
            state.pending = 0

    def drafting(self, rid: int) -> bool:
        """Whether the request's current drafts are ours (not jump-forward's)."""
        state = self._requests.get(rid)
        return state is not None and state.pending > 0

    def checked(self, rid: int, accepted: int, output_len: int) -> None:
        """The model's picks went through the request's drafts: `accepted` of them taken
        (and one pick of its own after them)."""
        state = self._requests.get(rid)
        if state is None:
            return  # it finished on one of them
        drafted, state.pending = state.pending, 0
        if accepted == drafted:
            state.length = min(2 * state.length, MAX_DRAFT)
        elif accepted == 0:
            state.length = max(state.length // 2, 1)
        if 1 + accepted >= self.costs.ratio(drafted):
            state.backoff = FIRST_BACKOFF
            return
        state.resume_at = output_len + state.backoff
        state.backoff = min(state.backoff * 2, MAX_BACKOFF)

    def forget(self, rid: int) -> None:
        self._requests.pop(rid, None)
