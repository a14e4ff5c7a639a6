"""Decode ahead (EngineConfig.decode_ahead): one fused CPU call decodes several greedy
tokens and the picker checks each row as a draft. The oracle is the same engine a step a
token (decode_ahead=1): the same tokens, alternatives, logprobs and finish, and no KV
slot left behind."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sgl_nb import Runtime
from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.model.forward_batch import build_batch, greedy_picks

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C++ compiler")

STORY = "Write a long story about a lighthouse keeper who finds a map in a bottle."
QUESTIONS = ["What is 2 + 2?", "Name three colours.", "Tell me about bees in one sentence."]


def chat(rt: Runtime, text: str) -> list[int]:
    tok = rt.engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              tokenize=False, add_generation_prompt=True))


def outputs(rt: Runtime, ahead: int) -> list:
    """Greedy requests of every ending: length, EOS, a stop string, a stop token, a batch."""
    rt.engine.settings = dataclasses.replace(rt.engine.settings, decode_ahead=ahead)
    story = chat(rt, STORY)
    outs = [
        rt.generate(story, max_tokens=61, ignore_eos=True),
        rt.generate(chat(rt, QUESTIONS[0]), max_tokens=200),  # ends at EOS (its 12th token)
        rt.generate(story, max_tokens=80, stop=[" the "]),
        rt.generate(story, max_tokens=80, stop_token_ids=rt.engine.tokenizer.encode(",")),
        *rt.generate([chat(rt, q) for q in QUESTIONS], max_tokens=40),
        rt.generate(story, max_tokens=30, logprobs=True, top_logprobs=3),
    ]
    return [(o.text, o.token_ids, o.meta["finish_reason"], o.meta["matched_stop"], o.tokens)
            for o in outs]


def same_as_a_step_a_token(rt: Runtime) -> None:
    before = rt.engine.metrics()["decode_ahead_accepted"]
    one = outputs(rt, 1)
    assert rt.engine.metrics()["decode_ahead_accepted"] == before  # off: none decoded ahead
    ahead = outputs(rt, 8)
    m = rt.engine.metrics()
    assert m["decode_ahead_accepted"] > before + 100
    assert m["decode_ahead_steps_saved"] > 0
    for a, b in zip(one, ahead):
        assert a == b
    assert [o[2] for o in one][:4] == ["length", "stop", "stop", "stop"]
    rt.flush_cache()
    assert rt.engine.pool.used() == 0  # the slots of steps past a stop were given back


@pytest.fixture(scope="module")
def int4_runtime(model_path):
    rt = Runtime(model_path, quantization="int4", kv_pool_tokens=4096)
    yield rt
    rt.shutdown()


def test_int4_same_tokens_as_a_step_a_token(int4_runtime):
    same_as_a_step_a_token(int4_runtime)


def test_fp32_same_tokens_as_a_step_a_token(runtime):
    settings = runtime.engine.settings
    try:
        same_as_a_step_a_token(runtime)
    finally:
        runtime.engine.settings = settings


def test_torch_path_decodes_ahead_the_same(model_path):
    """Off the fused step (Model.forward_ahead's torch twin, ForwardBatch.step_of)."""
    rt = Runtime(model_path, kv_pool_tokens=2048)
    try:
        rt.engine.model.use_fused_decode(False)
        rt.engine.settings = dataclasses.replace(rt.engine.settings, decode_ahead=1)
        one = rt.generate(chat(rt, STORY), max_tokens=24, ignore_eos=True).token_ids
        rt.engine.settings = dataclasses.replace(rt.engine.settings, decode_ahead=6)
        ahead = rt.generate(chat(rt, STORY), max_tokens=24, ignore_eos=True).token_ids
        assert ahead == one
        assert rt.engine.metrics()["decode_ahead_accepted"] > 10
    finally:
        rt.shutdown()


def test_only_greedy_batches_decode_ahead(int4_runtime):
    """A batch with a sampled, grammar or penalized request decodes a step a token, with
    the output it has off (a seeded draw is the same)."""
    rt = int4_runtime
    prompts = [chat(rt, q) for q in QUESTIONS]
    runs = []
    for ahead in (1, 8):
        rt.engine.settings = dataclasses.replace(rt.engine.settings, decode_ahead=ahead)
        before = rt.engine.metrics()["decode_ahead_drafted"]
        runs.append([
            [o.text for o in rt.generate(prompts, max_tokens=24, temperature=0.8, seed=7)],
            rt.generate(prompts[0], max_tokens=24, regex=r"[A-Z][a-z ]{5,30}\.").text,
            rt.generate(prompts[1], max_tokens=24, repetition_penalty=1.3).text,
        ])
        assert rt.engine.metrics()["decode_ahead_drafted"] == before
    assert runs[0] == runs[1]


def test_an_interrupt_ends_the_run_after_its_step(int4_runtime):
    """interrupt_ahead after the mark the run was given: one step, its logits those of the
    whole run's first; none: every step."""
    model, pool = int4_runtime.engine.model, int4_runtime.engine.pool
    assert model.fused_decode_ready()
    slots = pool.alloc(26)  # a 20-token context (whatever its KV holds) and 6 new tokens
    try:
        batch = build_batch(True, [[42]], [20], [slots], [slots[20:21]], "cpu")
        batch.ahead = 6
        whole = model.forward_ahead(batch, pool, [], model.ahead_mark())
        mark = model.ahead_mark()
        model.interrupt_ahead()
        cut = model.forward_ahead(batch, pool, [], mark)
    finally:
        pool.free(slots)
    assert whole.rows.shape[0] == 6 and whole.tokens.shape[0] == 5
    assert cut.rows.shape[0] == 1 and cut.tokens.shape[0] == 0
    assert torch.equal(cut.rows[0], whole.rows[0])


def test_the_step_gives_each_rows_alternatives_as_top_logits(int4_runtime):
    """The fused step's alternatives (AheadLogits.alternatives: the refinement's best
    entries and a logsumexp summed on both threads) are the bits the kernels' top_logits
    gives for each row it returns; none asked for, or more than the refinement ranks: None."""
    model, pool = int4_runtime.engine.model, int4_runtime.engine.pool
    ext = cpu_decode.loaded()
    slots = pool.alloc(48)  # two 20-token contexts (whatever their KV holds), 4 new tokens each
    try:
        mine = [slots[:24], slots[24:]]
        batch = build_batch(True, [[42], [7]], [20, 20], mine, [s[20:21] for s in mine], "cpu")
        batch.ahead = 4
        got = model.forward_ahead(batch, pool, [], model.ahead_mark(), alternatives=5)
        none = model.forward_ahead(batch, pool, [], model.ahead_mark())
        too_many = model.forward_ahead(batch, pool, [], model.ahead_mark(), alternatives=100)
    finally:
        pool.free(slots)
    assert none.alternatives is None and too_many.alternatives is None
    ids, values, lse = got.alternatives
    rows = got.rows.reshape(-1, got.rows.shape[-1])
    assert len(ids) == len(values) == len(lse) == rows.shape[0] == 8
    want_ids, want_values, want_lse = ext.top_logits(rows.contiguous(), 5)
    assert (ids, values, lse) == (want_ids, want_values, want_lse)
    assert [row[0] for row in ids] == greedy_picks(rows).tolist()


def test_work_arriving_mid_run_changes_no_token(int4_runtime):
    """Requests submitted while a long run decodes end it early (Engine._post): each
    output is still the one it has alone, and no slot is left behind."""
    rt = int4_runtime
    rt.engine.settings = dataclasses.replace(rt.engine.settings, decode_ahead=32)
    story, questions = chat(rt, STORY), [chat(rt, q) for q in QUESTIONS]
    alone = [rt.generate(story, max_tokens=150, ignore_eos=True).token_ids,
             *[o.token_ids for o in rt.generate(questions, max_tokens=30)]]
    text, handles = [], []
    for chunk in rt.generate(story, max_tokens=150, ignore_eos=True, stream=True):
        text.append(chunk)
        if len(text) in (64, 65, 66):  # while the story decodes ahead in runs of 32
            handles.append(rt.submit(questions[len(handles)], max_tokens=30))
    assert "".join(text) == rt.engine.tokenizer.decode(alone[0])
    assert [h.result().token_ids for h in handles] == alone[1:]
    rt.flush_cache()
    assert rt.engine.pool.used() == 0


def test_greedy_picks_rule():
    """Ties go to the first; a NaN wins (numpy's argmax)."""
    rows = torch.tensor([[0.0, 2.0, 2.0, 1.0], [float("-inf")] * 4,
                         [1.0, float("nan"), 3.0, float("nan")]])
    assert greedy_picks(rows).tolist() == [1, 0, 1]
