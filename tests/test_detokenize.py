"""A request's text as its tokens arrive one by one (runtime/request.py decodes only the new
tokens with a little context), with the default model's real tokenizer: at every step the
text streamed so far is a prefix of the whole output's decode, and at the end it is that
decode exactly."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sgl_nb.runtime.request import Request
from sgl_nb.runtime.sampler import Sampled
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.runtime.text_decoder import text_decoder

TEXTS = [
    " The lighthouse keeper said: \"Don't go\" -- then left, at 3:45 a.m. on Friday.",
    "Caf\u00e9 na\u00efve \u2014 \u65e5\u672c\u8a9e\u306e\u6587 \U0001f600\U0001f30a and \u00fcber-"
    "\u0441\u043b\u043e\u0432\u043e!",
    "code:\n    def f(x):\n        return x ** 2\n\n\tindented\ttabs  two  spaces",
]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(str(model_path))


def feed(tokenizer, ids: list[int], **params) -> tuple[Request, list[str]]:
    req = Request(prompt_ids=[1], params=SamplingParams(ignore_eos=True, **params),
                  max_new_tokens=len(ids))
    deltas = []
    decode = text_decoder(tokenizer)
    for t in ids:
        req.append(Sampled(t), decode)
        deltas.append(req.take_delta())
        whole = tokenizer.decode(req.output_ids, skip_special_tokens=True)
        assert whole.startswith("".join(deltas))
        if req.finished:
            break
    return req, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    req, deltas = feed(tokenizer, ids)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert req.finish_reason == "length"
    assert req.text == whole and "".join(deltas) == whole


def test_a_stop_string_cuts_the_text_where_it_starts(tokenizer):
    text = TEXTS[1] + " the end STOP and more after it"
    ids = tokenizer.encode(text, add_special_tokens=False)
    req, deltas = feed(tokenizer, ids, stop=[" STOP"])
    assert req.finish_reason == "stop" and req.matched_stop == " STOP"
    assert req.text == text[: text.index(" STOP")] and "".join(deltas) == req.text


def test_the_text_decoder_gives_the_tokenizers_text(tokenizer):
    """runtime/text_decoder.py: the Rust tokenizer called directly gives what
    tokenizer.decode(ids, skip_special_tokens=True) gives, on every slice of each text's
    ids, special tokens among them; a tokenizer that cleans up spaces keeps the wrapper."""
    special = tokenizer.all_special_ids
    decode = text_decoder(tokenizer)
    assert decode.func.__self__ is tokenizer.backend_tokenizer  # called directly
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids = [special[0], *ids[:9], special[-1], *ids[9:]]
        for a in range(0, len(ids), 3):
            for b in range(a, len(ids) + 1, 5):
                assert decode(ids[a:b]) == tokenizer.decode(ids[a:b], skip_special_tokens=True)
    cleaning = AutoTokenizer.from_pretrained(tokenizer.name_or_path,
                                             clean_up_tokenization_spaces=True)
    assert text_decoder(cleaning).func.__self__ is cleaning
