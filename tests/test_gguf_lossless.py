"""int8 / int4 from a GGUF compute with the file's own Q4_0, Q4_1 and Q8_0 blocks.

Per block type: our form of the file's blocks dequantizes to gguf's own values bit for bit;
the CPU kernels' fp32 path computes with them exactly (fp32 rounding only). Tiny random
Llamas written as Q4_0 / Q4_1 / Q8_0 GGUFs (tests/support/tiny_gguf.py): every quantized
layer is the file's weight value for value, the logits are the dequantized fp32 model's, and
greedy output equals it for 64 tokens (the tie rule of tests/test_families.py). A type no
kernel takes (Q5_0, Q4_K) is quantized again, and the load says which tensors, of what type,
with what error. The default model's Q4_1 GGUF (slow): int4 greedy equals fp32 for 64 tokens
on the bench prompt.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from support import link_entries
from support.tiny_checkpoint import tiny_checkpoint, tiny_config
from support.tiny_gguf import write_gguf

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.model.forward_batch import build_batch
from sgl_nb.runtime.model.gguf_blocks import FileBlocks, own_form
from sgl_nb.runtime.model.kernel_probe import Probe, check_layer
from sgl_nb.runtime.model.kernel_rules import OURS_INT4
from sgl_nb.runtime.model.linear import Int4Linear, Int8Linear, make_linear, quantized_linear
from sgl_nb.runtime.model.model import Model, linear_weights, lm_head_weight
from sgl_nb.runtime.model.model_config import ModelConfig
from sgl_nb.runtime.model.model_loader import cache_dir, resolve_model_path
from sgl_nb.runtime.model.quantize import dequantize, quantize

OWN = ["Q4_0", "Q4_1", "Q8_0"]
FORM = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "q8_0"}
TIE = 1e-3  # tests/test_families.py's: fp32 in another summation order flips only a near-tie
NEW = 64
PROMPTS = ["Hello there, how are", "The quick brown fox jumps over the lazy dog. In 1492,",
           "x = 1\ny ="]

needs_kernels = pytest.mark.skipif(not cpu_decode.available(), reason="no C++ compiler")


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory):
    """Conversions and quantized weights in the module's folder; the default model and the
    built kernels found where they are."""
    default, real = resolve_model_path(progress=False), cache_dir()
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGL_NB_CACHE", str(root))
        (root / "models").mkdir()
        (root / "models" / default.name).symlink_to(default)
        link_entries(real, root, "ext", "kernel_checks")
        yield root


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, own_cache):
    """qtype -> a tiny Llama written as a GGUF of that type (its 2-D weights), built once."""
    source = tiny_checkpoint(tiny_config("llama"), tmp_path_factory.mktemp("tiny") / "llama")
    made: dict[str, Path] = {}

    def get(qtype: str) -> Path:
        if qtype not in made:
            path = tmp_path_factory.mktemp("gguf") / f"tiny.{qtype}.gguf"
            write_gguf(source, path, qtype)
            made[qtype] = path
        return made[qtype]

    return get


# ---- the blocks on their own --------------------------------------------------------------


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """gguf's quantization of weights with an outlier column, a constant group and rows
    whose largest value is negative (Q4_0's d < 0), then raw blocks of random bits (any
    nibbles, any finite fp16 d and m)."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
    w[:, 5] *= 30
    w[0, :32] = 0.25
    w[1] = -np.abs(w[1])
    stored = quants.quantize(w, GGMLQuantizationType[qtype]).copy()
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype]
    raw = rng.integers(0, 256, (rows, cols // 32, size), dtype=np.uint8)
    scales = 2 if qtype == "Q4_1" else 1  # d (and m) at the start of each block
    raw[..., :2 * scales] = rng.normal(0, 0.01, (rows, cols // 32, scales)).astype(
        np.float16).view(np.uint8).reshape(rows, cols // 32, 2 * scales)
    return np.concatenate([stored, raw.reshape(rows, -1)])


@pytest.mark.parametrize("qtype", OWN)
def test_our_form_of_the_blocks_dequantizes_to_ggufs_values(qtype):
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    data = random_blocks(qtype, 16, 256, seed=1)
    want = torch.from_numpy(gguf_dequantize(data, GGMLQuantizationType[qtype]))
    form = own_form(data, qtype)
    assert set(form) == ({"qweight", "scale"} | ({"min"} if FORM[qtype] == "int4" else set()))
    assert form["scale"].dtype == torch.float16  # the file's d, as it holds it
    got = dequantize(form)
    assert torch.equal(got, want)
    # Bit for bit, but for the sign of a zero (Q4_0: d (8 - 8) with d < 0 is -0 in gguf).
    same_bits = got.view(torch.int32) == want.view(torch.int32)
    assert (same_bits | (want == 0)).all()


@needs_kernels
@pytest.mark.parametrize("qtype", OWN)
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_kernels_compute_exactly_with_the_blocks_at_fp32(qtype, rows):
    """fp32 activations take the kernels' exact path: the error is fp32 rounding's, against
    the file's dequantized weight in float64 (bf16 activations round x to int8: ~1e-2)."""
    form = own_form(random_blocks(qtype, 64, 256, seed=2), qtype)
    w = dequantize(form)
    layer, why = make_linear(w, None, torch.float32, "cpu", "int4", form)
    assert why is None and isinstance(layer, Int4Linear if FORM[qtype] == "int4" else Int8Linear)
    assert layer.native  # ours: no other kernel takes Q8_0's scales
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    got = layer(x).double()
    want = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T  # what the sums' rounding is relative to
    assert ((got - want).abs() <= 1e-6 * scale + 1e-30).all()


@needs_kernels
def test_the_kernel_probe_holds_fp32_activations_to_fp32_rounding():
    """A layer off by 1e-3 in one group's scale passes a 16-bit check (int8 rounding of x
    moves outputs more) but not the fp32 one: the exact path is checked as exact."""
    form = own_form(random_blocks("Q4_1", 64, 256, seed=3), "Q4_1")
    off = {**form, "scale": form["scale"].clone()}
    off["scale"][5, 2] *= 1.001
    for dtype, verdict in ((torch.float32, "disagrees"), (torch.bfloat16, None)):
        probe = Probe.of(OURS_INT4, 128, 256, dtype)  # random_blocks: 2 x 64 rows
        layer = quantized_linear(off, None, dtype, torch.device("cpu"), "int4", OURS_INT4)
        assert check_layer(layer, off, probe) is None  # its own weights
        why = check_layer(layer, form, probe)  # the weights it should have had
        assert why is None if verdict is None else verdict in why, (dtype, why)


# ---- tiny models from Q4_0 / Q4_1 / Q8_0 GGUFs ------------------------------------------------


def last_logits(model: Model, ids: list[int]) -> torch.Tensor:
    pool = model.new_kv_pool(len(ids))
    slots = pool.alloc(len(ids))
    return model.forward(build_batch(False, [ids], [0], [slots], [slots], model.device), pool)[0]


@needs_kernels
@pytest.mark.parametrize("qtype", OWN)
def test_every_quantized_layer_is_the_files_weight(ggufs, qtype):
    folder = resolve_model_path(ggufs(qtype), progress=False)
    blocks = FileBlocks.read(folder)
    assert blocks is not None and set(blocks.types.values()) == {qtype}
    config, fp32 = ModelConfig.from_folder(folder), _weights(folder)  # dequantized by transformers
    weights = {n: w for n, w, _ in linear_weights(config, fp32)}
    weights["lm_head"] = lm_head_weight(config, fp32)
    for name, w in weights.items():  # fused q/k/v and gate/up, Llama's q/k rows reordered
        for mode in ("int4", "int8"):
            form = quantize(w, mode, blocks)
            assert "min" in form if FORM[qtype] == "int4" else form["scale"].dim() == 2, name
            assert torch.equal(dequantize(form), w.float()), (name, mode)
    assert blocks.report("int4") is None  # nothing was quantized again


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from sgl_nb.runtime.model.checkpoint import read_weights

    return read_weights(folder)


@needs_kernels
@pytest.mark.parametrize("qtype", OWN)
def test_int4_from_the_gguf_gives_the_fp32_models_logits_and_tokens(ggufs, qtype):
    from sgl_nb import Runtime

    folder = resolve_model_path(ggufs(qtype), progress=False)
    fp32 = Model.load(folder, dtype="float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt = Runtime(folder, dtype="float32", quantization="int4", kv_pool_tokens=2048)
    # No layer left dense, nothing of the file quantized again.
    assert not [w for w in caught if str(w.message).startswith("int4:")]
    try:
        model = rt.engine.model
        assert model.fallbacks == {} and model.fused_decode_ready()
        kinds = {type(layer.qkv) for layer in model.layers} | {type(model.lm_head.linear)}
        assert kinds == {Int4Linear if FORM[qtype] == "int4" else Int8Linear}
        prompts = [rt.tokenizer.encode(p) for p in PROMPTS]
        got, want = last_logits(model, prompts[1]), last_logits(fp32, prompts[1])
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        outs = rt.generate(prompts, max_tokens=NEW, ignore_eos=True)
        for prompt, out in zip(prompts, outs):
            assert_greedy_agrees(fp32, prompt, out.token_ids)
    finally:
        rt.shutdown()


def assert_greedy_agrees(fp32: Model, prompt: list[int], ours: list[int]) -> None:
    """Our tokens are the fp32 model's greedy ones; they may differ only where its top-2
    logits are within TIE, ours one of them (not compared after)."""
    seq = list(prompt)
    for i, token in enumerate(ours):
        logits = last_logits(fp32, seq)
        top = logits.topk(2)
        if token != int(top.indices[0]):
            gap = float(top.values[0] - top.values[1])
            assert gap < TIE and token in top.indices.tolist(), (
                f"token {i}: ours {token}, fp32 {int(top.indices[0])} (top-2 gap {gap:.2e})")
            return
        seq.append(token)


# ---- other types: quantized again, and said so -------------------------------------------------

REPORT = re.compile(
    r"int4: (\d+) weight\(s\) of tiny\.(\w+)\.gguf \((.+?) tensors\) were quantized again "
    r"to int4 from their dequantized values \(no kernel computes with blocks of their type, or "
    r"a fused layer mixes types\): relative RMS error against the file's weights ([\d.e-]+) "
    r"mean, ([\d.e-]+) max \((.+)\)\. Q4_0, Q4_1 and Q8_0 tensors keep their blocks")


@needs_kernels
def test_a_type_no_kernel_takes_is_quantized_again_with_its_error_reported(ggufs):
    folder = resolve_model_path(ggufs("Q5_0"), progress=False)
    config = ModelConfig.from_folder(folder)
    for attempt in ("fresh", "cached"):  # reported at every load, not only the first
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = Model.load(folder, quantization="int4")
        found = [REPORT.fullmatch(str(w.message)) for w in caught]
        found = [m for m in found if m]
        assert len(found) == 1, [str(w.message) for w in caught]
        count, qtype, counts, mean, worst, sources = found[0].groups()
        # 4 linears per layer (q/k/v fused, gate/up fused) and the head, all of them Q5_0.
        assert qtype == "Q5_0" and int(count) == 4 * config.num_layers + 1, attempt
        assert counts == f"{7 * config.num_layers + 1} Q5_0"
        assert 0 < float(mean) <= float(worst) < 0.2
        assert "(Q5_0)" in sources
    # The worst error is that of the layer it names, int4's own quantization of the weight.
    fp32 = _weights(folder)
    errors = []
    for _, w, _ in linear_weights(config, fp32):
        back = dequantize(quantize(w, "int4"))
        errors.append(float((back - w.float()).norm() / w.float().norm()))
    head = lm_head_weight(config, fp32).float()
    errors.append(float((dequantize(quantize(head, "int4")) - head).norm() / head.norm()))
    assert float(worst) == pytest.approx(max(errors), rel=1e-3)
    assert isinstance(model.layers[0].qkv, Int4Linear)


@needs_kernels
def test_an_unquantized_gguf_quantizes_as_a_checkpoint_does(ggufs):
    folder = resolve_model_path(ggufs("F16"), progress=False)
    assert FileBlocks.read(folder) is None  # no blocks: nothing of the file to keep or report
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = Model.load(folder, quantization="int4")
    assert isinstance(model.layers[0].qkv, Int4Linear)


# ---- the default model's Q4_1 GGUF ---------------------------------------------------------


@pytest.mark.slow
@needs_kernels
def test_default_model_int4_from_its_q4_1_gguf_is_greedy_fp32_for_64_tokens(runtime):
    from sgl_nb import Runtime
    from sgl_nb.bench.engine import STREAM_PROMPT

    assert runtime.engine.model.dtype == torch.float32 and runtime.engine.model.quantization is None
    tok = runtime.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": STREAM_PROMPT}],
                                             tokenize=False, add_generation_prompt=True))
    want = runtime.generate(ids, max_tokens=NEW, ignore_eos=True).token_ids
    with Runtime(quantization="int4", dtype="float32", kv_pool_tokens=2048) as rt:
        model = rt.engine.model
        assert isinstance(model.layers[0].gate_up, Int4Linear)
        assert isinstance(model.lm_head.linear, Int8Linear)  # the file's Q8_0 head
        assert model.lm_head.linear.scale.dim() == 2
        got = rt.generate(ids, max_tokens=NEW, ignore_eos=True).token_ids
    assert got == want



@pytest.mark.slow
@needs_kernels
def test_int4_decode_ranks_with_an_int4_head_and_picks_the_files_heads_tokens(
        model_path, hf_model, runtime):
    """bf16 activations: a decode step reads an int4 copy of the file's Q8_0 head that only
    ranks (model.head_ranker), and its best 16 are recomputed from 16-bit rows as the Q8_0
    head's are; an extend reads the Q8_0 head. On the model's own final hidden states (varied
    prose, transformers' forward) both heads give the same argmax and, for each token both
    recompute, the same logit. Without the recomputation the ranker's argmax differs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Model.load(model_path, quantization="int4")
    assert model.dtype == torch.bfloat16
    ranker, head = model.decode_head, model.lm_head
    assert isinstance(ranker.linear, Int4Linear) and ranker.weight16 is head.weight16
    assert isinstance(head.linear, Int8Linear) and head.linear.scale.dim() == 2  # Q8_0
    text = (Path(__file__).parent / "data" / "eval_text.txt").read_text()
    ids = torch.tensor([hf_model.config.bos_token_id or 0, *runtime.tokenizer.encode(text)])
    with torch.no_grad():
        h = hf_model.model(ids[None, :512]).last_hidden_state[0].to(torch.bfloat16)
    got, want = ranker(h), head(h)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    ranked, ranked_q8 = refined(ranker, h), refined(head, h)
    both = torch.stack([torch.isin(a, b) for a, b in zip(ranked, ranked_q8)])
    assert both.float().mean() > 0.8  # 0.88 measured
    assert torch.equal(got.gather(1, ranked)[both], want.gather(1, ranked)[both])
    unrefined = ranker.linear(h).float()
    assert not torch.equal(unrefined.argmax(-1), want.argmax(-1))  # the test has teeth


def refined(head, h: torch.Tensor) -> torch.Tensor:
    """The ids LogitsHead recomputes per row: its matmul's best, ties to the lower id."""
    order = head.linear(h).float().sort(dim=-1, descending=True, stable=True).indices
    return order[:, :head.refine]
