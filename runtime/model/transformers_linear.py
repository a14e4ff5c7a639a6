"""int8/int4 weight-only quantization on the transformers path: each linear layer of the
decoder (torch's nn.Linear, and transformers' Conv1D of GPT-2-like models) is swapped for
our Linear (linear.make_linear: the kernels, shape rules and probe-process checks the native
runner uses). The embeddings and the LM head stay 16-bit: the head ranks the next token, and
a tied head is the embedding itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sgl_nb.runtime.model.linear import Linear, check_kernels, make_linear, shape_error
from sgl_nb.runtime.model.model_loader import load_quantized
from sgl_nb.runtime.model.quantize import quantize


class OurLinear(nn.Module):
    """An nn.Module face for our Linear, which takes [T, K]: the modeling code passes
    [batch, T, K]."""

    def __init__(self, layer: Linear):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self.layer(x.reshape(-1, x.shape[-1])).view(*lead, -1)


def linear_weights(hf) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(module name, weight [out, in], bias) of every linear layer but the LM head."""
    head = hf.get_output_embeddings()
    found = []
    for name, module in hf.named_modules():
        if module is head:
            continue
        if isinstance(module, nn.Linear):
            found.append((name, module.weight, module.bias))
        elif type(module).__name__ == "Conv1D":  # transformers' [in, out] linear (GPT-2)
            found.append((name, module.weight.t(), module.bias))
    return found


def quantize_linears(hf, quantization: str, dtype: torch.dtype, device: torch.device,
                     folder: Path) -> dict[str, str]:
    """Swap hf's linear layers for quantized ones, in place; returns {layer: why it stayed
    dense} for those no kernel takes. The quantized weights are built once per checkpoint
    `folder` and kept in the cache, as the native runner's are."""
    layers = linear_weights(hf)

    def build(blocks) -> dict[str, dict[str, torch.Tensor]]:  # a GGUF's own, if any
        return {name: quantize(w.detach().float(), quantization, blocks) for name, w, _ in layers
                if shape_error(*w.shape, quantization) is None}

    quantized = load_quantized(folder, quantization, build, runner="transformers")
    check_kernels([(quantization, t) for t in quantized.values()], dtype, device)
    fallbacks = {}
    for name, weight, bias in layers:
        b = None if bias is None else bias.detach()
        layer, why = make_linear(weight.detach(), b, dtype, device, quantization,
                                 quantized.get(name))
        if why is not None:
            fallbacks[name] = why
        hf.set_submodule(name, OurLinear(layer))
    return fallbacks
