"""`sgl-nb serve`'s OpenAI-compatible side: /v1/models, /v1/completions and
/v1/chat/completions, with the vLLM extensions RuntimeEndpoint uses (top_k, min_p,
stop_token_ids, ignore_eos, min_tokens, repetition_penalty, structured_outputs / guided_*,
prompt_logprobs, return_token_ids)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from sgl_nb.logprob_meta import prompt_token_logprobs


class BadRequest(ValueError):
    """The request is malformed or asks for something this server does not offer."""


def models(server) -> dict:
    rt = server.runtime
    return {"object": "list", "data": [{
        "id": server.model_name, "object": "model", "created": int(time.time()),
        "owned_by": "sgl-nb", "root": str(rt.model_path),
        "max_model_len": rt.engine.context_len}]}


def sampling(body: dict, chat: bool = False) -> dict:
    """SamplingParams fields from an OpenAI request (OpenAI's defaults where absent)."""
    _refuse_unsupported(body)
    # OpenAI's defaults: 16 tokens for a completion; a chat answer gets room to finish.
    max_tokens = (body.get("max_completion_tokens") if chat else None) or body.get(
        "max_tokens") or (512 if chat else 16)
    params = {"max_tokens": max_tokens,
              "temperature": _num(body, "temperature", 1.0),
              "top_p": _num(body, "top_p", 1.0),
              "top_k": int(body.get("top_k") if body.get("top_k") is not None else -1),
              "min_p": _num(body, "min_p", 0.0), "seed": body.get("seed"),
              "stop": body.get("stop") or [], "stop_token_ids": body.get("stop_token_ids") or [],
              "ignore_eos": bool(body.get("ignore_eos", False)),
              "frequency_penalty": _num(body, "frequency_penalty", 0.0),
              "presence_penalty": _num(body, "presence_penalty", 0.0),
              "repetition_penalty": _num(body, "repetition_penalty", 1.0),
              "min_tokens": int(body.get("min_tokens") or 0)}
    logprobs = body.get("top_logprobs") if chat else body.get("logprobs")
    if (chat and body.get("logprobs")) or (not chat and logprobs is not None):
        params["logprobs"], params["top_logprobs"] = True, int(logprobs or 0)
    params.update(_structured(body))
    return params


def _refuse_unsupported(body: dict) -> None:
    for what, asked in (("echo", bool(body.get("echo"))), ("n > 1", (body.get("n") or 1) != 1),
                        ("best_of > 1", (body.get("best_of") or 1) != 1),
                        ("suffix", bool(body.get("suffix"))), ("tools", bool(body.get("tools")))):
        if asked:
            raise BadRequest(f"{what} is not supported by sgl-nb serve")


def _num(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    return default if value is None else float(value)


def _structured(body: dict) -> dict:
    so = body.get("structured_outputs") or {}
    regex = so.get("regex", body.get("guided_regex"))
    schema = so.get("json", body.get("guided_json"))
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
    elif fmt.get("type") == "json_object":
        schema = {"type": "object"}
    out = {}
    if regex is not None:
        out["regex"] = regex
    if schema is not None:
        out["json_schema"] = schema
    return out


# ---- /v1/completions ---------------------------------------------------------------------

def completion(server, body: dict):
    prompts = _prompts(body.get("prompt"))
    params = sampling(body)
    stream = bool(body.get("stream"))
    if stream and len(prompts) > 1:
        raise BadRequest("stream=True takes one prompt in sgl-nb serve")
    rt, want_ids = server.runtime, bool(body.get("return_token_ids"))
    ids = [p if isinstance(p, list) else rt.tokenizer.encode(p) for p in prompts]
    handles = [rt.submit(i, stream=stream, **params) for i in ids]  # checked, then queued
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": server.model_name}
    if stream:
        return _stream_completion(head, handles[0], want_ids,
                                  (body.get("stream_options") or {}).get("include_usage"))
    plp = body.get("prompt_logprobs")
    choices, usage = [], _Usage()
    for i, (h, prompt_ids) in enumerate(zip(handles, ids)):
        out = h.result()
        usage.add(out.meta)
        choice = {"index": i, "text": out.text, "finish_reason": out.meta["finish_reason"],
                  "stop_reason": _stop_reason(out.meta), "logprobs": _logprobs(rt, out)}
        if want_ids:
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = prompt_ids
        if plp is not None:
            choice["prompt_logprobs"] = prompt_logprobs(rt, prompt_ids)
        choices.append(choice)
    return {**head, "choices": choices, "usage": usage.as_dict()}


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return list(prompt)
    raise BadRequest("prompt must be a string, a list of token ids, or a list of those")


def _stream_completion(head: dict, handle, want_ids: bool, include_usage) -> Iterator[dict]:
    def event(text: str, finish=None, stop=None, ids=None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                  "stop_reason": stop}
        if ids is not None:
            choice["token_ids"] = ids
        return {**head, "choices": [choice]}

    for chunk in handle.chunks():
        yield event(chunk)
    out = handle.result()
    yield event("", out.meta["finish_reason"], _stop_reason(out.meta),
                out.token_ids if want_ids else None)
    if include_usage:
        yield {**head, "choices": [], "usage": _Usage().add(out.meta).as_dict()}


def prompt_logprobs(rt, ids: list[int]) -> list:
    """vLLM's shape: None for the first token, then {token id: {logprob, rank, decoded}}."""
    return [None if lp is None else
            {str(t): {"logprob": lp, "rank": None, "decoded_token": rt.tokenizer.decode([t])}}
            for lp, t in prompt_token_logprobs(rt, ids, 0)]


def _logprobs(rt, out) -> dict | None:
    if out.logprobs is None:
        return None
    tokens = [rt.tokenizer.decode([t]) for t in out.token_ids]
    top = [{rt.tokenizer.decode([t]): lp for t, lp in alts} for alts in out.top_logprobs or []]
    return {"tokens": tokens, "token_logprobs": out.logprobs, "top_logprobs": top or None}


def _stop_reason(meta: dict):
    return meta.get("matched_stop") if meta.get("finish_reason") == "stop" else None


class _Usage:
    def __init__(self):
        self.prompt = self.completion = self.cached = 0

    def add(self, meta: dict) -> _Usage:
        self.prompt += meta["prompt_tokens"]
        self.completion += meta["completion_tokens"]
        self.cached += meta.get("cached_tokens") or 0
        return self

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached}}


# ---- /v1/chat/completions ------------------------------------------------------------------

def chat_completion(server, body: dict):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}")
    rt = server.runtime
    prompt = rt.apply_chat_template([_message(m) for m in messages])
    params = sampling(body, chat=True)
    stream = bool(body.get("stream"))
    handle = rt.submit(rt.tokenizer.encode(prompt), stream=stream, **params)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": server.model_name}
    if stream:
        return _stream_chat(head, handle, (body.get("stream_options") or {}).get("include_usage"))
    out = handle.result()
    return {**head, "object": "chat.completion", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": out.text},
        "finish_reason": out.meta["finish_reason"], "logprobs": None}],
        "usage": _Usage().add(out.meta).as_dict()}


def _message(m) -> dict:
    if not isinstance(m, dict) or "role" not in m:
        raise BadRequest(f"each message needs a role and content, got {m!r}")
    content = m.get("content") or ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if any(p.get("type") != "text" for p in content):
            raise BadRequest("only text message parts are supported by sgl-nb serve")
        content = "".join(p.get("text", "") for p in content)
    return {"role": m["role"], "content": content}


def _stream_chat(head: dict, handle, include_usage) -> Iterator[dict]:
    head = {**head, "object": "chat.completion.chunk"}

    def event(delta: dict, finish=None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}

    yield event({"role": "assistant", "content": ""})
    for chunk in handle.chunks():
        yield event({"content": chunk})
    out = handle.result()
    yield event({}, out.meta["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": _Usage().add(out.meta).as_dict()}
