"""How one request samples and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this a temperature is greedy decoding (SGLang's rule): dividing logits by it would
# overflow fp32 and leave nothing to sample.
GREEDY_BELOW = 1e-6
# OpenAI's documented range of a logit bias: -100 bans a token, +100 forces it.
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW): greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    seed: int | None = None  # same seed, same prompt: same tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # logprob of each chosen token
    top_logprobs: int = 0  # and the k most likely alternatives at each step
    regex: str | None = None  # constrain the output to this regex ...
    json_schema: str | dict | None = None  # ... or to JSON matching this schema
    min_tokens: int = 0  # no EOS, stop token or stop string ends the output before this
    frequency_penalty: float = 0.0  # minus this x how often a token is in the output so far
    presence_penalty: float = 0.0  # minus this once a token is in the output
    repetition_penalty: float = 1.0  # a token of prompt or output: logit / this if > 0, else x
    # {token id: bias} added to those logits before the penalties, the grammar mask and
    # sampling (greedy too); -100 bans a token, +100 forces it unless the grammar rules it out.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Text a regex / json_schema forces is computed in one step, not one step a token
    # (the output is the same either way); None: the engine's setting (on by default).
    jump_forward: bool | None = None
    # Tokens that repeat an earlier n-gram of prompt and output are drafted and checked in
    # one step (runtime/prompt_lookup.py; the output is the same either way); None: the
    # engine's setting.
    prompt_lookup: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def uses_jump_forward(self, engine_default: bool) -> bool:
        return engine_default if self.jump_forward is None else self.jump_forward

    def uses_prompt_lookup(self, engine_default: bool) -> bool:
        return engine_default if self.prompt_lookup is None else self.prompt_lookup

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a logit bias or min_tokens changes the logits before sampling."""
        return bool(self.min_tokens or self.frequency_penalty or self.presence_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            bad(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.regex is not None and self.json_schema is not None:
            bad("give regex or json_schema, not both")
        if self.top_logprobs < 0:
            bad(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens!r}")
        if self.min_tokens and (self.regex is not None or self.json_schema is not None):
            bad("min_tokens cannot lengthen a regex or json_schema output past its end; "
                "give one or the other")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.jump_forward is not None and not isinstance(self.jump_forward, bool):
            bad(f"jump_forward must be True, False or None, got {self.jump_forward!r}")
        if self.prompt_lookup is not None and not isinstance(self.prompt_lookup, bool):
            bad(f"prompt_lookup must be True, False or None, got {self.prompt_lookup!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        """Ids and numbers here; that the ids are in the model's vocabulary is checked by
        the engine (Engine.make_request), which knows it."""
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got "
                                 f"{token!r}")
            if (not isinstance(bias, int | float) or isinstance(bias, bool)
                    or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias[{token}] must be a number from "
                                 f"{-MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}, got {bias!r}")
