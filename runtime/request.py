"""One generation request: its tokens, where their KV lives, and how it finishes."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sgl_nb.runtime.sampler import Sampled
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.runtime.token_choice import TokenChoice

if TYPE_CHECKING:
    from sgl_nb.runtime.text_decoder import TextDecoder

_ids = itertools.count(1)
EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


@dataclass
class GenerateOutput:
    text: str
    token_ids: list[int]
    meta: dict
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    input_logprobs: list[float] | None = None  # scoring requests: logprob of each scored token
    # One per generated token: its top alternatives, what the grammar masked, whether it was
    # forced (runtime/token_choice.py). None when the engine records none.
    tokens: list[TokenChoice] | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # params.max_tokens clipped to the context length
    # The tokens that end it: params.stop_token_ids, and the model's EOS ids unless
    # params.ignore_eos (RequestFactory sets them).
    stop_tokens: frozenset[int] = frozenset()
    # Scoring request: no generation; the logprob of every prompt token from this position
    # on, each given the tokens before it, is recorded and the request ends after prefill.
    logprob_start: int | None = None
    rid: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    # Jump-forward: tokens of the text the grammar forces next, proposed after the last
    # output token and not yet output. A step computes them with it; each one the model's
    # own logits choose joins output_ids, the first it does not is dropped with the rest.
    draft_ids: list[int] = field(default_factory=list)
    # KV: slots[i] holds the K/V of all_ids[i]. Invariant between steps: len(slots) == fill_len
    # <= committed_len; slots[:cached_len] belong to the radix tree (kept alive by the lock
    # on last_node), the rest to this request.
    slots: torch.Tensor = field(default_factory=lambda: EMPTY_SLOTS)
    cached_len: int = 0
    last_node: object | None = None
    prompt_cached_tokens: int = -1  # tokens of the prompt found in the cache at first admission
    generator: torch.Generator | None = None
    grammar: object | None = None  # runtime.grammar.Grammar when regex / json_schema is set
    gate: Callable[[], bool] | None = None  # a step controller's "may it decode now?"
    text: str = ""
    sent_len: int = 0  # characters of text already streamed
    stop_from: int = 0  # stop strings are looked for from here on (after min_tokens' text)
    # Incremental detokenization: text holds output_ids[:read_offset] decoded; new tokens are
    # decoded with output_ids[prefix_offset:read_offset] as context (a token's leading space
    # or a character split across tokens decodes as in the whole), so a step decodes a few
    # tokens, not the whole output (which cost 0.2-0.3 ms a token at 256 tokens, measured).
    prefix_offset: int = 0
    read_offset: int = 0
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    error: BaseException | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    retractions: int = 0
    # Scheduling: level (runtime.priority; 0 = interactive), and who asked (for events).
    priority: int = 1
    program: int | None = None
    node: int | None = None
    index: int = 0  # which Instruction of its node it is (a Select scores each choice apart)
    # The program's Instruction it runs (runtime/compiler/instructions.py), if a program sent it:
    # the executor, not the engine, then reports its start and end.
    instruction: object | None = None
    preemptions: int = 0  # times suspended (KV kept) for higher-priority work
    slice_used: int = 0  # decode steps since it last started or resumed
    waiting_since: int = 0  # scheduler step at which it last began to wait (queued/suspended)
    prefill_tokens: int = 0  # tokens computed in extend steps (a resume adds none)
    max_batch: int = 0  # the largest batch it ran in
    input_logprobs: list[float] = field(default_factory=list)
    # One TokenChoice per output token; the engine sets [] when it records them.
    token_choices: list[TokenChoice] | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_ids(self) -> list[int]:
        """Prompt, output and draft tokens: everything the next step may compute."""
        return self.prompt_ids + self.output_ids + self.draft_ids

    @property
    def fill_len(self) -> int:
        return self.slots.numel()

    @property
    def seq_len(self) -> int:
        return self.committed_len + len(self.draft_ids)

    @property
    def committed_len(self) -> int:
        """Prompt and output tokens (drafts not counted)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, s: Sampled, decode: TextDecoder) -> None:
        """Take one sampled token, update the text and decide whether the request is done.
        decode: runtime/text_decoder.py's, of the engine's tokenizer."""
        p = self.params
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.output_ids.append(s.token)
        if p.logprobs or p.top_logprobs:
            self.logprobs.append(s.logprob)
            if p.top_logprobs:
                self.top_logprobs.append(s.top)
        if self.grammar is not None:
            self.grammar.accept(s.token)
        if s.token in self.stop_tokens:
            self.finish_reason, self.matched_stop = "stop", s.token
            self.text = decode(self.output_ids[:-1])
            return
        self._decode_new(decode)
        grammar_done = self.grammar is not None and self.grammar.done()
        length = len(self.output_ids) >= self.max_new_tokens
        if len(self.output_ids) < p.min_tokens:
            # No stop string ends it yet (stop tokens are masked in the logits), nor later
            # one that was already there.
            self.stop_from = len(self.text)
            return
        if not (grammar_done or length or self._stop_at(self.text) is not None):
            return
        # Finishing (or a stop string seen): the text the whole output decodes to, exactly.
        exact = decode(self.output_ids)
        hit = self._stop_at(exact)
        if hit is not None:
            at, stop = hit
            self.text, self.finish_reason, self.matched_stop = exact[:at], "stop", stop
        elif grammar_done:
            # The output is complete: nothing else would match.
            self.text, self.finish_reason = exact, "stop"
        elif length:
            self.text, self.finish_reason = exact, "length"

    def _decode_new(self, decode: TextDecoder) -> None:
        """Append the text of the tokens after read_offset, unless it ends in an unfinished
        character (then they wait for the next token)."""
        ids = self.output_ids
        context = decode(ids[self.prefix_offset : self.read_offset])
        full = decode(ids[self.prefix_offset :])
        if len(full) > len(context) and not full.endswith("\ufffd"):
            self.text += full[len(context) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def _stop_at(self, text: str) -> tuple[int, str] | None:
        """(where, which) of the first stop string in text; only the tail can hold a new
        match, the earlier text was checked before."""
        for stop in self.params.stop:
            at = text.find(stop, max(self.stop_from, self.sent_len - len(stop)))
            if at >= 0:
                return at, stop
        return None

    def take_delta(self) -> str:
        """New text that is safe to stream: never half a character, never a possible stop."""
        end = len(self.text)
        if not self.finished:
            while end > self.sent_len and self.text[end - 1] == "\ufffd":
                end -= 1
            for stop in self.params.stop:
                for k in range(min(len(stop) - 1, end - self.sent_len), 0, -1):
                    if self.text[end - k : end] == stop[:k]:
                        end -= k
                        break
        delta = self.text[self.sent_len : end]
        self.sent_len = max(self.sent_len, end)
        return delta

    def usage(self) -> dict:
        """Its figures as its instruction_finished event carries them (final once it has
        finished)."""
        return {"input_tokens": len(self.prompt_ids),
                "cached_tokens": max(self.prompt_cached_tokens, 0),
                "new_tokens": self.prefill_tokens, "output_tokens": len(self.output_ids),
                "batch_size": self.max_batch, "preempted": self.preemptions + self.retractions,
                "finish_reason": self.finish_reason,
                "error": None if self.error is None else repr(self.error)}

    def output(self) -> GenerateOutput:
        meta = {
            "id": self.rid,
            "prompt_tokens": len(self.prompt_ids),
            "cached_tokens": max(self.prompt_cached_tokens, 0),
            "completion_tokens": len(self.output_ids),
            "finish_reason": self.finish_reason,
            "matched_stop": self.matched_stop,
            "retractions": self.retractions,
            "preemptions": self.preemptions,
            "prefill_tokens": self.prefill_tokens,
            "e2e_latency": time.monotonic() - self.created,
            "ttft": None if self.first_token_at is None else self.first_token_at - self.created,
        }
        want = self.params.logprobs or self.params.top_logprobs
        return GenerateOutput(
            text=self.text,
            token_ids=list(self.output_ids),
            meta=meta,
            logprobs=list(self.logprobs) if want else None,
            top_logprobs=list(self.top_logprobs) if self.params.top_logprobs else None,
            input_logprobs=None if self.logprob_start is None else list(self.input_logprobs),
            tokens=None if self.token_choices is None else list(self.token_choices),
        )
