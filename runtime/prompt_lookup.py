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
# Tokens drafted at most per proposal. On the 2-core CPU the verify pass is an extend
# through the torch layer loop, not the fused C++ decode step; its cost grows slowly with
# its length (figures in DRAFT_COST_NOTE below), so a long draft that is fully accepted
# pays and a wrong one costs little more than a short one.
MAX_DRAFT = 10
# After a proposal the model turned down at its first token, the request drafts nothing for
# this many of its next tokens, doubling at each further miss up to MAX_BACKOFF; any
# accepted draft resets it. Text that does not copy then costs a failed verify pass now
# and then, not every step.
FIRST_BACKOFF, MAX_BACKOFF = 2, 64
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
class RequestLookup:
    """One request's index and how its drafts fared."""

    index: NgramIndex = field(default_factory=NgramIndex)
    prompt_len: int = 0
    pending: int = 0  # drafts of its current proposal not yet checked (0: none of ours)
    resume_at: int = 0  # no drafting before its output has this many tokens
    backoff: int = FIRST_BACKOFF


class PromptLookup:
    """The drafting state of every request that has drafted; the engine forgets a
    request when it finishes."""

    def __init__(self) -> None:
        self._requests: dict[int, RequestLookup] = {}

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
        drafts = state.index.draft(min(MAX_DRAFT, limit))
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
        """The model's picks went through the request's drafts: `accepted` of them taken."""
        state = self._requests.get(rid)
        if state is None:
            return  # it finished on one of them
        state.pending = 0
        if accepted:
            state.backoff = FIRST_BACKOFF
            return
        state.resume_at = output_len + state.backoff
        state.backoff = min(state.backoff * 2, MAX_BACKOFF)

    def forget(self, rid: int) -> None:
        self._requests.pop(rid, None)
