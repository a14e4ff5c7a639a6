"""`sgl-nb serve`'s SGLang-native side: /generate and /get_model_info, in the shapes SGLang
documents (GenerateReqInput, sampling_params, meta_info; a stream's events carry the text
so far)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

from sgl_nb.logprob_meta import prompt_token_logprobs
from sgl_nb.serve_openai import BadRequest

# SGLang's sampling_params name -> ours (the rest are the same or not offered).
_RENAMED = {"max_new_tokens": "max_tokens", "sampling_seed": "seed",
            "min_new_tokens": "min_tokens"}
_SAME = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
         "regex", "json_schema", "frequency_penalty", "presence_penalty", "repetition_penalty")
_IGNORED = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n")


def model_info(server) -> dict:
    path = str(server.runtime.model_path)
    return {"model_path": path, "tokenizer_path": path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False}


def _params(sp: dict | None) -> dict:
    sp = dict(sp or {})
    out = {"max_tokens": 128, "temperature": 1.0}  # SGLang's fallback defaults
    for key, value in sp.items():
        if value is None or key in _IGNORED:
            continue
        if key in _RENAMED:
            out[_RENAMED[key]] = value
        elif key in _SAME:
            out[key] = value
        else:
            raise BadRequest(f"sampling_params.{key} is not supported by sgl-nb serve")
    if isinstance(out.get("json_schema"), str):
        out["json_schema"] = json.loads(out["json_schema"])
    return out


def generate(server, body: dict):
    rt = server.runtime
    if body.get("text") is not None:
        prompts, batch = body["text"], isinstance(body["text"], list)
        ids = [rt.tokenizer.encode(t) for t in (prompts if batch else [prompts])]
    elif body.get("input_ids") is not None:
        prompts = body["input_ids"]
        batch = bool(prompts) and isinstance(prompts[0], list)
        ids = [list(p) for p in (prompts if batch else [prompts])]
    else:
        raise BadRequest("give text or input_ids")
    params = _params(body.get("sampling_params"))
    if body.get("stream") and batch:
        raise BadRequest("stream=True takes one prompt in sgl-nb serve")
    start = body.get("logprob_start_len")
    start = -1 if start is None else int(start)
    want_lp = bool(body.get("return_logprob"))
    if want_lp:
        params.update(logprobs=True, top_logprobs=int(body.get("top_logprobs_num") or 0))
    if body.get("stream"):
        return _stream(rt, ids[0], params, want_lp, start)
    answers = [_one(rt, i, params, want_lp, start) for i in ids]
    return answers if batch else answers[0]


def _one(rt, ids: list[int], params: dict, want_lp: bool, start: int) -> dict:
    """max_new_tokens=0 only scores the prompt (what a select sends)."""
    rid = uuid.uuid4().hex
    gen = params.get("max_tokens", 128)
    handle = rt.submit(ids, **params) if gen > 0 else None
    meta = {"id": rid, "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 0}, "e2e_latency": 0.0}
    text, out_ids = "", []
    if handle is not None:
        out = handle.result()
        text, out_ids = out.text, out.token_ids
        meta.update(_meta(out.meta), **_output_logprobs(out))
    if want_lp and start >= 0:
        meta["input_token_logprobs"] = input_logprobs(rt, ids, start)
    return {"text": text, "output_ids": out_ids, "meta_info": meta}


def _output_logprobs(out) -> dict:
    """SGLang's meta_info lists, [logprob, token id, None] each (no text asked)."""
    if out.logprobs is None:
        return {}
    meta = {"output_token_logprobs": [[x, t, None] for x, t in zip(out.logprobs,
                                                                  out.token_ids)]}
    if out.top_logprobs is not None:
        meta["output_top_logprobs"] = [[[x, t, None] for t, x in alts]
                                       for alts in out.top_logprobs]
    return meta


def input_logprobs(rt, ids: list[int], start: int) -> list:
    """[logprob, token id, None] for each prompt token from `start` on (None at 0)."""
    return [[lp, t, None] for lp, t in prompt_token_logprobs(rt, ids, start)]


def _meta(m: dict) -> dict:
    reason = m.get("finish_reason")
    if reason == "stop":
        fr = {"type": "stop", "matched": m.get("matched_stop")}
    else:
        fr = {"type": reason, "length": m.get("completion_tokens")}
    return {"prompt_tokens": m["prompt_tokens"], "completion_tokens": m["completion_tokens"],
            "cached_tokens": m.get("cached_tokens") or 0, "finish_reason": fr,
            "e2e_latency": m.get("e2e_latency")}


def _stream(rt, ids: list[int], params: dict, want_lp: bool, start: int) -> Iterator[dict]:
    rid = uuid.uuid4().hex
    handle = rt.submit(ids, stream=True, **params)
    text = ""
    for chunk in handle.chunks():
        text += chunk
        yield {"text": text, "meta_info": {"id": rid, "finish_reason": None,
                                           "prompt_tokens": len(ids)}}
    out = handle.result()
    meta = {"id": rid, **_meta(out.meta), **_output_logprobs(out)}
    if want_lp and start >= 0:
        meta["input_token_logprobs"] = input_logprobs(rt, ids, start)
    yield {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}
