"""A sparse mixture-of-experts MLP block (Qwen3-MoE's): a router picks `top_k` experts per
token and each expert, a gated MLP, runs only on the tokens routed to it.

The arithmetic is transformers' Qwen3MoeSparseMoeBlock (5.24), step for step: router logits
in the activations' dtype, softmax in fp32, top-k, the k weights renormalised to sum to 1
when `norm_topk_prob`, then cast back to the activations' dtype; expert e computes
down(act(gate(x)) * up(x)) * weight on its tokens, and the experts' outputs are added into
the result in ascending expert order (the order matters in bf16: each add rounds).

Each expert is two linear layers from runtime/model/linear.py's make_linear (gate and up
fused along the output dimension, then down), so bf16, int8 and int4 work, with the dense
fallback where linear.shape_error or the kernel check says so. The router stays dense, in
the activations' dtype: it is [num_experts, hidden], small, and its top-k decides which
experts run at all.

The runner's API:

    for name, weight, bias in expert_linear_weights(weights, "model.layers.3.mlp.",
                                                    "layers.3", num_experts):
        ...  # quantize_weights / load_quantized cache them under these names:
             # "layers.3.experts.{e}.gate_up" [2 * I, hidden] and "layers.3.experts.{e}.down"
             # [hidden, I]
    moe, fallbacks = moe_from_weights(weights, "model.layers.3.mlp.", "layers.3",
                                      num_experts, top_k, norm_topk_prob, dtype, device,
                                      quantization, quantized)
    h = moe(h)  # [T, hidden] -> [T, hidden]

`weights` holds a checkpoint's tensors by name in either layout transformers reads: one
tensor per expert and projection (`{prefix}experts.{e}.gate_proj.weight`, `up_proj`,
`down_proj`: what save_pretrained writes, in 5.24 as before) or the fused 3D tensors of
transformers 5's modules (`{prefix}experts.gate_up_proj` [E, 2 * I, hidden], gate rows
first, and `{prefix}experts.down_proj` [E, hidden, I]: a state_dict). The router is
`{prefix}gate.weight` [E, hidden].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_nb.runtime.model.linear import Linear, check_kernels, make_linear

Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class MoE:
    router: torch.Tensor  # [num_experts, hidden], the activations' dtype
    experts: list[tuple[Linear, Linear]]  # per expert: (gate_up [2 * I], down [hidden])
    top_k: int
    norm_topk_prob: bool
    activation: Activation = F.silu

    def __post_init__(self) -> None:
        if len(self.experts) != self.router.shape[0]:
            raise ValueError(f"the router scores {self.router.shape[0]} experts, "
                             f"but {len(self.experts)} experts were given")
        if not 1 <= self.top_k <= len(self.experts):
            raise ValueError(f"top_k must be between 1 and the number of experts "
                             f"({len(self.experts)}), got {self.top_k}")

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top_k experts [T, k] (int64) and their weights [T, k] (h's dtype)."""
        logits = F.linear(h, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(h.dtype)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(h)
        out = torch.zeros_like(h)
        # The (token, slot) pairs grouped by expert, tokens ascending within a group.
        chosen = experts.view(-1)
        order = chosen.argsort(stable=True)
        tokens = order // self.top_k
        slot_weights = weights.view(-1).index_select(0, order)
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()  # one sync
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            y = self.expert(e, h.index_select(0, rows))
            out.index_add_(0, rows, y * slot_weights[start:start + n, None])
            start += n
        return out

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.experts[e]
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(self.activation(gate) * up)


def router_weight(weights: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return _tensor(weights, f"{prefix}gate.weight")


def expert_linear_weights(
    weights: dict[str, torch.Tensor], prefix: str, name: str, num_experts: int
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, weight, bias) of every expert linear as the block computes it: gate and up
    fused along the output dimension ([2 * I, hidden]), then down ([hidden, I]); named
    f"{name}.experts.{e}.gate_up" / ".down" (the names `quantized` is keyed by)."""
    hidden = router_weight(weights, prefix).shape[1]
    for e in range(num_experts):
        gate_up, down = _expert_tensors(weights, prefix, e, hidden)
        yield f"{name}.experts.{e}.gate_up", gate_up, None
        yield f"{name}.experts.{e}.down", down, None


def moe_from_weights(
    weights: dict[str, torch.Tensor],
    prefix: str,
    name: str,
    num_experts: int,
    top_k: int,
    norm_topk_prob: bool,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str | None = None,
    quantized: dict[str, dict[str, torch.Tensor]] | None = None,
    activation: Activation = F.silu,
) -> tuple[MoE, dict[str, str]]:
    """The block of the checkpoint tensors under `prefix` (e.g. "model.layers.3.mlp."),
    its expert linears named under `name` (e.g. "layers.3", see expert_linear_weights) and
    looked up by those names in `quantized` (a name absent from it stays dense). Returns the
    block and {linear name: why it stayed dense} for those that fell back."""
    device = torch.device(device)
    router = router_weight(weights, prefix)
    if router.shape[0] != num_experts:
        raise ValueError(f"{prefix}gate.weight has {router.shape[0]} rows (experts), "
                         f"the config says num_experts={num_experts}")
    named = list(expert_linear_weights(weights, prefix, name, num_experts))
    if quantization is not None and quantized:
        # Every expert's kernel and shape checked in one probe process, not one per layer.
        check_kernels([(quantization, quantized[n]) for n, _, _ in named if n in quantized],
                      dtype, device)
    linears: list[Linear] = []
    fallbacks: dict[str, str] = {}
    for linear_name, weight, bias in named:
        q = None if quantized is None else quantized.get(linear_name)
        layer, why = make_linear(weight, bias, dtype, device, quantization, q)
        linears.append(layer)
        if why is not None:
            fallbacks[linear_name] = why
    experts = list(zip(linears[0::2], linears[1::2], strict=True))
    moe = MoE(router.to(device=device, dtype=dtype), experts, top_k, norm_topk_prob, activation)
    return moe, fallbacks


def _expert_tensors(
    weights: dict[str, torch.Tensor], prefix: str, e: int, hidden: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's (gate_up [2 * I, hidden], down [hidden, I]) in either checkpoint layout."""
    fused = f"{prefix}experts.gate_up_proj"
    if fused in weights:
        gate_up = _expert_slice(weights, fused, e)
        down = _expert_slice(weights, f"{prefix}experts.down_proj", e)
        where = f"{fused}[{e}]", f"{prefix}experts.down_proj[{e}]"
    else:
        per = f"{prefix}experts.{e}."
        gate = _tensor(weights, per + "gate_proj.weight", fused)
        up = _tensor(weights, per + "up_proj.weight")
        if gate.shape != up.shape:
            raise ValueError(f"{per}gate_proj.weight is {list(gate.shape)} but "
                             f"{per}up_proj.weight is {list(up.shape)}")
        gate_up = torch.cat([gate, up])
        down = _tensor(weights, per + "down_proj.weight")
        where = f"{per}gate_proj/up_proj.weight", f"{per}down_proj.weight"
    inter = gate_up.shape[0] // 2
    if gate_up.dim() != 2 or gate_up.shape != (2 * inter, hidden):
        raise ValueError(f"{where[0]} is {list(gate_up.shape)}, expected [2 * I, {hidden}] "
                         f"(hidden size {hidden} from the router)")
    if down.shape != (hidden, inter):
        raise ValueError(f"{where[1]} is {list(down.shape)}, expected [{hidden}, {inter}]")
    return gate_up, down


def _expert_slice(weights: dict[str, torch.Tensor], key: str, e: int) -> torch.Tensor:
    t = _tensor(weights, key)
    if t.dim() != 3 or t.shape[0] <= e:
        raise ValueError(f"{key} is {list(t.shape)}: expected a 3D tensor, one matrix per "
                         f"expert, with at least {e + 1} experts")
    return t[e]


def _tensor(weights: dict[str, torch.Tensor], key: str,
            alternative: str | None = None) -> torch.Tensor:
    if key in weights:
        return weights[key]
    other = f" (nor {alternative})" if alternative else ""
    raise KeyError(f"the checkpoint has no tensor {key}{other}")
