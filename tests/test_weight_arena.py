"""runtime/model/weight_arena.py: the weights a CPU decode step streams, in one buffer in the
step's order, starting at a 2 MiB boundary, with the same values and the same logits."""

import pytest
import torch
from support.tiny_checkpoint import tiny_config
from transformers import AutoModelForCausalLM

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.model.forward_batch import build_batch
from sgl_nb.runtime.model.model import Model
from sgl_nb.runtime.model.model_config import ModelConfig
from sgl_nb.runtime.model.weight_arena import HUGE_PAGE, Arena, pack_decode_weights

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no CPU kernels built")


def _model(dtype: torch.dtype) -> Model:
    hf = tiny_config("llama")
    torch.manual_seed(0)
    return Model(ModelConfig.from_dict(hf.to_dict()), AutoModelForCausalLM.from_config(hf)
                 .state_dict(), dtype=dtype)


def _logits(model: Model) -> torch.Tensor:
    """A prefill of 40 tokens then one decode step, through the layer loop (our kernels)."""
    model.use_fused_decode(False)
    pool = model.new_kv_pool(64)
    slots = torch.arange(1, 41)
    model.forward(build_batch(False, [list(range(300, 340))], [0], [slots], [slots], "cpu"), pool)
    slots = torch.cat([slots, torch.tensor([50])])
    return model.forward(build_batch(True, [[500]], [40], [slots], [slots[-1:]], "cpu"), pool)


def _spans(model: Model) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
            for x in model.decode_linears() for t in x.kernel_tensors()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_weights_lie_in_one_buffer_in_step_order(dtype):
    model = _model(dtype)
    arena = model.weight_arena
    assert arena is not None and arena.buffer.data_ptr() % HUGE_PAGE == 0
    start, end = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.buffer.numel()
    spans = _spans(model)
    # every linear the step runs (qkv, o, gate_up, down per layer, then the head)
    assert len(spans) == 4 * model.config.num_layers + 1
    assert all(start <= a and b <= end and a % 64 == 0 for a, b in spans)
    assert all(b <= a2 for (_, b), (a2, _) in zip(spans, spans[1:])), "not in step order"


def test_moving_keeps_every_value_and_the_logits():
    model = _model(torch.bfloat16)
    before = [t.clone() for x in model.decode_linears() for t in x.kernel_tensors()]
    want = _logits(model)
    old = _spans(model)
    arena = pack_decode_weights(model.decode_linears())
    assert _spans(model) != old  # moved into the new buffer
    assert arena.buffer.data_ptr() <= _spans(model)[0][0]
    after = [t for x in model.decode_linears() for t in x.kernel_tensors()]
    for a, b in zip(before, after, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(_logits(model), want)


def test_a_full_arena_says_so():
    arena = Arena(256)
    arena.place(torch.ones(40, dtype=torch.float32))  # 160 bytes, the next at 192
    with pytest.raises(ValueError, match="arena of 256 bytes is full: 160 more"):
        arena.place(torch.ones(40, dtype=torch.float32))
