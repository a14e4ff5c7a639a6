"""Role prefixes and suffixes read off the model tokenizer's own chat template."""

from __future__ import annotations

from dataclasses import dataclass

_MARK = "\x00CONTENT\x00"


@dataclass
class ChatRoles:
    prefix: dict[str, str]  # role -> text before its content
    suffix: dict[str, str]  # role -> text after its content
    default_system: str  # what the template puts first when no system turn is given


def derive_chat_roles(tokenizer) -> ChatRoles:
    """Render the template around a marker and cut: what comes before and after the marker
    is the role's prefix and suffix. Templates without one fall back to plain labels."""
    if not getattr(tokenizer, "chat_template", None):
        plain = {r: f"{r.upper()}: " for r in ("system", "user", "assistant")}
        return ChatRoles(plain, {r: "\n" for r in plain}, "")

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False)

    sys_only = render([{"role": "system", "content": "S"}])
    prefix, suffix = {}, {}
    history = [{"role": "system", "content": "S"}]
    for role in ("system", "user", "assistant"):
        base = "" if role == "system" else render(history)
        msgs = [{"role": role, "content": _MARK}] if role == "system" else [
            *history, {"role": role, "content": _MARK}]
        full = render(msgs)
        assert full.startswith(base), "chat template is not append-only"
        before, after = full[len(base):].split(_MARK)
        prefix[role], suffix[role] = before, after
        if role != "system":
            history = [*history, {"role": role, "content": "U"}]
    user_alone = render([{"role": "user", "content": _MARK}])
    default_system = user_alone.split(_MARK)[0][: -len(prefix["user"]) or None]
    assert sys_only.startswith(prefix["system"])
    return ChatRoles(prefix, suffix, default_system)
