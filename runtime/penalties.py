"""What a request's own settings and history do to its next-token logits: its logit bias,
the penalties on tokens already seen, and the stop tokens held back until min_tokens."""

from __future__ import annotations

import torch

from sgl_nb.runtime.sampling_params import SamplingParams


@torch.inference_mode()  # the model's logits are inference tensors: edited in place here
def adjust_logits(logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int],
                  output_ids: list[int], stop_ids: list[int]) -> None:
    """One row of fp32 logits, in place, before the grammar mask and sampling (so greedy
    decoding sees the penalties too). The logit bias comes first (as in vLLM), so a penalty
    scales a biased logit. Formulas as OpenAI (frequency, presence: output tokens only) and as
    transformers' RepetitionPenaltyLogitsProcessor (prompt and output)."""
    vocab = logits.numel()
    if p.logit_bias:  # ids were checked against the vocabulary when the request was made
        logits[torch.tensor(list(p.logit_bias), dtype=torch.long)] += torch.tensor(
            list(p.logit_bias.values()), dtype=logits.dtype)
    if len(output_ids) < p.min_tokens and stop_ids:
        logits[torch.tensor([t for t in stop_ids if t < vocab], dtype=torch.long)] = -torch.inf
    if (p.frequency_penalty or p.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids), minlength=vocab)[:vocab].float()
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if t < vocab}),
                            dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                   vals * p.repetition_penalty)
