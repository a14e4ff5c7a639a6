"""Token counts a backend has used (SGLang's `backend.token_usage`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenUsage:
    prompt_tokens: int = 0  # every request's prompt, cached or not (what an API bills)
    completion_tokens: int = 0

    def add(self, prompt: int | None, completion: int | None) -> None:
        self.prompt_tokens += prompt or 0
        self.completion_tokens += completion or 0

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = 0
