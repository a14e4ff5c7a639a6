"""Precision modes: bf16, int8 and int4 weight-only against fp32.

On the default model: perplexity and greedy agreement under teacher forcing on a fixed
text (tests/data/eval_text.txt, ~2,500 tokens), determinism, batch == single and
prefix-cache equality in every mode. On small random weights and a tiny random Qwen2
(biases, a hidden size the int4 kernel rejects): the layers against their dequantized
weights, the fallbacks and their warnings, the quantized cache, bad names. The tiny model's
odd-shaped loads run in a child process (`python tests/test_quantization.py ...`), so that a
kernel's crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import env_with_tests
from support.waits import limit

from sgl_nb.runtime.model.forward_batch import build_batch
from sgl_nb.runtime.model.kernel_rules import aligned
from sgl_nb.runtime.model.linear import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    check_quantization,
    make_linear,
    resolve_dtype,
)
from sgl_nb.runtime.model.quantize import dequantize, quantize, quantize_int4

EVAL_TEXT = Path(__file__).parent / "data" / "eval_text.txt"

MODES = {
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    # The default model's GGUF blocks (Q4_1, a Q8_0 head), the kernels' exact fp32 path:
    # fp32's own weights, in another summation order only.
    "int4-fp32": {"quantization": "int4", "dtype": "float32"},
}
# (largest relative perplexity change, smallest greedy agreement with fp32)
LIMITS = {"bf16": (0.02, 0.97), "int8": (0.05, 0.93), "int4": (0.10, 0.88),
          "int4-fp32": (1e-4, 0.998)}

NEW = 24
TEXTS = [
    "The three primary colours are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley. Every morning he",
    "Le petit prince demanda au renard",
]


# ---- the layers on their own (no model) -----------------------------------------------------


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_layer_matches_its_dequantized_weight(quantization):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen) * 0.05
    bias = torch.randn(64, generator=gen)
    t = quantize(w, quantization)
    deq = dequantize(t, quantization)
    # Round to nearest: every weight within half a step of its quantized value.
    step = t["scale"][:, :, None].expand(64, 3, 32).reshape(64, 96) if quantization == "int4" \
        else t["scale"][:, None]
    assert ((w - deq).abs() <= step / 2 + 1e-7).all()

    layer, why = make_linear(w, bias, torch.bfloat16, "cpu", quantization, t)
    assert why is None
    assert isinstance(layer, Int8Linear if quantization == "int8" else Int4Linear)
    x = torch.randn(5, 96, generator=gen).bfloat16()
    got = layer(x)
    want = F.linear(x.float(), deq, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 64)
    assert (got.float() - want).abs().max() < 2e-2 * want.abs().max()


def test_int4_gives_back_weights_already_on_a_q4_1_grid():
    """GGUF Q4_1 stores w = d * q + m, q in 0..15 per 32 inputs, d and m fp16: int4 with group
    32 and an fp16 scale and min is the same grid, so such weights come back unchanged."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (32, 4, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's min/max rounding uses both ends
    d = (torch.rand(32, 4, 1, generator=gen) * 0.01 + 1e-3).half().float()
    m = (torch.randn(32, 4, 1, generator=gen) * 0.05).half().float()
    w = (d * q + m).reshape(32, 128)
    back = dequantize(quantize_int4(w), "int4")
    assert (back - w).abs().max() < 1e-6 * w.abs().max()


def test_shape_the_int4_kernel_rejects_falls_back_to_dense():
    w = torch.randn(60, 96)  # 60 outputs: not a multiple of 16
    layer, why = make_linear(w, None, torch.bfloat16, "cpu", "int4", None)
    assert isinstance(layer, DenseLinear) and "multiple of 16" in why
    layer, why = make_linear(torch.randn(64, 80), None, torch.bfloat16, "cpu", "int4", None)
    assert isinstance(layer, DenseLinear) and "group size 32" in why


def test_torchs_int8_kernel_gets_its_operands_on_64_byte_boundaries():
    """Its AVX-512 path reads weight and activation rows with aligned loads: a weight read
    from a safetensors file sat 8 bytes off, and the first call at 4 rows segfaulted."""
    w = torch.randn(90, 64, generator=torch.Generator().manual_seed(0)) * 0.05  # 90: not ours
    t = quantize(w, "int8")
    odd = torch.empty(90 * 64 + 8, dtype=torch.int8)[8:].view(90, 64)
    odd.copy_(t["qweight"])
    layer, why = make_linear(w, None, torch.bfloat16, "cpu", "int8", {**t, "qweight": odd})
    assert why is None and layer.kernel == "torch-int8"
    assert layer.qweight.data_ptr() % 64 == 0 and torch.equal(layer.qweight, odd)
    x = torch.randn(9 * 64 + 4).bfloat16()[4:].view(9, 64)
    assert x.data_ptr() % 64 and aligned(x).data_ptr() % 64 == 0 and torch.equal(aligned(x), x)


def test_bad_dtype_or_quantization_names_the_allowed_values():
    with pytest.raises(ValueError, match="float32.*bfloat16"):
        resolve_dtype("fp16", "cpu", None)
    with pytest.raises(ValueError, match="int8.*int4"):
        check_quantization("int3")
    with pytest.raises(ValueError, match="bfloat16"):  # CUDA's int8/int4 kernels are 16-bit
        resolve_dtype("float32", "cuda", "int8")
    assert resolve_dtype("float32", "cpu", "int8") == torch.float32  # the exact CPU path
    assert resolve_dtype(None, "cpu", None) == torch.float32  # the CPU default stays fp32
    assert resolve_dtype(None, "cpu", "int4") == torch.bfloat16
    assert resolve_dtype(None, "cuda", None) == torch.bfloat16


def test_runtime_rejects_bad_names_before_loading(tmp_path):
    from sgl_nb import Runtime

    missing = tmp_path / "not-loaded"  # the names are checked before the model path
    with pytest.raises(ValueError, match="'float32', 'bfloat16'"):
        Runtime(missing, dtype="half")
    with pytest.raises(ValueError, match="'int8', 'int4'"):
        Runtime(missing, quantization="nf4")


# ---- a tiny random Qwen2: biases, and a hidden size int4 rejects ----------------------------


@pytest.fixture(scope="module")
def tiny_odd_qwen2(tmp_path_factory, model_path):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    # hidden 80: q/k/v, o and gate/up have 80 inputs (not a multiple of 32), down has 160.
    cfg = Qwen2Config(
        vocab_size=49152, hidden_size=80, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.08, architectures=["Qwen2ForCausalLM"],
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp("tiny-odd-qwen2")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(model_path)).save_pretrained(folder)
    return folder


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    pool = model.new_kv_pool(len(ids))
    slots = pool.alloc(len(ids))
    return model.forward(build_batch(False, [ids], [0], [slots], [slots], model.device), pool)[0]


def _odd_load(folder: Path, quantization: str, mode: str, logits_file: Path) -> None:
    """The tiny Qwen2's quantized load, checked in a child process (the tests below).

    mode "fresh": its fallbacks, its logits against fp32's, its quantized cache, a second
    load; "cached": a later process's load gives the same bits; "crash-head": the probe
    process crashed on the int8 LM head ($SGL_NB_PROBE_FAULT), which stays dense.
    """
    from sgl_nb.runtime.model import model as model_mod
    from sgl_nb.runtime.model.model import Model

    ids = list(range(100, 140))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = Model.load(folder, quantization=quantization)
    warned = [str(w.message) for w in caught]
    if mode == "crash-head":
        why = "torch's int8 kernel crashed on [49152, 80] bf16 in a probe process (signal 11)"
        assert m.fallbacks == {"lm_head": why}, m.fallbacks
        assert warned == [f"int8: 1 linear layer(s) stay dense (lm_head): {why}"], warned
        assert isinstance(m.lm_head.linear, DenseLinear)
        assert all(isinstance(layer.qkv, Int8Linear) for layer in m.layers)
    elif quantization == "int4":
        assert sorted(m.fallbacks) == sorted(
            f"layers.{i}.{n}" for i in range(2) for n in ("qkv", "o_proj", "gate_up"))
        assert any(w.startswith("int4: 6 linear layer(s) stay dense") and "group size" in w
                   for w in warned), warned
        assert all(isinstance(layer.down, Int4Linear) for layer in m.layers)
    else:
        assert not m.fallbacks and not warned, warned
        assert all(isinstance(layer.qkv, Int8Linear) for layer in m.layers)
    assert m.dtype == torch.bfloat16
    assert mode == "crash-head" or isinstance(m.lm_head.linear, Int8Linear)
    got = _last_logits(m, ids)
    _score_every_position(m, ids)
    if mode == "cached":
        assert torch.equal(got, torch.load(logits_file))
        return
    want = _last_logits(Model.load(folder), ids)
    assert F.cosine_similarity(got, want, dim=0) > 0.99
    assert got.argmax() == want.argmax()
    if mode == "crash-head":
        return

    # Quantized once: the second load reads the cache folder and quantizes nothing.
    files = list((Path(os.environ["SGL_NB_CACHE"]) / "quantized").rglob("*.safetensors"))
    assert len(files) == 1 and files[0].name.startswith(quantization)

    def no_quantizing(*args):
        raise AssertionError("quantized again")

    model_mod.quantize_weights = no_quantizing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same fallbacks, already checked above
        again = Model.load(folder, quantization=quantization)
    assert torch.equal(_last_logits(again, ids), got)
    _score_every_position(again, ids)
    torch.save(got, logits_file)


def _score_every_position(model, ids: list[int]) -> None:
    """The LM head at 40 rows, its weights as loaded: from the cache file, the int8 head's sat
    8 bytes off a 16-byte boundary, and torch's kernel (aligned loads from 4 rows on)
    segfaulted on them."""
    nll, _ = score_text(model, ids)
    assert torch.isfinite(nll).all()


def _run_odd_load(folder: Path, quantization: str, mode: str, tmp_path: Path,
                  fault: str = "") -> str:
    """_odd_load in a child process that must exit 0; its stderr."""
    env = env_with_tests(SGL_NB_PROBE_FAULT=fault)
    proc = subprocess.run(
        [sys.executable, __file__, str(folder), quantization, mode, str(tmp_path / "cache"),
         str(tmp_path / "logits.pt")], env=env, capture_output=True, text=True,
        timeout=limit(900))
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tiny_qwen2_quantized_falls_back_where_needed_and_caches(
    tiny_odd_qwen2, quantization, tmp_path
):
    err = _run_odd_load(tiny_odd_qwen2, quantization, "fresh", tmp_path)
    assert "in a probe process" in err
    # A later process takes the kernels' verdicts from the cache folder: no probe process
    # (one would crash on every shape here).
    err = _run_odd_load(tiny_odd_qwen2, quantization, "cached", tmp_path, fault="* * crash")
    assert "probe process" not in err


@pytest.mark.slow
def test_a_kernel_crashing_in_the_probe_process_leaves_its_layer_dense(tiny_odd_qwen2, tmp_path):
    err = _run_odd_load(tiny_odd_qwen2, "int8", "crash-head", tmp_path,
                        fault="torch-int8 49152x80 crash")
    assert "died on torch's int8 kernel on [49152, 80] bf16 (signal 11)" in err
    assert "(4 usable, 1 not)" in err


# ---- the default model in each mode ---------------------------------------------------------


def score_text(model, ids: list[int], chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher forcing over `ids` in extend chunks over the cached prefix: per position, the
    negative log-likelihood of the next token and the greedy choice."""
    pool = model.new_kv_pool(len(ids))
    slots = pool.alloc(len(ids))
    target = torch.tensor(ids[1:] + [0])
    nll, top = [], []
    for s in range(0, len(ids), chunk):
        e = min(s + chunk, len(ids))
        batch = build_batch(False, [ids[s:e]], [s], [slots[:e]], [slots[s:e]], model.device,
                            score_rows=list(range(e - s)))
        _, logits = model.forward(batch, pool)
        nll.append(-torch.log_softmax(logits, -1).gather(1, target[s:e, None])[:, 0])
        top.append(logits.argmax(-1))
    return torch.cat(nll)[:-1], torch.cat(top)[:-1]


@pytest.fixture(scope="module")
def eval_ids(runtime) -> list[int]:
    ids = runtime.tokenizer.encode(EVAL_TEXT.read_text())
    assert len(ids) >= 2000
    return ids


@pytest.fixture(scope="module")
def fp32_scores(runtime, eval_ids):
    assert runtime.engine.model.dtype == torch.float32
    return score_text(runtime.engine.model, eval_ids)


@pytest.fixture(scope="module")
def prompts(runtime) -> list[list[int]]:
    chat = runtime.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}])
    return [runtime.tokenizer.encode(t) for t in [chat, *TEXTS]]


@pytest.fixture(scope="module", params=list(MODES))
def mode_rt(request, model_path):
    from sgl_nb import Runtime

    rt = Runtime(model_path, kv_pool_tokens=4096, **MODES[request.param])
    rt.mode = request.param
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def alone(mode_rt, prompts) -> list[list[int]]:
    """Each prompt's greedy tokens, run alone from an empty cache."""
    outs = []
    for p in prompts:
        mode_rt.flush_cache()
        outs.append(mode_rt.generate(p, max_tokens=NEW, ignore_eos=True).token_ids)
    return outs


@pytest.mark.slow
def test_accuracy_against_fp32(mode_rt, eval_ids, fp32_scores, capsys):
    ref_nll, ref_top = fp32_scores
    nll, top = score_text(mode_rt.engine.model, eval_ids)
    ppl, ref_ppl = math.exp(nll.mean().item()), math.exp(ref_nll.mean().item())
    change = ppl / ref_ppl - 1
    agree = (top == ref_top).float().mean().item()
    with capsys.disabled():
        print(f"\n[precision] {mode_rt.mode}: perplexity {ppl:.3f} vs fp32 {ref_ppl:.3f} "
              f"({change:+.2%}), greedy agreement with fp32 {agree:.2%} "
              f"over {len(eval_ids) - 1} positions")
    max_change, min_agree = LIMITS[mode_rt.mode]
    assert abs(change) <= max_change
    assert agree >= min_agree


@pytest.mark.slow
def test_greedy_is_deterministic(mode_rt, prompts):
    runs = []
    for _ in range(2):
        mode_rt.flush_cache()
        runs.append([o.token_ids for o in mode_rt.generate(prompts, max_tokens=NEW,
                                                           ignore_eos=True)])
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_batch_equals_one_at_a_time(mode_rt, eval_ids):
    """Bit for bit: the same tokens and the same logprobs (the CPU kernels compute each
    row and each token's attention on its own; kernels/cpu_decode.cpp)."""
    prompts = [eval_ids[i * 300: i * 300 + 24] for i in range(6)]
    mode_rt.flush_cache()
    batch = mode_rt.generate(prompts, max_tokens=NEW, ignore_eos=True, logprobs=True)
    for p, b in zip(prompts, batch):
        mode_rt.flush_cache()
        one = mode_rt.generate(p, max_tokens=NEW, ignore_eos=True, logprobs=True)
        assert one.token_ids == b.token_ids and one.logprobs == b.logprobs


@pytest.mark.slow
def test_batch_of_mixed_lengths_equals_one_at_a_time(mode_rt, prompts, alone):
    mode_rt.flush_cache()
    outs = mode_rt.generate(prompts, max_tokens=NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == alone


@pytest.mark.slow
def test_cached_prefix_gives_the_same_tokens(mode_rt, prompts, alone):
    mode_rt.flush_cache()
    for p, want in zip(prompts, alone):
        half = len(p) // 2
        mode_rt.generate(p[:half], max_tokens=1)
        out = mode_rt.generate(p, max_tokens=NEW, ignore_eos=True)
        assert out.meta["cached_tokens"] >= half
        assert out.token_ids == want


if __name__ == "__main__":  # _run_odd_load's child: folder quantization mode cache logits
    from sgl_nb.kernels import cpu_decode

    cpu_decode.load()  # from the usual cache folder, before it moves to the test's
    os.environ["SGL_NB_CACHE"] = sys.argv[4]
    _odd_load(Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[5]))
