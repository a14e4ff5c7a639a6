"""Constrained decoding: a regex or JSON schema compiled by xgrammar into a matcher that
masks, at every step, the tokens that cannot continue a valid output, and that proposes
the text the grammar forces next (jump-forward) as draft tokens."""

from __future__ import annotations

import json
import threading

import torch


class GrammarError(ValueError):
    """An invalid regex or JSON schema (the message names the pattern)."""


# Property names of a free-form JSON object end within this many characters. Measured on
# SmolLM2-135M (5 chat prompts asking for JSON, each greedy and at 3 seeds, max_tokens 128):
# with free names 8 of 20 answers reached the length limit unclosed, 5 of them inside a key
# that never ended (a sentence written as a property name), none on whitespace (that is
# compact: one space after ':' and ','); with names of at most 32 characters 3 of 20, all
# greedy loops of short properties, which no grammar ends (at most 64 characters: 7 of 20).
MAX_KEY_CHARS = 32


def _any_value(names: dict) -> dict:
    return {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"},
                      {"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/value"}},
                      {"type": "object", **names}]}


_NAMES = {"propertyNames": {"maxLength": MAX_KEY_CHARS},
          "additionalProperties": {"$ref": "#/$defs/value"}}
# What a json_object mode asks for (OpenAI's response_format, vLLM's structured_outputs):
# any JSON object, nested as deep as it likes, its property names bounded as above. A
# schema a user gives is compiled as it is: its own maxLength / maxItems / maxProperties
# are what bound its strings and lists. A regex is compiled as written, so what it leaves
# unbounded (`.*`, `[ \n]*`, `[0-9]+`) may run to max_tokens: bound it in the regex
# (`[ ]{0,4}`).
JSON_OBJECT_SCHEMA = {"type": "object", **_NAMES, "$defs": {"value": _any_value(_NAMES)}}


class GrammarCompilerCache:
    """One xgrammar compiler per tokenizer; compiled grammars are cached by pattern."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()

    def matcher(self, regex: str | None, json_schema: str | dict | None) -> Grammar:
        """Compile (in the caller's thread, so errors come before any token is made)."""
        try:
            with self._lock:
                if regex is not None:
                    compiled = self._compiler.compile_regex(regex)
                else:
                    schema = json_schema if isinstance(json_schema, str) else json.dumps(
                        json_schema)
                    # Compact JSON: free whitespace lets a small model loop on newlines
                    # until max_tokens and never close the object.
                    compiled = self._compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as e:
            what = f"regex {regex!r}" if regex is not None else f"JSON schema {json_schema!r}"
            raise GrammarError(f"invalid {what}: {e}") from e
        return Grammar(self._xgr, self._xgr.GrammarMatcher(compiled), self.vocab_size)


class Grammar:
    """The matcher of one request: mask the logits, then accept the token sampled."""

    def __init__(self, xgr, matcher, vocab_size: int):
        self._xgr, self.matcher, self.vocab_size = xgr, matcher, vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.forced = False  # was the last masked step left with a single token?
        self.allowed = -1  # tokens the last mask left (-1: not masked yet)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [vocab] float32 on the CPU; masked in place and returned."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        row = logits[None, :]
        self._xgr.apply_token_bitmask_inplace(row, self._bitmask)
        # One token left: the grammar, not the model, chose it (views colour it so). None
        # left: no token of the vocabulary continues the pattern (the request fails).
        self.allowed = int(torch.isfinite(logits).sum())
        self.forced = self.allowed == 1
        return logits

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"grammar rejected token {token} that its own mask allowed")

    def done(self) -> bool:
        return self.matcher.is_terminated()

    def allowed_prefix(self, ids: list[int]) -> list[int]:
        """The longest prefix of ids the grammar accepts from here (prompt lookup's drafts
        are only proposed where they could be taken); the matcher is left as it was."""
        n = 0
        for t in ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return ids[:n]

    def jump_forward(self, tokenizer, limit: int) -> list[int]:
        """Draft tokens for the string the grammar forces from here (at most `limit`; []
        when the next character is the model's choice). The matcher is not changed.

        The string is tokenized on its own, as the tokenizer would encode it: that is the
        split the model was trained on, and so the one it most likely picks token by token.
        The drafts are only proposals: the engine keeps the ones the model's own logits
        choose (runtime/engine.py, _take_drafted), so no other split is ever forced on it.
        """
        if limit <= 0:
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        # A special token's text ("<|im_end|>" in a regex) is the grammar's characters,
        # which the mask never lets the special token itself spell.
        ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        ids = ids[:limit]
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), len(ids))
        return ids[:bad]  # an id past the model's vocabulary would fail the whole step
