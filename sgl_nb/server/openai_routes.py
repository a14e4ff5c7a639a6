"""The OpenAI-compatible routes: /v1/models, /v1/completions and /v1/chat/completions, with
the vLLM extensions RuntimeEndpoint uses. Each runs in a worker thread, submits its engine
requests and returns an Answer or a Stream (see replies.py)."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator

from sgl_nb.language.logprob_meta import prompt_token_logprobs
from sgl_nb.server import tool_calls
from sgl_nb.server.errors import BadRequest
from sgl_nb.server.replies import Answer, Served, Stream
from sgl_nb.server.requests_common import refuse_unsupported
from sgl_nb.server.requests_openai import ChatCompletionRequest, CompletionRequest, Sampling
from sgl_nb.server.tool_calls import (
    ChatTemplate,
    ToolUse,
    template_messages,
    template_of,
    template_tools,
    tool_use,
)
from sgl_nb.server.tool_parsers import PlainReader, Reader


def models(served: Served) -> dict:
    rt = served.runtime
    return {"object": "list", "data": [{
        "id": served.model_name, "object": "model", "created": int(time.time()),
        "owned_by": "sgl-nb", "root": str(rt.model_path),
        "max_model_len": rt.engine.context_len}]}


def sampling(body: Sampling, max_tokens: int | None, default_max: int) -> dict:
    """SamplingParams fields from an OpenAI request (OpenAI's defaults where absent)."""
    refuse_unsupported(body.unsupported())
    params = {"max_tokens": max_tokens or default_max,
              "temperature": _or(body.temperature, 1.0), "top_p": _or(body.top_p, 1.0),
              "top_k": _or(body.top_k, -1), "min_p": _or(body.min_p, 0.0), "seed": body.seed,
              "stop": body.stop or [], "stop_token_ids": body.stop_token_ids or [],
              "ignore_eos": body.ignore_eos,
              "frequency_penalty": _or(body.frequency_penalty, 0.0),
              "presence_penalty": _or(body.presence_penalty, 0.0),
              "repetition_penalty": _or(body.repetition_penalty, 1.0),
              "min_tokens": _or(body.min_tokens, 0)}
    params.update(_structured(body))
    return params


def _or(value, default):
    return default if value is None else value


def _structured(body: Sampling) -> dict:
    so = body.structured_outputs
    regex = so.regex if so and so.regex is not None else body.guided_regex
    schema = so.json_ if so and so.json_ is not None else body.guided_json
    if so and so.json_object:
        schema = {"type": "object"}
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise BadRequest("response_format.json_schema.schema is required for type "
                             "json_schema")
        schema = fmt.json_schema.schema_
    elif fmt is not None and fmt.type == "json_object":
        schema = {"type": "object"}
    out = {}
    if regex is not None:
        out["regex"] = regex
    if schema is not None:
        out["json_schema"] = schema
    return out


def _include_usage(body: Sampling) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# ---- /v1/completions ---------------------------------------------------------------------

def completion(served: Served, body: CompletionRequest) -> Answer | Stream:
    params = sampling(body, body.max_tokens, 16)
    if body.logprobs is not None:
        params["logprobs"], params["top_logprobs"] = True, body.logprobs
    prompts = body.prompt
    if body.stream and len(prompts) > 1:
        raise BadRequest("stream=True takes one prompt in sgl-nb serve")
    rt = served.runtime
    special = True if body.add_special_tokens is None else body.add_special_tokens
    ids = [p if isinstance(p, list) else rt.tokenizer.encode(p, add_special_tokens=special)
           for p in prompts]
    handles = served.submit_all(ids, [params] * len(ids), stream=body.stream)
    head = {"id": f"cmpl-{body.request_id or uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": served.model_name}
    if body.stream:
        return Stream(_stream_completion(head, handles[0], body.return_token_ids,
                                         _include_usage(body)), handles)
    return Answer(lambda: _completion_answer(rt, head, handles, ids, body), handles)


def _completion_answer(rt, head: dict, handles: list, ids: list[list[int]],
                       body: CompletionRequest) -> dict:
    choices, usage = [], _Usage()
    for i, (h, prompt_ids) in enumerate(zip(handles, ids)):
        out = h.result()
        usage.add(out.meta)
        choice = {"index": i, "text": out.text, "finish_reason": out.meta["finish_reason"],
                  "stop_reason": _stop_reason(out.meta), "logprobs": _logprobs(rt, out)}
        if body.return_token_ids:
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = prompt_ids
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(rt, prompt_ids)
        choices.append(choice)
    return {**head, "choices": choices, "usage": usage.as_dict()}


def _stream_completion(head: dict, handle, want_ids: bool, include_usage: bool
                       ) -> Iterator[dict]:
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

def chat_completion(served: Served, body: ChatCompletionRequest) -> Answer | Stream:
    # A chat answer gets room to finish (OpenAI's own default is the context's end).
    params = sampling(body, body.max_completion_tokens or body.max_tokens, 512)
    if body.logprobs:
        params["logprobs"], params["top_logprobs"] = True, body.top_logprobs or 0
    rt = served.runtime
    template = template_of(rt.tokenizer)
    tools = tool_use(body, lambda schema: rt.check_grammar(None, schema))
    if tools is not None and tools.forced:
        if "json_schema" in params or "regex" in params:
            raise BadRequest("tool_choice 'required' or a named function constrains the "
                             "output to calls: it cannot be combined with response_format "
                             "or structured outputs")
        params["json_schema"] = tools.schema()
    prompt = _chat_prompt(rt, body, template, tools)
    special = True if body.add_special_tokens is None else body.add_special_tokens
    handle = served.submit(rt.tokenizer.encode(prompt, add_special_tokens=special), params,
                           stream=body.stream)
    head = {"id": f"chatcmpl-{body.request_id or uuid.uuid4().hex}",
            "created": int(time.time()), "model": served.model_name}
    if body.stream:
        return Stream(_stream_chat(head, handle, _include_usage(body),
                                   tool_calls.reader_for(tools, template)), [handle])
    return Answer(lambda: _chat_answer(rt, head, handle, tool_calls.reader_for(tools, template)),
                  [handle])


def _chat_prompt(rt, body: ChatCompletionRequest, template: ChatTemplate,
                 tools: ToolUse | None) -> str:
    from jinja2 import TemplateError

    listed = template_tools(tools)
    messages = template_messages(body.messages, template, listed)
    try:
        return rt.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                      tools=listed if template.takes_tools else None)
    except TemplateError as e:  # the model's template refuses these messages (its words)
        raise BadRequest(f"messages: the model's chat template refused them: {e}") from e


def _chat_answer(rt, head: dict, handle, reader: Reader) -> dict:
    out = handle.result()
    msg = tool_calls.message(tool_calls.read_all(reader, out.text))
    return {**head, "object": "chat.completion", "choices": [{
        "index": 0, "message": msg,
        "finish_reason": tool_calls.finish_reason(out.meta["finish_reason"],
                                                  "tool_calls" in msg),
        "logprobs": _chat_logprobs(rt, out)}],
        "usage": _Usage().add(out.meta).as_dict()}


def _chat_logprobs(rt, out) -> dict | None:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if out.logprobs is None:
        return None

    def entry(t: int, lp: float) -> dict:
        text = rt.tokenizer.decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    tops = out.top_logprobs or [[] for _ in out.token_ids]
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in alts]}
                        for t, lp, alts in zip(out.token_ids, out.logprobs, tops)]}


def _stream_chat(head: dict, handle, include_usage: bool, reader: Reader) -> Iterator[dict]:
    head = {**head, "object": "chat.completion.chunk"}

    def event(delta: dict, finish=None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}

    chunks = handle.chunks()
    # The role goes with the first text, not before it: a request its own input fails
    # fails before any event, so the server answers a 400, not a 200 stream.
    first = next(chunks, None)
    # With tools the answer may be calls alone: its content stays null until text comes.
    yield event({"role": "assistant",
                 "content": "" if isinstance(reader, PlainReader) else None})
    for chunk in itertools.chain([] if first is None else [first], chunks):
        for piece in reader.feed(chunk):
            yield event(tool_calls.delta(piece))
    for piece in reader.finish():
        yield event(tool_calls.delta(piece))
    out = handle.result()
    yield event({}, tool_calls.finish_reason(out.meta["finish_reason"], reader.calls > 0))
    if include_usage:
        yield {**head, "choices": [], "usage": _Usage().add(out.meta).as_dict()}
