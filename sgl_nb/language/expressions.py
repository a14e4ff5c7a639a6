"""What a program adds to its state: `s += "text"`, `s += sgl.gen(...)`, `sgl.select(...)`,
`sgl.user(...)`. Plain records; the state's executor gives them meaning."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from sgl_nb.language.reasoning import check_model_type

# SGLang's frontend's patterns. A number may end in spaces or newlines: with the stop
# strings below, the first one ends it (a pattern without them leaves the model no way out
# but more digits).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""  # a quoted string

DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL, str: REGEX_STR}
# A dtype=int / float gen also stops at a space or a newline (as SGLang's runtime adds).
DTYPE_STOPS = {int: [" ", "\n"], float: [" ", "\n"]}

# select's scoring methods; `choices_method=sgl.greedy_token_selection` names one, as in SGLang.
token_length_normalized = "token_length_normalized"
greedy_token_selection = "greedy_token_selection"
unconditional_likelihood_normalized = "unconditional_likelihood_normalized"
SELECT_METHODS = (
    token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized,
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


# SGLang's names for sampling arguments (gen() and run() take them) -> SamplingParams'.
SAMPLING_ARGS = {
    "max_tokens": "max_tokens", "max_new_tokens": "max_tokens", "min_tokens": "min_tokens",
    "stop": "stop", "stop_token_ids": "stop_token_ids", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "ignore_eos": "ignore_eos", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "return_logprob": "logprobs",
    "top_logprobs_num": "top_logprobs",
    # Ours: False computes grammar-forced text one decode step a token (same output).
    "jump_forward": "jump_forward",
    # Ours: False drafts no tokens from earlier n-grams (runtime/prompt_lookup.py).
    "prompt_lookup": "prompt_lookup",
}
# Not sampling: how a gen's meta info shows logprobs (run() may set them for every gen).
LOGPROB_ARGS = ("return_text_in_logprobs", "logprob_start_len")
# SGLang's arguments the in-kernel engine cannot honour; gen() and run() refuse a value
# that asks for them (None, 1 and an empty stop_regex are SGLang's "off").
UNSUPPORTED_ARGS = ("n", "stop_regex")
# dtype= as SGLang also spells it, by name.
DTYPE_NAMES = {"int": int, "float": float, "str": str, "bool": bool}


def refuse_unsupported(args: dict) -> None:
    """A clear error for `n > 1` and `stop_regex`, named, before anything runs."""
    n = args.get("n")
    if n not in (None, 1):
        raise ValueError(f"gen(n={n}) is not supported: fork the state (`s.fork({n})`) "
                         "and gen in each branch")
    if args.get("stop_regex") not in (None, "", [], ()):
        raise ValueError("stop_regex is not supported by sgl-nb's engine: stop on strings "
                         "(stop=) or constrain the whole output (regex=)")


def sampling_args(args: dict) -> dict:
    """SGLang-named sampling arguments as SamplingParams fields; None means "not given"."""
    out: dict = {}
    given: dict = {}  # field -> the argument that set it
    for key, value in args.items():
        if value is None:
            continue
        field_name = SAMPLING_ARGS[key]
        if field_name in out and out[field_name] != value:
            raise ValueError(f"give {given[field_name]} or {key}, not both")
        given[field_name] = key
        if field_name in ("stop", "stop_token_ids"):
            value = [value] if isinstance(value, str | int) else list(value)
        out[field_name] = value
    return out


@dataclass
class Gen(Concatenable):
    name: str | None
    params: dict = field(default_factory=dict)  # SamplingParams fields this gen sets
    regex: str | None = None
    json_schema: str | dict | None = None
    dtype: type | None = None
    logprob_args: dict = field(default_factory=dict)  # LOGPROB_ARGS this gen sets
    reasoning: str | None = None  # separate_reasoning's model type: split thinking off

    def sampling(self, defaults: dict) -> dict:
        """Sampling parameters for the engine: this gen's own, else the run's defaults."""
        out = {k: v for k, v in defaults.items() if v is not None and k not in LOGPROB_ARGS}
        out.update(self.params)
        out.setdefault("max_tokens", 128)
        regex = self.regex if self.regex is not None else DTYPE_REGEX.get(self.dtype)
        if regex is not None:
            out["regex"] = regex
        if self.dtype in DTYPE_STOPS:
            stop = out.get("stop") or []
            stop = [stop] if isinstance(stop, str) else list(stop)
            out["stop"] = stop + [x for x in DTYPE_STOPS[self.dtype] if x not in stop]
        elif self.json_schema is not None:
            out["json_schema"] = self.json_schema
        return out

    def logprob_options(self, defaults: dict) -> dict:
        return {k: self.logprob_args.get(k, defaults.get(k)) for k in LOGPROB_ARGS}

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
    # `gen(choices=..., regex=... / dtype=...)`: the gen's grammar rules out the choices it
    # does not spell; they are never scored.
    regex: str | None = None
    dtype: type | None = None

    def allowed(self) -> list[int]:
        """The indices of the choices the grammar admits (all, with none): a choice must
        match the whole regex, or spell a value of dtype as gen's dtype= grammar does."""
        # dtype=str: every choice is a string already (its regex is for a quoted one).
        rule = self.regex if self.regex is not None else \
            DTYPE_REGEX.get(self.dtype) if self.dtype is not str else None
        if rule is None:
            return list(range(len(self.choices)))
        try:
            pattern = re.compile(rule)
        except re.error as e:
            raise ValueError(f"gen {self.name!r}: invalid regex {rule!r}: {e}") from None
        return [i for i, c in enumerate(self.choices) if pattern.fullmatch(c)]


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
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | None = None,
    choices: list[str] | None = None,
    choices_method: str | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    max_new_tokens: int | None = None,
    seed: int | None = None,
    jump_forward: bool | None = None,
    prompt_lookup: bool | None = None,
    stop_regex: str | list[str] | None = None,
) -> Gen | Select:
    """Generate text into variable `name` (SGLang's arguments; the run's where None).
    With `choices`, this is `select` (its temperature must be 0, as in SGLang)."""
    dtype = DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in (None, int, float, str, bool):
        raise ValueError(f"dtype must be int, float, str or bool, got {dtype!r}")
    if choices is not None:
        sel = select(name, choices, temperature=temperature or 0.0,
                     choices_method=choices_method)
        if json_schema is not None:
            raise ValueError("gen(choices=...) takes regex= or dtype= to rule choices out, "
                             "not json_schema=")
        sel.regex, sel.dtype = regex, dtype
        if not sel.allowed():
            rule = f"regex {regex!r}" if regex is not None else f"dtype {dtype.__name__}"
            raise ValueError(f"gen {name!r}: no choice of {choices!r} matches its {rule}")
        return sel
    refuse_unsupported({"n": n, "stop_regex": stop_regex})
    params = sampling_args({
        "max_tokens": max_tokens, "max_new_tokens": max_new_tokens, "min_tokens": min_tokens,
        "stop": stop, "stop_token_ids": stop_token_ids, "temperature": temperature,
        "top_p": top_p, "top_k": top_k, "min_p": min_p, "seed": seed, "ignore_eos": ignore_eos,
        "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
        "return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
        "jump_forward": jump_forward, "prompt_lookup": prompt_lookup})
    logprob_args = {k: v for k, v in (("return_text_in_logprobs", return_text_in_logprobs),
                                      ("logprob_start_len", logprob_start_len)) if v is not None}
    return Gen(name, params, regex, json_schema, dtype, logprob_args)


def gen_int(name: str | None = None, **kwargs) -> Gen:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs) -> Gen:
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: str | None = None,
) -> Select:
    """Pick one of `choices` by the model's likelihood of each after the text so far.
    `temperature` is SGLang's argument: a pick by score is greedy, so only 0 is taken."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select choices must be non-empty strings, got {choices!r}")
    if choices_method is None:
        choices_method = token_length_normalized
    if not isinstance(choices_method, str):
        raise TypeError(f"choices_method must name one of sgl-nb's methods {SELECT_METHODS} "
                        f"(sgl.token_length_normalized, ...); a custom "
                        f"{type(choices_method).__name__} is not supported")
    if choices_method not in SELECT_METHODS:
        raise ValueError(f"choices_method must be one of {SELECT_METHODS}, got {choices_method!r}")
    if not isinstance(temperature, int | float) or not 0 <= temperature <= 1e-5:
        raise ValueError(f"select picks the best-scoring choice: temperature must be 0, got "
                         f"{temperature!r} (SGLang's runtime refuses it too)")
    return Select(name, list(choices), choices_method)


def _role(role: str, content) -> RoleBlock:
    """A whole turn; with no content, an empty one (as SGLang's frontend makes it)."""
    if content is None:
        content = []
    return RoleBlock(role, content if isinstance(content, list) else [content])


def system(content=None) -> RoleBlock:
    return _role("system", content)


def user(content=None) -> RoleBlock:
    return _role("user", content)


def assistant(content=None) -> RoleBlock:
    return _role("assistant", content)


# A turn in pieces: `s += sgl.user_begin()`, ..., `s += sgl.user_end()`.
def system_begin() -> Role:
    return Role("system", True)


def system_end() -> Role:
    return Role("system", False)


def user_begin() -> Role:
    return Role("user", True)


def user_end() -> Role:
    return Role("user", False)


def assistant_begin() -> Role:
    return Role("assistant", True)


def assistant_end() -> Role:
    return Role("assistant", False)


def separate_reasoning(expr: Gen, model_type: str | None = None) -> Gen:
    """A named gen whose thinking (`<think>...</think>` by default) goes to variable
    `<name>_reasoning_content` and the rest to `<name>`."""
    if not isinstance(expr, Gen) or expr.name is None:
        raise TypeError(f"separate_reasoning takes a named sgl.gen(...), got {expr!r}")
    return replace(expr, reasoning=check_model_type(model_type))


def image(*_args, **_kwargs):
    raise NotImplementedError("sgl.image: sgl-nb runs text-only models (the Llama and Qwen2 "
                              "families); a program cannot add an image")


def video(*_args, **_kwargs):
    raise NotImplementedError("sgl.video: sgl-nb runs text-only models (the Llama and Qwen2 "
                              "families); a program cannot add a video")
