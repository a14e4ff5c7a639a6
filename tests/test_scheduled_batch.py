"""How make_batch shapes an extend step (runtime/scheduled_batch.py): a short prompt chunk
runs decode-shaped where the model has the fused CPU step (each token a row whose KV range
ends at itself, the LM head on its last row only); a longer one, a scored one, or any on a
model without that step runs as an extend."""

from __future__ import annotations

import torch

from sgl_nb.runtime.request import Request
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.runtime.scheduled_batch import PROMPT_AS_DECODES, make_batch

CPU = torch.device("cpu")


def prompt(n: int, first_slot: int = 1) -> Request:
    req = Request(list(range(10, 10 + n)), SamplingParams(), max_new_tokens=4)
    req.slots = torch.arange(first_slot, first_slot + n)
    return req


def test_a_short_prompt_step_runs_decode_shaped():
    a, b = prompt(20), prompt(7, first_slot=100)
    batch = make_batch(False, [(a, 20), (b, 7)], CPU, drafts_as_decodes=True)
    fb = batch.forward
    assert fb.is_decode and not batch.is_decode  # a prefill, computed as decode rows
    assert fb.input_ids.tolist() == a.prompt_ids + b.prompt_ids
    assert fb.logits_at.tolist() == [19, 26]  # each request's last row
    assert fb.kv_indptr.tolist()[:4] == [0, 1, 3, 6]  # row t sees its first t + 1 slots
    assert fb.kv_indices[fb.kv_indptr[26] : fb.kv_indptr[27]].tolist() == list(range(100, 107))


def test_a_long_or_scored_prompt_or_no_fused_step_runs_as_an_extend():
    long = prompt(PROMPT_AS_DECODES + 1)
    assert not make_batch(False, [(long, long.fill_len)], CPU, True).forward.is_decode
    assert not make_batch(False, [(prompt(20), 20)], CPU, False).forward.is_decode
    scored = prompt(20)
    scored.logprob_start = 5
    assert not make_batch(False, [(scored, 20)], CPU, True).forward.is_decode
