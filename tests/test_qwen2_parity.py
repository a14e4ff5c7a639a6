"""Qwen2 architecture (q/k/v biases, untied LM head) against transformers, tiny random weights
built here from a config: no download."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, model_path):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=49152, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, rope_theta=10000.0, initializer_range=0.08,
        architectures=["Qwen2ForCausalLM"],
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # Qwen2 initialises biases to zero: make them matter
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(model_path)).save_pretrained(folder)
    return folder, model


def test_qwen2_greedy_and_logits_match(tiny_qwen2):
    from sgl_nb import Runtime

    folder, hf = tiny_qwen2
    rt = Runtime(folder, kv_pool_tokens=4096)
    try:
        assert rt.engine.config.architecture == "qwen2" and rt.engine.config.attention_bias
        prompts = [rt.tokenizer.encode(t) for t in
                   ["Hello there, how are", "A list of fruits: apple,", "x = 1\ny ="]]
        outs = rt.generate(prompts, max_tokens=24, ignore_eos=True)
        for p, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(hf, p, 24)
        # A shared prefix, served from the cache, changes nothing.
        again = rt.generate(prompts[0] + outs[0].token_ids[:5], max_tokens=8, ignore_eos=True)
        assert again.meta["cached_tokens"] >= len(prompts[0])
        assert again.token_ids == hf_greedy(hf, prompts[0] + outs[0].token_ids[:5], 8)
        top = rt.generate(prompts[1], max_tokens=1, logprobs=True, top_logprobs=3)
        with torch.inference_mode():
            want = torch.log_softmax(hf(torch.tensor([prompts[1]])).logits[0, -1], -1)
        assert abs(top.logprobs[0] - want[top.token_ids[0]].item()) < 1e-4
        assert [t for t, _ in top.top_logprobs[0]] == want.topk(3).indices.tolist()
    finally:
        rt.shutdown()
