"""Repetition penalties and min_tokens on the real default model, against transformers: the
same weights, with transformers' own logits processors where it has them (repetition,
min new tokens) and OpenAI's formula on its logits where it has none (frequency, presence)."""

from __future__ import annotations

import pytest
import torch
from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

pytestmark = pytest.mark.slow

LOOPY = "Repeat after me: red blue red blue red blue red blue red blue"
VARIED = "Here is a short story about a fox who wanted to learn to"


def hf_penalized(hf, ids: list[int], n: int, adjust) -> list[int]:
    """Greedy decoding with transformers, `adjust(all_ids, new_ids, logits)` applied to the
    last position's logits at each step."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = hf(torch.tensor([out])).logits[:, -1, :].float()
            logits = adjust(torch.tensor([out]), out[len(ids):], logits)
            out.append(int(logits.argmax(-1)))
    return out[len(ids):]


def openai_penalties(frequency: float, presence: float):
    def adjust(_all, new_ids, logits):
        counts = torch.bincount(torch.tensor(new_ids, dtype=torch.long),
                                minlength=logits.shape[-1])[: logits.shape[-1]].float()
        return logits - frequency * counts - presence * (counts > 0).float()
    return adjust


@pytest.mark.parametrize("frequency,presence,prompt", [
    (0.8, 0.0, LOOPY), (0.0, 1.2, LOOPY), (0.5, 0.5, LOOPY),
    (-1.5, 0.0, VARIED),  # a negative penalty makes a varied text repeat itself
])
def test_frequency_and_presence_penalties_match_the_formula_on_transformers(
        runtime, hf_model, frequency, presence, prompt):
    ids = runtime.tokenizer.encode(prompt)
    plain = runtime.generate(ids, max_tokens=20, ignore_eos=True).token_ids
    out = runtime.generate(ids, max_tokens=20, ignore_eos=True, frequency_penalty=frequency,
                           presence_penalty=presence)
    assert out.token_ids == hf_penalized(hf_model, ids, 20, openai_penalties(frequency, presence))
    assert out.token_ids != plain  # the penalty changed the output: the test can tell


@pytest.mark.parametrize("penalty,prompt", [(1.3, LOOPY), (0.7, VARIED)])
def test_repetition_penalty_matches_transformers_processor(runtime, hf_model, penalty, prompt):
    ids = runtime.tokenizer.encode(prompt)
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    out = runtime.generate(ids, max_tokens=20, ignore_eos=True, repetition_penalty=penalty)
    assert out.token_ids == hf_penalized(hf_model, ids, 20, lambda a, _n, lg: proc(a, lg))
    assert out.token_ids != runtime.generate(ids, max_tokens=20, ignore_eos=True).token_ids


def test_min_tokens_holds_back_eos_as_transformers_does(runtime, hf_model):
    chat = runtime.apply_chat_template([{"role": "user", "content": "Say just: yes"}])
    ids = runtime.tokenizer.encode(chat)
    short = runtime.generate(ids, max_tokens=64)
    assert short.meta["finish_reason"] == "stop" and len(short.token_ids) < 10
    eos = list(runtime.engine.eos_ids)
    out = runtime.generate(ids, max_tokens=64, min_tokens=16)
    assert len(out.token_ids) >= 16
    proc = MinNewTokensLengthLogitsProcessor(len(ids), 16, eos)
    want = hf_penalized(hf_model, ids, len(out.token_ids), lambda a, _n, lg: proc(a, lg))
    assert out.token_ids == want
    assert out.meta["finish_reason"] == "stop" and out.token_ids[-1] in eos  # EOS after 16


def test_min_tokens_defers_stop_strings_and_stop_tokens(runtime):
    ids = runtime.tokenizer.encode("1, 2, 3, 4, 5,")
    full = runtime.generate(ids, max_tokens=24, ignore_eos=True)
    first_comma = full.token_ids[2]
    assert runtime.tokenizer.decode([first_comma]) == ","
    out = runtime.generate(ids, max_tokens=24, ignore_eos=True, stop=[","], min_tokens=6)
    assert len(out.token_ids) >= 6 and out.meta["matched_stop"] == ","
    assert "," in out.text  # a comma before the 6th token did not stop it
    assert full.text.startswith(out.text)
    out = runtime.generate(ids, max_tokens=24, ignore_eos=True, stop_token_ids=[first_comma],
                           min_tokens=5)
    assert len(out.token_ids) >= 5 and first_comma not in out.token_ids[:5]
    if first_comma in out.token_ids:  # after the 5th token it stops, as a stop token does
        assert out.token_ids.index(first_comma) == len(out.token_ids) - 1
        assert out.meta["matched_stop"] == first_comma


def test_bad_penalties_are_named(runtime):
    for kwargs, named in [({"frequency_penalty": 3.0}, "frequency_penalty"),
                          ({"presence_penalty": -2.5}, "presence_penalty"),
                          ({"repetition_penalty": 0.0}, "repetition_penalty"),
                          ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
                          ({"min_tokens": 2, "regex": "[a-z]+"}, "min_tokens")]:
        with pytest.raises(ValueError, match=named):
            runtime.generate("Hello", **kwargs)
