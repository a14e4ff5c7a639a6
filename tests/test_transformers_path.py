"""Models the native runner does not implement, through transformers' modeling code with our
paged attention (runtime/model/transformers_model.py): greedy tokens and logits against
transformers' own model, the engine's radix cache, batching, fork, regex, select and
stepping on them, the refusals (hybrid, encoder-decoder, attention computed in the model's
own code), and the default model forced through this path against the native runner.

Tiny random-weight checkpoints are built here (support.tiny_checkpoint), no download."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
from conftest import hf_greedy
from support.tiny_checkpoint import load_reference, tiny_checkpoint
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.runtime.model.forward_batch import build_batch
from sgl_nb.runtime.model.load import RUNNER_ENV, load_model

NEW = 12
_SMALL = dict(vocab_size=49152, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)


def _configs():
    import transformers as tf

    return {
        # partial rotary (25%), parallel residual, LayerNorm, biases
        "gpt_neox": tf.GPTNeoXConfig(**_SMALL, intermediate_size=256, rotary_pct=0.25),
        # learned absolute positions (position_ids must be ours), Conv1D, no rope
        "gpt2": tf.GPT2Config(vocab_size=49152, n_embd=128, n_layer=2, n_head=4,
                              n_positions=1024, bos_token_id=1, eos_token_id=2),
        # partial rotary, parallel attention and MLP, a biased LM head
        "phi": tf.PhiConfig(**_SMALL, intermediate_size=256, partial_rotary_factor=0.5),
        # GQA and a sliding window of 8, shorter than the prompts below
        "starcoder2": tf.Starcoder2Config(**_SMALL, intermediate_size=256,
                                          num_key_value_heads=2, sliding_window=8),
    }


ARCHS = ("gpt_neox", "gpt2", "phi", "starcoder2")


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    """(arch, checkpoint folder, transformers' reference model, our Runtime on it)."""
    arch = request.param
    folder = tiny_checkpoint(_configs()[arch], tmp_path_factory.mktemp(arch), seed=1)
    # max_prefill_tokens 16: the prompts below prefill in chunks over their cached start.
    rt = sgl.Runtime(str(folder), kv_pool_tokens=4096, max_prefill_tokens=16)
    yield arch, folder, load_reference(folder), rt
    rt.shutdown()


def _prompts(rt) -> list[list[int]]:
    tok = rt.tokenizer
    texts = ["The lighthouse keeper climbed the stairs every evening and lit the lamp, "
             "watching the ships pass",
             "def add(a, b):\n    return"]
    return [tok.encode(t) for t in texts]


def test_path_is_transformers(tiny):
    arch, _, _, rt = tiny
    model = rt.engine.model
    assert model.path == "transformers" and model.config.model_type == arch
    assert not model.fused_decode_ready() and model.quantization is None


def test_logits_close_to_transformers(tiny):
    _, folder, hf, rt = tiny
    _check_logits(load_model(folder), hf, _prompts(rt)[0])


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_native_family_forced_through_transformers(tmp_path, family):
    """Gemma 2 (a window of 16 on alternate layers, attention soft-cap 2) and Gemma 3 (its
    window and per-layer rope) through transformers' code: its sliding_window and softcap
    arguments reach our kernels, over a prompt longer than the window."""
    from support.tiny_checkpoint import tiny_config

    folder = tiny_checkpoint(tiny_config(family), tmp_path / family)
    model = load_model(folder, runner="transformers")
    assert model.path == "transformers" and 16 in model.config.windows
    if family == "gemma2":
        assert set(model.config.softcaps) == {2.0}
    _check_logits(model, load_reference(folder), list(range(200, 240)))


def _check_logits(model, hf, ids: list[int]) -> None:
    """Prefill in two chunks (the second over the first's KV), then one decode step: the
    last logits equal transformers' on the whole sequence."""
    pool = model.new_kv_pool(256)
    slots = pool.alloc(len(ids) + 1)
    cut = len(ids) // 2
    for start, end in ((0, cut), (cut, len(ids))):
        fb = build_batch(False, [ids[start:end]], [start], [slots[:end]], [slots[start:end]],
                         model.device)
        logits = model.forward(fb, pool)[0]
    nxt = int(logits.argmax())
    fb = build_batch(True, [[nxt]], [len(ids)], [slots], [slots[-1:]], model.device)
    decoded = model.forward(fb, pool)[0]
    with torch.inference_mode():
        want = hf(torch.tensor([ids + [nxt]])).logits[0, -2:].float()
    assert torch.allclose(logits, want[0], atol=1e-4), (logits - want[0]).abs().max()
    assert torch.allclose(decoded, want[1], atol=1e-4), (decoded - want[1]).abs().max()


def test_score_rows_are_transformers_logits(tiny):
    _, folder, hf, rt = tiny
    model = load_model(folder)
    pool = model.new_kv_pool(256)
    ids = _prompts(rt)[1]
    slots = pool.alloc(len(ids))
    rows = [1, 3, len(ids) - 2]
    fb = build_batch(False, [ids], [0], [slots], [slots], model.device, score_rows=rows)
    last, scored = model.forward(fb, pool)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float()
    assert torch.allclose(last[0], want[-1], atol=1e-4)
    assert torch.allclose(scored, want[rows], atol=1e-4)


def test_greedy_equals_generate_batched_and_with_prefix_cached(tiny):
    _, _, hf, rt = tiny
    prompts = _prompts(rt)
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    rt.flush_cache()
    outs = rt.generate(prompts, max_tokens=NEW, ignore_eos=True)  # one batch
    assert [o.token_ids for o in outs] == expected
    rt.flush_cache()
    p = prompts[0]
    rt.generate(p[: len(p) // 2], max_tokens=1)
    out = rt.generate(p, max_tokens=NEW, ignore_eos=True)
    assert out.meta["cached_tokens"] >= len(p) // 2  # the radix cache served the start
    assert out.token_ids == expected[0]


@sgl.function
def _branches(s, prefix):
    s += prefix
    forks = s.fork(2)
    forks += lambda i: f" Part {i + 1}:"
    forks += sgl.gen("part", max_tokens=6, ignore_eos=True)
    forks.join()


@sgl.function
def _solo(s, prefix, i):
    s += prefix + f" Part {i + 1}:"
    s += sgl.gen("part", max_tokens=6, ignore_eos=True)


def test_fork_branches_equal_solo_runs(tiny):
    """A fork branch decodes over its parent's KV slots (shared, not copied): the same text
    as the branch's prompt run alone from an empty cache."""
    _, _, _, rt = tiny
    prefix = "A story in two parts about a clockmaker."
    rt.flush_cache()
    st = _branches.run(prefix, backend=rt)
    assert st.error() is None and len(st["part"]) == 2
    for i in range(2):
        rt.flush_cache()
        solo = _solo.run(prefix, i, backend=rt)
        assert solo["part"] == st["part"][i]


def test_regex(tiny):
    _, _, _, rt = tiny

    @sgl.function
    def form(s):
        s += "Code:"
        s += sgl.gen("code", regex=r" [0-9]{3}-[a-z]{2}", max_tokens=16)

    st = form.run(backend=rt)
    assert st.error() is None and re.fullmatch(r" [0-9]{3}-[a-z]{2}", st["code"]), st["code"]


def test_select_scores_equal_transformers(tiny):
    _, _, hf, rt = tiny
    question = "Q: What colour is a ripe banana?\nA: It is"

    @sgl.function
    def pick(s):
        s += question
        s += sgl.select("colour", [" yellow", " blue", " bright purple"])

    st = pick.run(backend=rt)
    meta = st.get_meta_info("colour")
    tok = rt.tokenizer
    pre = tok.encode(question)
    for choice, got in zip(meta["choices"], meta["normalized_prompt_logprobs"]):
        ids = pre + tok.encode(choice)
        with torch.inference_mode():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        want = sum(lp[p - 1, ids[p]].item() for p in range(len(pre), len(ids)))
        assert abs(got - want / (len(ids) - len(pre))) < 1e-4
    best = max(range(3), key=lambda i: meta["normalized_prompt_logprobs"][i])
    assert st["colour"] == meta["choices"][best]


@sgl.function
def _story(s):
    s += "Once upon a time"
    s += sgl.gen("a", max_tokens=5, ignore_eos=True)
    s += " Then"
    s += sgl.gen("b", max_tokens=3, ignore_eos=True)


def test_stepping_one_instruction_at_a_time(tiny):
    _, _, _, rt = tiny
    plain = _story.run(backend=rt)
    st = _story.run(backend=rt, step=True, passes=())  # no fusion: each `s +=` a Node
    assert st.debug.wait_until_held(timeout=WAIT) and st.debug.current.kind == "Text"
    st.debug.step()
    assert st.debug.wait_until_held(timeout=WAIT) and st.debug.current.name == "a"
    st.debug.step_instruction()  # the gen's prefill: its first token, then it holds
    assert st.debug.wait_until_held(timeout=WAIT) and st.debug.waiting_at == "decode"
    st.debug.continue_()
    assert st["a"] == plain["a"] and st["b"] == plain["b"] and st.error() is None


# ---- refusals ---------------------------------------------------------------------------


def test_hybrid_refused_by_its_config(tmp_path):
    import transformers as tf

    cfg = tf.Lfm2Config(vocab_size=49152, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        full_attn_idxs=[1], bos_token_id=1, eos_token_id=2)
    folder = tiny_checkpoint(cfg, tmp_path / "lfm2")
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM.*not attention: conv"):
        load_model(folder)


def test_hybrid_refused_when_its_config_does_not_say(tmp_path):
    """A config without layer_types: the probe run sees a layer that never calls attention."""
    import transformers as tf

    from sgl_nb.runtime.model.transformers_model import TransformersModel

    cfg = tf.Lfm2Config(vocab_size=49152, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        full_attn_idxs=[1], bos_token_id=1, eos_token_id=2)
    folder = tiny_checkpoint(cfg, tmp_path / "lfm2")
    d = json.loads((folder / "config.json").read_text())
    assert "conv" in d.pop("layer_types")
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="1 of its 2 layers are not attention"):
        TransformersModel.load(folder)


@pytest.mark.parametrize("config, why", [
    ({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
      "is_encoder_decoder": True}, "encoder-decoder"),
    ({"architectures": ["JambaForCausalLM"], "model_type": "jamba", "mamba_d_state": 16},
     "state-space"),
    ({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}, "state-space"),
    ({"architectures": ["ViTModel"], "model_type": "vit"},
     "neither a native family .* nor a causal LM"),
    ({"architectures": ["FalconForCausalLM"], "model_type": "falcon"},
     r"modeling code \(FalconForCausalLM\) computes attention itself"),
    ({"architectures": ["StableLmForCausalLM"], "model_type": "stablelm"},
     "computes attention itself"),
])
def test_refused_before_loading_weights(tmp_path, config, why):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{config['architectures'][0]} cannot run.*{why}"):
        load_model(tmp_path)


def test_unknown_model_type_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such"}))
    with pytest.raises(ValueError, match="model_type 'no_such' is unknown to transformers"):
        load_model(tmp_path)


def test_encoder_refused(tmp_path):
    """BERT has a causal-LM class in transformers, but its attention looks both ways."""
    import transformers as tf

    cfg = tf.BertConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128)
    folder = tiny_checkpoint(cfg, tmp_path / "bert")
    with pytest.raises(ValueError, match="attends both ways"):
        load_model(folder)


@pytest.mark.parametrize("quantization, min_cos", [("int8", 0.9999), ("int4", 0.999)])
def test_quantized_linears(tiny, quantization, min_cos, monkeypatch):
    """int8/int4: the decoder's linear layers become ours (quantized), the LM head stays
    16-bit; the last logits stay close to the fp32 model's."""
    from sgl_nb.runtime.model import transformers_linear
    from sgl_nb.runtime.model.linear import Int4Linear, Int8Linear
    from sgl_nb.runtime.model.model_loader import quantized_cache_path
    from sgl_nb.runtime.model.transformers_linear import OurLinear

    _, folder, _, rt = tiny
    ids = _prompts(rt)[0]
    model = load_model(folder, quantization=quantization)
    assert model.quantization == quantization and model.dtype == torch.bfloat16
    kind = Int8Linear if quantization == "int8" else Int4Linear
    ours = {n: m.layer for n, m in model.hf.named_modules() if isinstance(m, OurLinear)}
    assert ours and all(isinstance(x, kind) or n in model.fallbacks for n, x in ours.items())
    assert not isinstance(model.hf.get_output_embeddings(), OurLinear)
    dense = load_model(folder)
    got, want = (_last_logits(m, ids) for m in (model, dense))
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > min_cos
    # Quantized once per checkpoint: a second load reads the cache and quantizes nothing.
    assert quantized_cache_path(folder, quantization, "transformers").is_file()

    def refuse(*args):
        raise AssertionError("quantized again instead of read from the cache")

    monkeypatch.setattr(transformers_linear, "quantize", refuse)
    again = load_model(folder, quantization=quantization)
    assert torch.equal(_last_logits(again, ids), got)


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    pool = model.new_kv_pool(len(ids))
    slots = pool.alloc(len(ids))
    return model.forward(build_batch(False, [ids], [0], [slots], [slots], model.device), pool)[0]


def test_runner_must_be_known(tiny, monkeypatch):
    _, folder, _, _ = tiny
    monkeypatch.setenv(RUNNER_ENV, "fast")
    with pytest.raises(ValueError, match=f"{RUNNER_ENV}.*native, transformers.*'fast'"):
        load_model(folder)
    monkeypatch.setenv(RUNNER_ENV, "native")
    with pytest.raises(ValueError, match="native runner does not implement it"):
        load_model(folder)


# ---- the default model through both paths ----------------------------------------------


@pytest.fixture(scope="module")
def forced(model_path):
    """The default model (SmolLM2, native) forced through the transformers path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUNNER_ENV, "transformers")
        rt = sgl.Runtime(str(model_path), kv_pool_tokens=4096)
    yield rt
    rt.shutdown()


@pytest.mark.slow
def test_default_model_same_greedy_tokens_on_both_paths(forced, runtime):
    assert forced.engine.model.path == "transformers" and runtime.engine.model.path == "native"
    tok = runtime.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three rivers."}],
                                   tokenize=False, add_generation_prompt=True)
    prompts = [tok.encode(chat), tok.encode("The three primary colours are")]
    want = [o.token_ids for o in runtime.generate(prompts, max_tokens=24, ignore_eos=True)]
    got = [o.token_ids for o in forced.generate(prompts, max_tokens=24, ignore_eos=True)]
    assert got == want


@sgl.function
def _program(s):
    s += "Q: Pick a number and a colour.\nA: The number"
    s += sgl.gen("number", regex=r" [0-9]{2}", max_tokens=6)
    s += ", and the colour is"
    s += sgl.select("colour", [" red", " green", " blue"])
    s += ". A sentence about it:"
    s += sgl.gen("sentence", max_tokens=8, ignore_eos=True)


def _trace(rt) -> tuple[dict, Counter]:
    """A program's variables and its events (kind, instruction kind or token id)."""
    events = rt.events.subscribe()
    st = _program.run(backend=rt)
    assert st.error() is None
    rt.events.unsubscribe(events)
    seen = Counter()
    while not events.empty():
        e = events.get()
        if e.program == st.id:
            seen[(e.kind, getattr(e, "op", None), getattr(e, "token", None))] += 1
    return {k: st[k] for k in ("number", "colour", "sentence")}, seen


@pytest.mark.slow
def test_default_model_program_and_events_same_on_both_paths(forced, runtime):
    runtime.flush_cache()
    forced.flush_cache()
    native_vars, native_events = _trace(runtime)
    vars_, events = _trace(forced)
    assert vars_ == native_vars
    assert events == native_events
    assert sum(n for (kind, _, _), n in events.items() if kind == "token") >= 8 + 1


@pytest.mark.slow
def test_sgl_model_magic_names_the_path(ipython_shell, capsys, forced, runtime):
    from sgl_nb.language.function import set_default_backend

    set_default_backend(forced)
    try:
        ipython_shell.run_line_magic("sgl_model", "")
    finally:
        set_default_backend(runtime)
    assert "path: transformers (LlamaForCausalLM" in capsys.readouterr().out
    ipython_shell.run_line_magic("sgl_model", "")
    assert "path: native (llama" in capsys.readouterr().out
