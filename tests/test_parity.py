"""The engine against transformers on the default model: same greedy tokens, close logits."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from sgl_nb.runtime.model.forward_batch import build_batch

pytestmark = pytest.mark.slow
NEW = 48

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
]
TEXTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colours are",
    "1, 2, 3, 5, 8, 13,",
    "Le petit prince demanda au renard",
    "Once upon a time, in a village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley. Every morning he",
]


@pytest.fixture(scope="module")
def prompts(runtime) -> list[list[int]]:
    tok = runtime.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                     add_generation_prompt=True) for c in CHATS]
    return [tok.encode(p) for p in chats + TEXTS]


@pytest.fixture(scope="module")
def expected(prompts, hf_model) -> list[list[int]]:
    return [hf_greedy(hf_model, p, NEW) for p in prompts]


def test_greedy_matches_transformers_from_empty_cache(runtime, prompts, expected):
    runtime.flush_cache()
    outs = runtime.generate(prompts, max_tokens=NEW, ignore_eos=True)
    for p, out, want in zip(prompts, outs, expected):
        assert out.token_ids == want, runtime.tokenizer.decode(p)
        assert out.meta["completion_tokens"] == NEW and out.meta["finish_reason"] == "length"
    # The text prompts share nothing with each other: computed from scratch.
    assert [o.meta["cached_tokens"] for o in outs[len(CHATS):]] == [0] * len(TEXTS)


def test_greedy_matches_transformers_with_prefix_cached(runtime, prompts, expected):
    runtime.flush_cache()
    for p, want in zip(prompts, expected):
        half = len(p) // 2
        runtime.generate(p[:half], max_tokens=1)
        out = runtime.generate(p, max_tokens=NEW, ignore_eos=True)
        assert out.meta["cached_tokens"] >= half
        assert out.token_ids == want


def test_one_at_a_time_equals_batch(runtime, prompts, expected):
    runtime.flush_cache()
    for p, want in zip(prompts[:3], expected[:3]):
        assert runtime.generate(p, max_tokens=NEW, ignore_eos=True).token_ids == want


def _logits(model, pool, ids: list[int], start: int, slots: torch.Tensor) -> torch.Tensor:
    """Extend ids[start:] over a prefix already in slots[:start]; logits of the last token."""
    fb = build_batch(False, [ids[start:]], [start], [slots], [slots[start:]], model.device)
    return model.forward(fb, pool)[0]


def test_last_logits_close_to_transformers(runtime, prompts, hf_model):
    model = runtime.engine.model
    pool = model.new_kv_pool(1024)
    for ids in prompts:
        with torch.inference_mode():
            want = hf_model(torch.tensor([ids])).logits[0, -1].float()
        slots = pool.alloc(len(ids))
        full = _logits(model, pool, ids, 0, slots)
        # Same prompt, second half computed over the first half's cached KV.
        half = len(ids) // 2
        _logits(model, pool, ids[:half], 0, slots[:half])
        cached = _logits(model, pool, ids, half, slots)
        pool.free(slots)
        assert (full - want).abs().max().item() < 1e-3
        assert (cached - want).abs().max().item() < 1e-3
