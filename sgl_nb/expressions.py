"""What a program adds to its state: `s += "text"`, `s += sgl.gen(...)`, `sgl.select(...)`,
`sgl.user(...)`. Plain records; the state's executor gives them meaning."""

from __future__ import annotations

from dataclasses import dataclass, field

REGEX_INT = r"-?\d+"
REGEX_FLOAT = r"-?\d+(\.\d+)?([eE][-+]?\d+)?"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""  # a quoted string, as SGLang's frontend defines it

DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL, str: REGEX_STR}

SELECT_METHODS = (
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
)


class Concatenable:
    """`"Q: " + sgl.gen("a") + "\n"`: adding expressions (or text) makes one Concat, which
    the state adds part by part, as SGLang's frontend does."""

    def __add__(self, other) -> Concat:
        return Concat([*_parts(self), *_parts(other)])

    def __radd__(self, other) -> Concat:
        return Concat([*_parts(other), *_parts(self)])


@dataclass
class Concat(Concatenable):
    parts: list


def _parts(x) -> list:
    if isinstance(x, Concat):
        return list(x.parts)
    if not isinstance(x, str | Concatenable):
        raise TypeError(f"cannot add {type(x).__name__} to a program expression: {x!r}")
    return [x]


@dataclass
class Gen(Concatenable):
    name: str | None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    regex: str | None = None
    json_schema: str | dict | None = None
    dtype: type | None = None

    def sampling(self, defaults: dict) -> dict:
        """Sampling parameters for the engine: this gen's own, else the run's defaults."""
        out = {k: v for k, v in defaults.items() if v is not None}
        for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["ignore_eos"] = self.ignore_eos
        out.setdefault("max_tokens", 128)
        regex = self.regex if self.regex is not None else DTYPE_REGEX.get(self.dtype)
        if regex is not None:
            out["regex"] = regex
        elif self.json_schema is not None:
            out["json_schema"] = self.json_schema
        return out

    def convert(self, text: str):
        """The variable's value: the text, or the number / bool it spells for dtype=."""
        if self.dtype in (int, float):
            return self.dtype(text)
        if self.dtype is bool:
            return text == "True"
        return text


@dataclass
class Select(Concatenable):
    name: str | None
    choices: list[str]
    method: str = "token_length_normalized"


@dataclass
class Role(Concatenable):
    role: str  # system | user | assistant
    begin: bool  # a RoleBegin marker, or a RoleEnd marker


@dataclass
class RoleBlock(Concatenable):
    """`sgl.user("text")`: a whole role turn (begin, content, end) as one expression."""

    role: str
    content: list = field(default_factory=list)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    ignore_eos: bool = False,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    dtype: type | None = None,
    choices: list[str] | None = None,
    max_new_tokens: int | None = None,
    choices_method: str = "token_length_normalized",
) -> Gen | Select:
    """Generate text into variable `name`. With `choices`, this is `select`."""
    if choices is not None:
        return select(name, choices, choices_method=choices_method)
    if max_tokens is not None and max_new_tokens is not None and max_tokens != max_new_tokens:
        raise ValueError("give max_tokens or max_new_tokens, not both")
    if dtype not in (None, int, float, str, bool):
        raise ValueError(f"dtype must be int, float, str or bool, got {dtype!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return Gen(
        name, max_tokens if max_tokens is not None else max_new_tokens, stops,
        list(stop_token_ids or []), temperature, top_p, top_k, min_p, seed, ignore_eos, regex,
        json_schema, dtype,
    )


def gen_int(name: str | None = None, **kwargs) -> Gen:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs) -> Gen:
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    choices_method: str = "token_length_normalized",
) -> Select:
    """Pick one of `choices` by the model's likelihood of each after the text so far."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select choices must be non-empty strings, got {choices!r}")
    if choices_method not in SELECT_METHODS:
        raise ValueError(f"choices_method must be one of {SELECT_METHODS}, got {choices_method!r}")
    return Select(name, list(choices), choices_method)


def _role(role: str, content) -> RoleBlock:
    if content is None:
        raise ValueError(f"sgl.{role}(...) takes the turn's content; for a block use "
                         f"`with s.{role}():`")
    return RoleBlock(role, content if isinstance(content, list) else [content])


def system(content=None) -> RoleBlock:
    return _role("system", content)


def user(content=None) -> RoleBlock:
    return _role("user", content)


def assistant(content=None) -> RoleBlock:
    return _role("assistant", content)
