"""Why this token: what the model offered at one step of a request and what it took.

The engine records one TokenChoice per generated token (EngineConfig.token_alternatives
sets k; 0 records none). Plain data: it travels on the Request, the GenerateOutput, the
token events and (at tracing level "token") the trace files.

Both `TokenChoice.logprob` and every `Alternative.logprob` are on one distribution: the
log-softmax of the model's logits after the request's logit bias and repetition /
frequency / presence penalties (and min_tokens' held-back stop tokens), before temperature
and before the grammar mask: a token the bias forced or banned shows as such. The token
event's own "logprob" (and GenerateOutput.logprobs) is taken after the grammar mask, so
under a regex it is the higher of the two: the mask moves the probability of the tokens it
rules out onto those it leaves. Without a grammar they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Alternative:
    """One of the k most likely tokens of the step's distribution."""

    token: int
    text: str
    logprob: float
    masked: bool  # the grammar ruled it out at that step

    def to_json(self) -> list:
        """[id, text, logprob, masked]: the form of a token event's "top" entries."""
        return [self.token, self.text, self.logprob, self.masked]

    @classmethod
    def from_json(cls, item) -> Alternative:
        """From to_json's list (or a dict of the same names)."""
        if isinstance(item, dict):
            return cls(int(item.get("token", -1)), item.get("text") or "",
                       float(item.get("logprob", float("-inf"))), bool(item.get("masked")))
        token, text, logprob, *rest = item
        return cls(int(token), text or "", float(logprob), bool(rest[0]) if rest else False)


@dataclass
class TokenChoice:
    """The token a request took at one step, and the alternatives it had."""

    token: int
    text: str
    logprob: float | None  # same distribution as `top` (see the module docstring)
    # The grammar left only this token, or it is a jump-forward draft the model agreed with.
    forced: bool = False
    allowed: int = -1  # tokens the grammar left at this step; -1: no grammar
    top: list[Alternative] = field(default_factory=list)  # most likely first

    @property
    def rank(self) -> int | None:
        """The chosen token's place among `top` (0: the most likely), None if not in it."""
        return next((i for i, a in enumerate(self.top) if a.token == self.token), None)

    def to_json(self) -> dict:
        return {"token": self.token, "text": self.text, "logprob": self.logprob,
                "forced": self.forced, "allowed": self.allowed,
                "top": [a.to_json() for a in self.top]}

    @classmethod
    def from_json(cls, d: dict) -> TokenChoice:
        """Tolerant of missing keys: a trace written before `top` / `allowed` existed
        gives an empty top and allowed -1."""
        logprob = d.get("logprob")
        return cls(int(d.get("token", -1)), d.get("text") or "",
                   None if logprob is None else float(logprob), bool(d.get("forced", False)),
                   int(d.get("allowed", -1)),
                   [Alternative.from_json(a) for a in d.get("top") or []])
