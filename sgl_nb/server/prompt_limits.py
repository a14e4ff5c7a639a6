"""What a prompt may be, checked as early and as cheaply as possible: a list of token ids by
its length before anything reads its items, a text by its size in bytes before the tokenizer
sees it, and `prompt + max_tokens` against the context once the prompt's tokens are known.

A text can be refused unread because a BPE token stands for a bounded number of bytes: a
byte-level token for as many bytes as its vocabulary entry has characters, any other for at
most its entry's UTF-8 bytes (SentencePiece's "▁" is 3 bytes for a 1-byte space, a byte
fallback "<0x41>" 6 for 1, an unknown character one "<unk>" unless unknowns are fused). So a
text of more than `context * longest token` bytes has more tokens than the context holds, as
long as the normalizer only grows the text (none, Prepend, Replace of a string by a longer
one) or shrinks it by a bounded factor (the Unicode forms and lowercasing: 4 bytes can become
1, 𝐀 -> A). Where a token can stand for any length (WordPiece's or a Unigram model's unknown
word, fused unknowns) or the normalizer may remove text, there is no bound and the text is
tokenized whole."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from sgl_nb.server.refusals import BadRequest

# Normalizers that map a character to its composed, compatibility or lower-case form.
_SHRINK_AT_MOST_4 = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}


@dataclass(frozen=True)
class PromptLimits:
    context_len: int  # prompt + new tokens: the model's context, or the KV pool's if smaller
    model_context: int  # the model's own (max_position_embeddings)
    bytes_per_token: int | None  # the most bytes of text one token stands for (None: unbounded)
    clip_max_tokens: bool = False  # lower a max_tokens past the context instead of a 400

    @classmethod
    def of(cls, runtime, clip_max_tokens: bool = False) -> PromptLimits:
        engine = runtime.engine
        return cls(engine.context_len, engine.config.max_position_embeddings,
                   text_bytes_per_token(runtime.tokenizer), clip_max_tokens)

    @property
    def max_text_bytes(self) -> int | None:
        """A longer text cannot fit the context (None: no such bound)."""
        return None if self.bytes_per_token is None else self.context_len * self.bytes_per_token

    def _context(self) -> str:
        if self.context_len < self.model_context:
            return (f"{self.context_len} tokens (the KV pool's capacity; the model's own is "
                    f"{self.model_context})")
        return f"{self.context_len} tokens"

    def check_id_count(self, n: int, what: str = "prompt") -> None:
        """A list of token ids by its length alone (its items are not looked at)."""
        if n >= self.context_len:
            raise BadRequest(f"{what} is {n} tokens, longer than the model's context of "
                             f"{self._context()} (leave room for at least one new token)")

    def check_id_lists(self, value: Any, what: str) -> None:
        """`value` as the request sent it: token ids or a list of such lists, checked by
        length (anything else is left to the request's own validation)."""
        if not isinstance(value, list) or not value:
            return
        if isinstance(value[0], list):
            for i, ids in enumerate(value):
                if isinstance(ids, list):
                    self.check_id_count(len(ids), f"{what}[{i}]")
        elif not isinstance(value[0], str):
            self.check_id_count(len(value), what)

    def check_text(self, text: str, what: str = "the prompt") -> None:
        """Refuse a text that has more tokens than the context, without tokenizing it."""
        bound = self.max_text_bytes
        if bound is None or 4 * len(text) <= bound:  # fewer bytes even at 4 a character
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > bound:
            raise BadRequest(
                f"{what} is {size} bytes of text, more than the model's context of "
                f"{self._context()} holds: a token stands for at most {self.bytes_per_token} "
                f"bytes, so it has at least {math.ceil(size / self.bytes_per_token)} tokens "
                "(refused without tokenizing it)")

    def encode(self, tokenizer, text: str, add_special_tokens: bool = True,
               what: str = "the prompt") -> list[int]:
        self.check_text(text, what)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def max_tokens(self, prompt_len: int, asked: int, field: str | None) -> int:
        """The new tokens a prompt of `prompt_len` tokens gets. `field`: the request field
        that set `asked` (None: a default, lowered to what fits). One the client set that
        passes the context is a 400 naming both numbers (vLLM's rule), or lowered to fit
        with clip_max_tokens. A prompt that leaves no room is the engine's to refuse."""
        room = self.context_len - prompt_len
        if prompt_len + asked <= self.context_len or room < 1:
            return asked
        if field is None or self.clip_max_tokens:
            return room
        raise BadRequest(
            f"{field} is too large: {asked}. The model's context is {self._context()} and "
            f"the prompt has {prompt_len} tokens ({asked} > {self.context_len} - "
            f"{prompt_len}); lower {field} to at most {room}")


def text_bytes_per_token(tokenizer) -> int | None:
    """The most bytes of a text one token of `tokenizer` stands for, the normalizer's
    shrinking included (None: unbounded, or not a fast tokenizer whose files say)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in {s.get("type") for s in _steps(spec.get("pre_tokenizer"))}
    if shrink is None or model.get("type") != "BPE" or (
            model.get("fuse_unk") and not model.get("byte_fallback")):
        return None
    # Byte-level entries spell one byte a character (U+0100.. for the unprintable ones).
    base = max((len(k) if byte_level else len(k.encode("utf-8"))
                for k in backend.get_vocab(with_added_tokens=False)), default=1)
    added = max((len(t.content.encode("utf-8"))
                 for t in tokenizer.added_tokens_decoder.values()), default=1)
    return max(base, added) * shrink


def _normalizer_shrink(spec: dict | None) -> int | None:
    """How many times fewer UTF-8 bytes the normalizer may leave of a text: 1 when it only
    grows it, None when it may remove text."""
    factor = 1
    for step in _steps(spec):
        kind = step.get("type")
        if kind in _SHRINK_AT_MOST_4:
            factor = 4
        elif not (kind == "Prepend" or (kind == "Replace" and _grows(step))):
            return None
    return factor


def _grows(replace: dict) -> bool:
    """A Replace of a literal string by one at least as long (a regex may match more)."""
    pattern = (replace.get("pattern") or {}).get("String")
    return pattern is not None and len(replace.get("content", "").encode()) >= len(
        pattern.encode())


def _steps(spec: dict | None) -> list[dict]:
    """A normalizer or pre-tokenizer spec as its list of steps (a Sequence's, flattened)."""
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        inner = spec.get("normalizers") or spec.get("pretokenizers") or []
        return [s for one in inner for s in _steps(one)]
    return [spec]
