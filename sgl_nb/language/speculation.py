"""API speculative execution (SGLang's `num_api_spec_tokens`), for programs on a server.

The first gen of a run asks for N tokens with no stop string: the model writes on past the
gen, usually through the program's next text and gens as well. Each later text that the
answer continues with exactly is taken from it, each later gen takes the answer up to its
stop string, and nothing is sent for them; the first mismatch drops what is left, and the
next gen asks again. Only gens with a stop string and no grammar or logprobs speculate.
"""

from __future__ import annotations


def speculable(params: dict) -> bool:
    """Can this gen be read off a speculated answer? (It ends at a stop string.)"""
    return bool(params.get("stop")) and not any(
        params.get(k) for k in ("regex", "json_schema", "logprobs", "top_logprobs"))


def take(speculated: str, stop: list[str]) -> tuple[str, str]:
    """(the gen's value, what is left): the answer up to its first stop string (all of it
    when none occurs); the stop string itself stays, for the text that follows."""
    hits = [i for i in (speculated.find(s) for s in stop) if i >= 0]
    at = min(hits) if hits else len(speculated)
    return speculated[:at], speculated[at:]


def fill(speculated: str, text: str) -> str:
    """What is left once the program's own `text` is appended: the rest if the answer
    went on with exactly that text, else nothing (the speculation is dropped)."""
    return speculated[len(text):] if speculated.startswith(text) else ""
