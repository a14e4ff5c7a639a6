"""runtime/model/moe.py against transformers' Qwen3MoeSparseMoeBlock (the oracle), on a tiny
random-weight Qwen3-MoE layer: fp32 equal to rounding, bf16 within bf16's rounding, int8 and
int4 within a stated error of the fp32 output, and each expert run only on its own tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from sgl_nb.runtime.model.linear import DenseLinear, shape_error
from sgl_nb.runtime.model.moe import MoE, expert_linear_weights, moe_from_weights
from sgl_nb.runtime.model.quantize import quantize

HIDDEN, EXPERTS, TOP_K = 64, 8, 2
PREFIX, NAME = "model.layers.0.mlp.", "layers.0"


def tiny_layer(folder, intermediate: int = 32, seed: int = 0):
    """(transformers' MoE block, the per-expert tensors save_pretrained wrote, its fused 3D
    state_dict tensors) of a one-layer Qwen3-MoE model with random weights."""
    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64,
        moe_intermediate_size=intermediate, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, decoder_sparse_step=1, experts_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    block = model.model.layers[0].mlp
    with torch.no_grad():
        # Router logits of size ~3: a decided top-2, as a trained router's mostly is.
        block.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN) * 0.4)
        block.experts.gate_up_proj.copy_(torch.randn(EXPERTS, 2 * intermediate, HIDDEN) / 8)
        block.experts.down_proj.copy_(
            torch.randn(EXPERTS, HIDDEN, intermediate) / intermediate**0.5)
    model.save_pretrained(folder)
    saved = load_file(str(folder / "model.safetensors"))
    fused = {f"model.{k}": v.detach().clone() for k, v in model.model.state_dict().items()}
    return block, saved, fused


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    return tiny_layer(tmp_path_factory.mktemp("qwen3_moe"))


def tokens(t: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, HIDDEN, generator=g)


def ours(weights, dtype=torch.float32, quantization=None, norm_topk_prob=True):
    quantized = None
    if quantization is not None:
        # As the runner's quantize_weights: only the shapes the kernels take.
        quantized = {n: quantize(w, quantization)
                     for n, w, _ in expert_linear_weights(weights, PREFIX, NAME, EXPERTS)
                     if shape_error(*w.shape, quantization) is None}
    return moe_from_weights(weights, PREFIX, NAME, EXPERTS, TOP_K, norm_topk_prob, dtype,
                            "cpu", quantization, quantized)


def theirs(block, h: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(h[None])[0]


def test_checkpoint_layout_is_per_expert(layer):
    """What transformers 5.24's save_pretrained writes for Qwen3-MoE experts (the layout
    moe.py reads first); the fused 3D one is its in-memory state_dict."""
    _, saved, fused = layer
    assert f"{PREFIX}experts.0.gate_proj.weight" in saved
    assert f"{PREFIX}experts.gate_up_proj" not in saved
    assert fused[f"{PREFIX}experts.gate_up_proj"].shape == (EXPERTS, 64, HIDDEN)


def test_both_layouts_give_the_same_expert_weights(layer):
    _, saved, fused = layer
    a = list(expert_linear_weights(saved, PREFIX, NAME, EXPERTS))
    b = list(expert_linear_weights(fused, PREFIX, NAME, EXPERTS))
    assert [n for n, _, _ in a] == [n for n, _, _ in b]
    assert a[0][0] == "layers.0.experts.0.gate_up" and a[-1][0] == "layers.0.experts.7.down"
    assert len(a) == 2 * EXPERTS
    for (_, wa, _), (_, wb, _) in zip(a, b, strict=True):
        assert torch.equal(wa, wb)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("t", [1, 3, 16, 41])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_fp32_matches_transformers(layer, layout, t, norm_topk_prob):
    block, saved, fused = layer
    block.gate.norm_topk_prob = norm_topk_prob
    try:
        moe, fallbacks = ours(saved if layout == "per_expert" else fused,
                              norm_topk_prob=norm_topk_prob)
        h = tokens(t)
        expected = theirs(block, h)
    finally:
        block.gate.norm_topk_prob = True
    assert fallbacks == {}
    torch.testing.assert_close(moe(h), expected, rtol=1e-5, atol=1e-5)


def test_repeated_tokens_and_empty_batch(layer):
    """The same token several times routes its copies to the same experts (an expert with
    several rows of one token); no tokens at all gives no rows."""
    block, saved, _ = layer
    moe, _ = ours(saved)
    h = tokens(4).repeat(3, 1)
    out = moe(h)
    torch.testing.assert_close(out, theirs(block, h), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:4], out[8:], rtol=0, atol=0)
    assert moe(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


class CountingLinear:
    """A real Linear that also counts the rows it was called on."""

    def __init__(self, inner):
        self.inner, self.rows, self.calls = inner, 0, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += x.shape[0]
        self.calls += 1
        return self.inner(x)


@pytest.mark.parametrize("t", [1, 16])
def test_each_expert_runs_only_on_its_tokens(layer, t):
    """Expert e's linears see exactly the tokens the router sent to e: T * top_k rows in all
    (not T * num_experts), and an expert nobody chose is never called. With 1 token 6 of the
    8 experts get none; with 16 tokens (32 choices over 8 experts) some expert gets several."""
    block, saved, _ = layer
    moe, _ = ours(saved)
    moe.experts = [(CountingLinear(g), CountingLinear(d)) for g, d in moe.experts]
    h = tokens(t, seed=2)
    out = moe(h)
    with torch.no_grad():
        _, _, chosen = block.gate(h)  # transformers' router: [T, top_k] expert ids
    routed = torch.bincount(chosen.view(-1), minlength=EXPERTS).tolist()
    assert [g.rows for g, _ in moe.experts] == routed
    assert [d.rows for _, d in moe.experts] == routed
    assert [g.calls for g, _ in moe.experts] == [int(n > 0) for n in routed]
    assert sum(routed) == t * TOP_K
    assert (0 in routed) if t == 1 else max(routed) >= 2
    torch.testing.assert_close(out, theirs(block, h), rtol=1e-5, atol=1e-5)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def test_bf16_matches_transformers_bf16(layer):
    """Same routing as transformers in bf16 (the router's logits are the same matmul on the
    same bf16 values); the experts' outputs differ by bf16 rounding only."""
    block, saved, _ = layer
    moe, fallbacks = ours(saved, dtype=torch.bfloat16)
    assert fallbacks == {}
    assert isinstance(moe.experts[0][0], DenseLinear)
    h = tokens(24).bfloat16()
    out = moe(h)
    assert out.dtype == torch.bfloat16
    expected = theirs(copy.deepcopy(block).to(torch.bfloat16), h)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)
    assert relative_error(out, expected.float()) < 1e-3  # measured 0 to 5e-5


# Relative error (Frobenius) of the 16-bit block's output against fp32 transformers on the
# same inputs, over the tokens routed to the same experts as in fp32 (bf16 rounding of the
# router's logits flips a near-tied top-k choice for about 1 token in 24 here, in transformers'
# bf16 too; such a token's output differs by a whole expert, which says nothing of the
# weights' precision). Measured on 6 seeds: bf16 0.7-0.8%, int8 1.7-2.0%, int4 13-15%.
BOUNDS = {None: 0.02, "int8": 0.04, "int4": 0.25}


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_16bit_and_quantized_close_to_fp32(layer, quantization):
    block, saved, _ = layer
    moe, fallbacks = ours(saved, dtype=torch.bfloat16, quantization=quantization)
    assert fallbacks == {}
    assert isinstance(moe.experts[0][0], DenseLinear) == (quantization is None)
    h = tokens(24)
    out = moe(h.bfloat16())
    assert out.dtype == torch.bfloat16
    same = same_routing(moe, block, h)
    assert same.sum() >= 20
    assert relative_error(out[same], theirs(block, h)[same]) < BOUNDS[quantization]


def same_routing(moe: MoE, block, h: torch.Tensor) -> torch.Tensor:
    """[T] bool: our 16-bit router picks the experts transformers' fp32 router picks."""
    with torch.no_grad():
        _, _, fp32_choice = block.gate(h)
    choice, _ = moe.route(h.to(moe.router.dtype))
    return (choice.sort(-1).values == fp32_choice.sort(-1).values).all(-1)


def test_int4_falls_back_to_dense_where_the_shape_has_no_kernel(tmp_path):
    """moe_intermediate_size 24: down's input size is no multiple of int4's group of 32, so
    each down stays dense (named in the fallbacks, with why); gate_up is int4."""
    block, saved, _ = tiny_layer(tmp_path, intermediate=24)
    moe, fallbacks = ours(saved, dtype=torch.bfloat16, quantization="int4")
    assert sorted(fallbacks) == sorted(f"layers.0.experts.{e}.down" for e in range(EXPERTS))
    assert all("multiple of the group size 32" in why for why in fallbacks.values())
    assert isinstance(moe.experts[0][1], DenseLinear)
    assert not isinstance(moe.experts[0][0], DenseLinear)
    h = tokens(24)
    same = same_routing(moe, block, h)
    assert same.sum() >= 20
    assert relative_error(moe(h.bfloat16())[same], theirs(block, h)[same]) < BOUNDS["int4"]


def test_bad_checkpoints_name_the_tensor(layer):
    _, saved, fused = layer
    missing = {k: v for k, v in saved.items() if k != f"{PREFIX}experts.3.up_proj.weight"}
    with pytest.raises(KeyError, match=r"experts\.3\.up_proj\.weight"):
        ours(missing)
    wrong = dict(saved)
    wrong[f"{PREFIX}experts.5.down_proj.weight"] = torch.zeros(HIDDEN, 31)
    with pytest.raises(ValueError, match=r"experts\.5\.down_proj\.weight is \[64, 31\]"):
        ours(wrong)
    short = dict(fused)
    short[f"{PREFIX}experts.down_proj"] = fused[f"{PREFIX}experts.down_proj"][:4]
    with pytest.raises(ValueError, match=r"experts\.down_proj is \[4, 64, 32\]"):
        ours(short)
    with pytest.raises(ValueError, match="num_experts=6"):
        moe_from_weights(saved, PREFIX, NAME, 6, TOP_K, True, torch.float32, "cpu")
    with pytest.raises(KeyError, match=r"model\.layers\.9\.mlp\.gate\.weight"):
        moe_from_weights(saved, "model.layers.9.mlp.", "layers.9", EXPERTS, TOP_K, True,
                         torch.float32, "cpu")


def test_top_k_out_of_range_is_refused(layer):
    _, saved, _ = layer
    moe, _ = ours(saved)
    with pytest.raises(ValueError, match="top_k must be between 1 and the number of experts"):
        MoE(moe.router, moe.experts, top_k=9, norm_topk_prob=True)


def test_activation_is_the_callers(layer):
    """The experts' activation is a parameter (the runner passes its family's): with gelu-tanh
    on both sides the outputs agree, and differ from silu's."""
    block, saved, _ = layer
    gelu = torch.nn.GELU(approximate="tanh")
    moe, _ = moe_from_weights(saved, PREFIX, NAME, EXPERTS, TOP_K, True, torch.float32, "cpu",
                              activation=gelu)
    h = tokens(5)
    silu_out = theirs(block, h)
    silu, block.experts.act_fn = block.experts.act_fn, gelu
    try:
        expected = theirs(block, h)
    finally:
        block.experts.act_fn = silu
    torch.testing.assert_close(moe(h), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, silu_out, atol=1e-3)
