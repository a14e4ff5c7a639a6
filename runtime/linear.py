"""The model runner's linear layers, behind one call: y = layer(x)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseLinear:
    """Plain weight matmul (fp32 or bf16 weights), optional bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
