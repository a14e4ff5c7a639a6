"""Engine behaviour on the real default model: sharing, batching, chunking, sampling, errors."""

from __future__ import annotations

import threading

import pytest
from support.waits import WAIT

from sgl_nb import Runtime
from sgl_nb.runtime.model.model_loader import ModelNotFoundError

pytestmark = pytest.mark.slow

STORY = ("In the year of the long winter, the river froze so deep that the ferryman "
         "walked to work across the ice, and the children of the town learned to skate. ")


def long_prefix(rt, n: int) -> list[int]:
    ids = rt.tokenizer.encode(STORY * 60)
    assert len(ids) >= n
    return ids[:n]


def test_sixteen_requests_prefill_shared_prefix_once(runtime):
    runtime.flush_cache()
    prefix = long_prefix(runtime, 400)
    prompts = [prefix + runtime.tokenizer.encode(f" Question {i}: what did child {i} do?")
               for i in range(16)]
    extend_before = runtime.engine.steps["extend"]
    outs = runtime.generate(prompts, max_tokens=8)
    cached = [o.meta["cached_tokens"] for o in outs]
    assert sorted(cached)[0] == 0  # the first one computes the prefix ...
    assert all(c >= 400 for c in sorted(cached)[1:])  # ... everyone else reads it
    assert runtime.engine.steps["extend"] - extend_before <= 3
    # Each output equals the same prompt run alone.
    alone = runtime.generate(prompts[5], max_tokens=8)
    assert alone.token_ids == outs[5].token_ids


def test_requests_join_and_leave_the_running_batch(runtime):
    p_long, p_short = runtime.tokenizer.encode("Count: one, two,"), runtime.tokenizer.encode("Hi")
    solo_long = runtime.generate(p_long, max_tokens=60, ignore_eos=True).token_ids
    solo_short = runtime.generate(p_short, max_tokens=5, ignore_eos=True).token_ids
    long_h = runtime.submit(p_long, max_tokens=60, ignore_eos=True)
    short_h = runtime.submit(p_short, max_tokens=5, ignore_eos=True)
    short = short_h.result(timeout=WAIT)
    assert not long_h.done()  # the short one joined, ran beside it, and left first
    assert short.token_ids == solo_short
    assert long_h.result(timeout=WAIT).token_ids == solo_long


def test_chunked_prefill_matches_one_chunk(model_path, runtime):
    prompt = long_prefix(runtime, 300)
    want = runtime.generate(prompt, max_tokens=16, ignore_eos=True).token_ids
    with Runtime(model_path, kv_pool_tokens=2048, max_prefill_tokens=64) as small:
        before = small.engine.steps["extend"]
        out = small.generate(prompt, max_tokens=16, ignore_eos=True)
        assert small.engine.steps["extend"] - before >= 300 // 64
        assert out.token_ids == want


def test_memory_pressure_retracts_and_still_completes(model_path, runtime):
    prompts = [runtime.tokenizer.encode(f"Story {i}: once upon a time") for i in range(4)]
    want = [runtime.generate(p, max_tokens=96, ignore_eos=True).token_ids for p in prompts]
    # Room for the prompts and 60% of the outputs: admission (which expects about half of
    # max_tokens) lets all four in, and their growth then has to be handled by retraction.
    pool = sum(len(p) for p in prompts) + int(0.6 * 4 * 96)
    with Runtime(model_path, kv_pool_tokens=pool) as small:
        outs = small.generate(prompts, max_tokens=96, ignore_eos=True)
        assert [o.token_ids for o in outs] == want
        assert small.cache_stats()["retractions"] > 0
        assert sum(o.meta["retractions"] for o in outs) > 0


def test_small_pool_runs_fewer_at_once_without_losing_anything(model_path, runtime):
    prompts = [runtime.tokenizer.encode(f"Story {i}: " + STORY * 2) for i in range(4)]
    want = [runtime.generate(p, max_tokens=48, ignore_eos=True).token_ids for p in prompts]
    need = sum(len(p) + 48 for p in prompts)
    with Runtime(model_path, kv_pool_tokens=need // 4 + 48) as small:
        outs = small.generate(prompts, max_tokens=48, ignore_eos=True)
        assert [o.token_ids for o in outs] == want


def test_sampling_seed_is_reproducible(runtime):
    p = runtime.tokenizer.encode("My favourite animal is")
    kw = dict(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, ignore_eos=True)
    a = runtime.generate(p, seed=7, **kw).token_ids
    b = runtime.generate(p, seed=7, **kw).token_ids
    others = {tuple(runtime.generate(p, seed=s, **kw).token_ids) for s in (1, 2, 3)}
    assert a == b
    assert len(others | {tuple(a)}) > 1
    # Seeded requests draw the same tokens alone or inside a batch.
    batch = runtime.generate([p, p[:-1]], seed=7, **kw)
    assert batch[0].token_ids == a


def test_top_k_one_is_greedy(runtime):
    p = runtime.tokenizer.encode("The sun rises in the")
    greedy = runtime.generate(p, max_tokens=12, ignore_eos=True).token_ids
    topk1 = runtime.generate(p, max_tokens=12, temperature=0.8, top_k=1, seed=3, ignore_eos=True)
    assert topk1.token_ids == greedy


def test_stop_strings_and_stop_tokens(runtime):
    p = runtime.tokenizer.encode("1, 2, 3, 4, 5,")
    full = runtime.generate(p, max_tokens=24, ignore_eos=True)
    assert " 8," in full.text
    out = runtime.generate(p, max_tokens=24, stop=[" 8"], ignore_eos=True)
    assert out.meta["finish_reason"] == "stop" and out.meta["matched_stop"] == " 8"
    assert out.text == full.text[: full.text.index(" 8")]
    tok = full.token_ids[3]
    out = runtime.generate(p, max_tokens=24, stop_token_ids=[tok], ignore_eos=True)
    assert out.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]
    assert out.meta["matched_stop"] == tok


def test_eos_stops_unless_ignored(runtime):
    chat = runtime.apply_chat_template([{"role": "user", "content": "Say just: yes"}])
    out = runtime.generate(chat, max_tokens=64)
    assert out.meta["finish_reason"] == "stop"
    assert out.token_ids[-1] in runtime.engine.eos_ids
    assert runtime.tokenizer.eos_token not in out.text


def test_logprobs_and_alternatives(runtime):
    out = runtime.generate("The capital of Italy is", max_tokens=6, logprobs=True,
                           top_logprobs=4, ignore_eos=True)
    assert len(out.logprobs) == len(out.top_logprobs) == 6
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-6  # greedy: the best one
        assert lp <= 0 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_stream_yields_the_text_piece_by_piece(runtime):
    p = "Write one sentence about rain."
    chunks = list(runtime.generate(p, max_tokens=30, stream=True, ignore_eos=True))
    assert len(chunks) > 5
    assert "".join(chunks) == runtime.generate(p, max_tokens=30, ignore_eos=True).text


def test_generate_from_many_threads(runtime):
    prompts = [f"Fact {i} about the moon:" for i in range(6)]
    want = [runtime.generate(p, max_tokens=10, ignore_eos=True).token_ids for p in prompts]
    got: dict[int, list[int]] = {}

    def work(i: int) -> None:
        got[i] = runtime.generate(prompts[i], max_tokens=10, ignore_eos=True).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    assert [got[i] for i in range(6)] == want


def test_bad_input_is_named_and_others_keep_running(model_path):
    with Runtime(model_path, kv_pool_tokens=2048) as rt:
        p = rt.tokenizer.encode("Alpha, beta, gamma,")
        want = rt.generate(p, max_tokens=40, ignore_eos=True).token_ids
        running = rt.submit(p, max_tokens=40, ignore_eos=True)
        with pytest.raises(ValueError, match="empty prompt"):
            rt.generate("")
        with pytest.raises(ValueError, match="max_tokens"):
            rt.generate("hello", max_tokens=0)
        with pytest.raises(ValueError, match="max_tokens"):
            rt.generate("hello", max_tokens=-3)
        ctx = rt.engine.context_len
        with pytest.raises(ValueError, match=f"context of {ctx}"):
            rt.generate([1] * (ctx + 5), max_tokens=4)
        with pytest.raises(ValueError, match="never fit the KV pool"):
            rt.generate([1] * 100, max_tokens=2000)
        with pytest.raises(ValueError, match="top_p"):
            rt.generate("hello", top_p=0.0)
        with pytest.raises(ValueError, match="token ids"):
            rt.generate([1, -4, 2])
        assert not running.done() or running.result().token_ids == want
        assert running.result(timeout=WAIT).token_ids == want
        assert rt.engine.pool.used() <= rt.cache_stats()["cached_tokens"]  # nothing leaked


def test_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        Runtime(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="not a checkpoint folder"):
        Runtime(tmp_path / "empty")


def test_cache_stats(runtime):
    runtime.generate("Cache me if you can, cache me if you can.", max_tokens=4)
    runtime.generate("Cache me if you can, cache me if you can.", max_tokens=4)
    s = runtime.cache_stats()
    assert s["cached_prompt_tokens"] > 0 and 0 < s["prompt_hit_rate"] <= 1
    assert s["kv_pool_capacity"] == runtime.engine.pool.capacity


def test_regex_and_json_schema_constrain_the_output(runtime):
    import json
    import re

    out = runtime.generate("The year the first moon landing happened:", regex=r" ?[0-9]{4}",
                           max_tokens=8)
    assert re.fullmatch(r" ?[0-9]{4}", out.text) and out.meta["finish_reason"] == "stop"
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}},
        "required": ["ok", "tags"]}
    chat = runtime.apply_chat_template([{"role": "user", "content": "Reply in JSON."}])
    # Bounded by the schema: 3 tags of at most 12 characters fit in 96 tokens.
    value = json.loads(runtime.generate(chat, json_schema=schema, max_tokens=96).text)
    assert isinstance(value["ok"], bool) and isinstance(value["tags"], list)
    with pytest.raises(ValueError, match=r"invalid regex '\(ab'"):
        runtime.generate("x", regex="(ab")
    with pytest.raises(ValueError, match="invalid JSON schema"):
        runtime.generate("x", json_schema="{not json")


def test_hub_id_loads_from_the_local_hugging_face_cache_only(tmp_path, model_path, monkeypatch):
    import huggingface_hub.constants
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="hf download someone/tiny-llama"):
        Runtime("someone/tiny-llama")  # not cached: named, and nothing is fetched
    # The cache's layout: refs/main names the snapshot folder that holds the files.
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    snap = repo / "snapshots" / ("a" * 40)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, architectures=["LlamaForCausalLM"])
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(snap)
    AutoTokenizer.from_pretrained(str(model_path)).save_pretrained(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    with Runtime("someone/tiny-llama", kv_pool_tokens=1024) as rt:
        assert rt.model_path == snap
        ids = rt.tokenizer.encode("Hello there")
        out = rt.generate(ids, max_tokens=6, ignore_eos=True)
        with torch.inference_mode():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == want


@pytest.mark.slow
def test_a_grammar_no_token_continues_fails_its_request_alone(runtime):
    """U+526CB: no token sequence of this vocabulary spells it. Its request fails by name,
    at any temperature and again and again; the request batched beside it is untouched."""
    alone = runtime.generate("The capital of France is", max_tokens=12, ignore_eos=True)
    for temperature in (1.0, 0.0, 1.0):
        bad = runtime.submit("Hello", regex="\U000526cb", max_tokens=2, temperature=temperature)
        good = runtime.submit("The capital of France is", max_tokens=12, ignore_eos=True)
        with pytest.raises(ValueError, match="allows no next token"):
            bad.result(timeout=WAIT)
        assert good.result(timeout=WAIT).token_ids == alone.token_ids
    assert runtime.cache_stats()["protected_tokens"] == 0


@pytest.mark.slow
def test_a_temperature_too_small_to_divide_by_is_greedy(runtime):
    greedy = runtime.generate("The capital of France is", max_tokens=8)
    tiny = runtime.generate("The capital of France is", max_tokens=8, temperature=1e-9, seed=1)
    assert tiny.token_ids == greedy.token_ids
    with pytest.raises(ValueError, match="temperature"):
        runtime.generate("Hi", temperature=float("nan"))
