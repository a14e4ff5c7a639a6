"""Token ids to text as a request's output takes it: tokenizer.decode(ids,
skip_special_tokens=True), called twice per generated token (runtime/request.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from transformers import PreTrainedTokenizerFast

TextDecoder = Callable[[list[int]], str]


def text_decoder(tokenizer) -> TextDecoder:
    """tokenizer.decode(ids, skip_special_tokens=True); through the Rust tokenizer directly
    where transformers' wrapper adds nothing to it (a fast tokenizer whose decode is not
    overridden and that does not clean up spaces): 3 us a call against 11 through the
    wrapper (the default model's, measured), which converts the ids and reads its settings
    on every call."""
    cls = type(tokenizer)
    plain = (isinstance(tokenizer, PreTrainedTokenizerFast)
             and cls.decode is PreTrainedTokenizerFast.decode
             and cls._decode is PreTrainedTokenizerFast._decode
             and not tokenizer.clean_up_tokenization_spaces)
    decode = tokenizer.backend_tokenizer.decode if plain else tokenizer.decode
    return partial(decode, skip_special_tokens=True)
