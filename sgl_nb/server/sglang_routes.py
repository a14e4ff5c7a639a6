"""SGLang's native routes: /generate, /get_model_info, /get_server_info and /flush_cache,
in the shapes SGLang documents (GenerateReqInput, sampling_params, meta_info; a stream's
events carry the text so far)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

from sgl_nb.language.logprob_meta import prompt_token_logprobs
from sgl_nb.server.errors import BadRequest
from sgl_nb.server.replies import Answer, Served, Stream
from sgl_nb.server.requests_common import refuse_unsupported
from sgl_nb.server.requests_sglang import GenerateRequest, SGLangSamplingParams


def model_info(served: Served) -> dict:
    path = str(served.runtime.model_path)
    return {"model_path": path, "tokenizer_path": path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False}


def flush_cache(served: Served) -> Answer:
    return Answer(lambda: {"flushed_tokens": served.runtime.flush_cache()})


def _params(sp: SGLangSamplingParams) -> dict:
    refuse_unsupported(sp.unsupported())
    out = sp.engine_params()
    if isinstance(out.get("json_schema"), str):
        try:
            out["json_schema"] = json.loads(out["json_schema"])
        except ValueError as e:
            raise BadRequest(f"sampling_params.json_schema is not valid JSON: {e}") from e
    return out


class _Options:
    """What one /generate asks for besides sampling: logprobs, from where, with text."""

    def __init__(self, body: GenerateRequest):
        self.want_lp = body.return_logprob
        self.start = -1 if body.logprob_start_len is None else body.logprob_start_len
        self.top = body.top_logprobs_num or 0
        self.with_text = body.return_text_in_logprobs


def generate(served: Served, body: GenerateRequest) -> Answer | Stream:
    refuse_unsupported(body.unsupported())
    rt = served.runtime
    if body.text is not None:
        texts = body.text if body.batch else [body.text]
        ids = [rt.tokenizer.encode(t) for t in texts]
    else:
        ids = [list(p) for p in (body.input_ids if body.batch else [body.input_ids])]
    if body.stream and body.batch:
        raise BadRequest("stream=True takes one prompt in sgl-nb serve")
    opts = _Options(body)
    params = [_params(sp) for sp in body.sampling_for(len(ids))]
    if opts.want_lp:
        for p in params:
            p.update(logprobs=True, top_logprobs=opts.top)
    rids = _rids(body, len(ids))
    # max_new_tokens=0 only scores the prompt (what a select sends): no engine request.
    gen = [i for i, p in enumerate(params) if p["max_tokens"] > 0]
    handles = served.submit_all([ids[i] for i in gen], [params[i] for i in gen],
                                stream=body.stream)
    by_index = dict(zip(gen, handles))
    if body.stream:
        if not handles:
            raise BadRequest("stream=True needs sampling_params.max_new_tokens > 0")
        return Stream(_stream(rt, rids[0], ids[0], handles[0], opts), handles)

    def build() -> dict | list:
        answers = [_one(rt, rids[i], ids[i], by_index.get(i), opts) for i in range(len(ids))]
        return answers if body.batch else answers[0]

    return Answer(build, handles)


def _rids(body: GenerateRequest, n: int) -> list[str]:
    rid = body.rid
    if isinstance(rid, list):
        if len(rid) != n:
            raise BadRequest(f"rid: {len(rid)} given for {n} prompts")
        return list(rid)
    if rid is not None and n > 1:
        raise BadRequest(f"rid: give a list of {n} ids for a batch")
    return [rid or uuid.uuid4().hex for _ in range(n)]


def _one(rt, rid: str, ids: list[int], handle, opts: _Options) -> dict:
    meta = {"id": rid, "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 0}, "e2e_latency": 0.0}
    text, out_ids = "", []
    if handle is not None:
        out = handle.result()
        text, out_ids = out.text, out.token_ids
        meta.update(_meta(out.meta), **_output_logprobs(rt, out, opts.with_text))
    if opts.want_lp and opts.start >= 0:
        meta["input_token_logprobs"] = input_logprobs(rt, ids, opts.start, opts.with_text)
    return {"text": text, "output_ids": out_ids, "meta_info": meta}


def _entry(rt, logprob: float | None, token: int, with_text: bool) -> list:
    return [logprob, token, rt.tokenizer.decode([token]) if with_text else None]


def _output_logprobs(rt, out, with_text: bool) -> dict:
    """SGLang's meta_info lists, [logprob, token id, text or None] each."""
    if out.logprobs is None:
        return {}
    meta = {"output_token_logprobs": [_entry(rt, x, t, with_text)
                                      for x, t in zip(out.logprobs, out.token_ids)]}
    if out.top_logprobs is not None:
        meta["output_top_logprobs"] = [[_entry(rt, x, t, with_text) for t, x in alts]
                                       for alts in out.top_logprobs]
    return meta


def input_logprobs(rt, ids: list[int], start: int, with_text: bool = False) -> list:
    """[logprob, token id, text or None] for each prompt token from `start` on (None at
    0)."""
    return [_entry(rt, lp, t, with_text) for lp, t in prompt_token_logprobs(rt, ids, start)]


def _meta(m: dict) -> dict:
    reason = m.get("finish_reason")
    if reason == "stop":
        fr = {"type": "stop", "matched": m.get("matched_stop")}
    else:
        fr = {"type": reason, "length": m.get("completion_tokens")}
    return {"prompt_tokens": m["prompt_tokens"], "completion_tokens": m["completion_tokens"],
            "cached_tokens": m.get("cached_tokens") or 0, "finish_reason": fr,
            "e2e_latency": m.get("e2e_latency")}


def _stream(rt, rid: str, ids: list[int], handle, opts: _Options) -> Iterator[dict]:
    text = ""
    for chunk in handle.chunks():
        text += chunk
        yield {"text": text, "meta_info": {"id": rid, "finish_reason": None,
                                           "prompt_tokens": len(ids)}}
    out = handle.result()
    meta = {"id": rid, **_meta(out.meta), **_output_logprobs(rt, out, opts.with_text)}
    if opts.want_lp and opts.start >= 0:
        meta["input_token_logprobs"] = input_logprobs(rt, ids, opts.start, opts.with_text)
    yield {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}
