"""`sgl.separate_reasoning(sgl.gen("a"), model_type=...)`: a reasoning model's thinking
split from its answer. The gen's variable holds the answer, `<name>_reasoning_content` the
thinking; the program's text keeps both, as the model wrote them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkTags:
    begin: str
    end: str
    # The model starts thinking without writing `begin` (its chat template already did).
    starts_inside: bool = False


MODEL_TYPES = {
    "deepseek-r1": ThinkTags("<think>", "</think>", starts_inside=True),
    "deepseek-v3": ThinkTags("<think>", "</think>"),
    "qwen3": ThinkTags("<think>", "</think>"),
    "qwen3-thinking": ThinkTags("<think>", "</think>", starts_inside=True),
    "glm45": ThinkTags("<think>", "</think>"),
    "kimi": ThinkTags("◁think▷", "◁/think▷"),
}
DEFAULT_MODEL_TYPE = "qwen3"  # plain <think> ... </think>


def check_model_type(model_type: str | None) -> str:
    name = model_type or DEFAULT_MODEL_TYPE
    if name not in MODEL_TYPES:
        raise ValueError(f"separate_reasoning: unknown model_type {model_type!r}; known: "
                         f"{sorted(MODEL_TYPES)}")
    return name


def split_reasoning(text: str, model_type: str) -> tuple[str, str]:
    """(reasoning, answer). Thinking cut off before its end tag is all reasoning."""
    tags = MODEL_TYPES[model_type]
    body = text.lstrip()
    if body.startswith(tags.begin):
        body = body[len(tags.begin):]
    elif not tags.starts_inside:
        return "", text
    reasoning, sep, answer = body.partition(tags.end)
    if not sep:
        return reasoning.strip(), ""
    return reasoning.strip(), answer.lstrip()
