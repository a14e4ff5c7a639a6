"""What every request model shares: unknown fields are refused by name (a typo is an error,
not a silently ignored setting), types are strict (a string is not a number), numbers are
finite and bounded, and every string is valid Unicode."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    model_validator,
)

from sgl_nb.server.refusals import BadRequest

# The validation context key of the server's PromptLimits (request_body.parse passes them).
LIMITS_CONTEXT = "prompt_limits"
INT32 = 2**31 - 1
INT64 = 2**63 - 1
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs)

_names: set[str] = set()


def model_names() -> set[str]:
    """The request models' class names (pydantic puts them in a union error's location)."""
    return _names


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _names.add(cls.__name__)


class TopLevel(Strict):
    """A request body: its prompts' sizes checked first (a list of token ids longer than the
    context is refused before anything walks its items), then every string for lone
    surrogates, so nothing downstream (the tokenizer, the JSON answer) meets a string it
    cannot encode."""

    @model_validator(mode="before")
    @classmethod
    def _sizes_then_unicode(cls, data: Any, info: ValidationInfo) -> Any:
        limits = (info.context or {}).get(LIMITS_CONTEXT)
        if limits is not None and isinstance(data, dict):
            cls.check_sizes(data, limits)
        _check_text(data, "")
        return data

    @classmethod
    def check_sizes(cls, data: dict, limits) -> None:
        """The raw body's prompt sizes against `limits` (a PromptLimits); by default none."""


def _check_text(value: Any, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path or 'a string'} is not valid Unicode (a lone "
                             "surrogate escape)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, f"a field name in {path or 'the body'}")
            _check_text(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{path}[{i}]")


def _temperature(t: float) -> float:
    # Dividing fp32 logits by a tiny temperature overflows to inf, and the softmax to NaN.
    if 0 < t < 1e-6:
        raise ValueError("must be 0 (greedy) or at least 1e-6")
    return t


Temperature = Annotated[float, Field(ge=0.0), AfterValidator(_temperature)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1, le=INT32)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# Beyond these an fp32 logit divided or multiplied by it overflows.
RepetitionPenalty = Annotated[float, Field(ge=1e-3, le=1e3)]
Seed = Annotated[int, Field(ge=-INT64 - 1, le=INT64)]
Count = Annotated[int, Field(ge=0, le=INT32)]
PositiveCount = Annotated[int, Field(ge=1, le=INT32)]
TokenId = Annotated[int, Field(ge=0, le=INT32)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Stop = str | list[str]
JsonSchema = dict[str, Any] | str


def _token_id_keys(bias: Any) -> Any:
    """OpenAI's logit_bias keys are token ids written as strings (JSON keys are strings)."""
    if not isinstance(bias, dict):
        return bias  # the type check below names it
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()) or int(key) > INT32:
            raise ValueError(f"keys must be token ids (integers >= 0 as strings), got {key!r}")
        out[int(key)] = value
    return out


# {"token id": bias}: -100 bans the token, +100 forces it (OpenAI's documented range).
LogitBias = Annotated[dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]],
                      BeforeValidator(_token_id_keys)]


def refuse_unsupported(checks: dict[str, bool]) -> None:
    """{what: asked}: the first feature asked for that this server does not offer."""
    for what, asked in checks.items():
        if asked:
            raise BadRequest(f"{what} is not supported by sgl-nb serve")
