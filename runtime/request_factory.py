"""New requests, checked against the model and the KV pool before they reach the engine
thread: bad input fails in the caller's thread with a ValueError naming the problem."""

from __future__ import annotations

import threading
import warnings

from sgl_nb.runtime.engine_config import EngineConfig
from sgl_nb.runtime.grammar import GrammarCompilerCache
from sgl_nb.runtime.model.model_config import ModelConfig
from sgl_nb.runtime.request import Request
from sgl_nb.runtime.sampling_params import SamplingParams


def capped_context_len(model_context: int, pool_tokens: int) -> int:
    """The longest request (prompt + new tokens) the engine takes: the model's context, or
    the KV pool's capacity where that is smaller (a request must fit the pool), said once."""
    if model_context <= pool_tokens:
        return model_context
    warnings.warn(
        f"the model's context ({model_context} tokens, max_position_embeddings) is longer "
        f"than the KV pool ({pool_tokens} tokens): requests are capped at {pool_tokens} "
        "tokens; raise kv_pool_tokens for longer ones", stacklevel=5,  # the Runtime(...) call
    )
    return pool_tokens


class RequestFactory:
    def __init__(self, config: ModelConfig, tokenizer, eos_ids: tuple[int, ...],
                 pool_capacity: int, settings: EngineConfig):
        self.config, self.tokenizer, self.eos_ids = config, tokenizer, eos_ids
        self.pool_capacity = pool_capacity
        self.context_len = capped_context_len(config.max_position_embeddings, pool_capacity)
        self.settings = settings  # read at each request: the engine may swap it (Engine.settings)
        self._grammars: GrammarCompilerCache | None = None
        self._grammar_lock = threading.Lock()

    def make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Check a request against the model and the pool; raises ValueError naming the problem."""
        n = len(prompt_ids)
        vocab = self.config.vocab_size
        if n == 0:
            raise ValueError("empty prompt: give at least one token")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if n >= self.context_len:
            raise ValueError(
                f"prompt is {n} tokens, longer than the model's context of {self.context_len} "
                f"tokens (leave room for at least one new token){self._pool_cap_note()}"
            )
        if params.top_logprobs > vocab:
            raise ValueError(f"top_logprobs must be at most the vocabulary size "
                             f"({vocab}), got {params.top_logprobs}")
        outside = sorted(t for t in params.logit_bias if t >= vocab)
        if outside:
            raise ValueError(f"logit_bias: token ids {outside[:5]} are outside the model's "
                             f"vocabulary [0, {vocab})")
        # Trimmed to the model's own context; past the pool's it is an error saying so.
        max_new = min(params.max_tokens, self.config.max_position_embeddings - n)
        if n + max_new > self.pool_capacity:
            raise ValueError(
                f"request can never fit the KV pool: prompt {n} + max_tokens {max_new} tokens "
                f"> pool capacity {self.pool_capacity} tokens; lower max_tokens or raise "
                "kv_pool_tokens"
            )
        stops = {*params.stop_token_ids, *(() if params.ignore_eos else self.eos_ids)}
        req = Request(list(prompt_ids), params, max_new, stop_tokens=frozenset(stops))
        if self.settings.token_alternatives:
            req.token_choices = []
        if params.regex is not None or params.json_schema is not None:
            req.grammar = self.grammars().matcher(params.regex, params.json_schema)
        return req

    def make_score_request(self, ids: list[int], start: int) -> Request:
        """A request that returns the logprob of ids[start:] (each given what precedes it)."""
        if not 1 <= start < len(ids):
            raise ValueError(f"scored tokens must start in [1, {len(ids)}), got {start}")
        req = self.make_request(ids, SamplingParams(max_tokens=1))
        req.logprob_start = start
        return req

    def grammars(self) -> GrammarCompilerCache:
        """Built on first use: reading the vocabulary into xgrammar takes a moment."""
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompilerCache(
                    self.tokenizer, self.config.vocab_size, list(self.eos_ids)
                )
            return self._grammars

    def _pool_cap_note(self) -> str:
        if self.context_len >= self.config.max_position_embeddings:
            return ""
        return (f": it can never fit the KV pool of {self.pool_capacity} tokens, which caps "
                "the context; raise kv_pool_tokens")
