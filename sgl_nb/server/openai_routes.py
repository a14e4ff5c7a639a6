"""The OpenAI-compatible routes: /v1/models, /v1/completions and /v1/chat/completions, with
the vLLM extensions RuntimeEndpoint uses. Each runs in a worker thread, submits its engine
requests and returns an Answer or a Stream (see replies.py)."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator

from sgl_nb.language.logprob_meta import prompt_token_logprobs
from sgl_nb.runtime.grammar import JSON_OBJECT_SCHEMA
from sgl_nb.server import tool_calls
from sgl_nb.server.choices import Samples, best_by_logprob
from sgl_nb.server.prompt_limits import PromptLimits
from sgl_nb.server.refusals import BadRequest
from sgl_nb.server.replies import Answer, Served, Stream
from sgl_nb.server.requests_common import refuse_unsupported
from sgl_nb.server.requests_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    Sampling,
    TokenizeChatRequest,
)
from sgl_nb.server.tool_calls import (
    ChatTemplate,
    ToolUse,
    template_messages,
    template_of,
    template_tools,
    tool_use,
)
from sgl_nb.server.tool_parsers import PlainReader, Reader

CHAT_PROMPT = "the prompt (the messages in the model's chat template)"


def models(served: Served) -> dict:
    """Every name the model answers to, the one answers report first (vLLM lists its
    --served-model-name the same way)."""
    rt, created = served.runtime, int(time.time())
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": created, "owned_by": "sgl-nb",
        "root": str(rt.model_path), "max_model_len": rt.engine.context_len}
        for name in served.model_names]}


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
              "min_tokens": _or(body.min_tokens, 0), "logit_bias": body.logit_bias or {}}
    params.update(_structured(body))
    return params


def _or(value, default):
    return default if value is None else value


def _structured(body: Sampling) -> dict:
    so = body.structured_outputs
    regex = so.regex if so and so.regex is not None else body.guided_regex
    schema = so.json_ if so and so.json_ is not None else body.guided_json
    if so and so.json_object:
        schema = JSON_OBJECT_SCHEMA
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise BadRequest("response_format.json_schema.schema is required for type "
                             "json_schema")
        schema = fmt.json_schema.schema_
    elif fmt is not None and fmt.type == "json_object":
        schema = JSON_OBJECT_SCHEMA
    out = {}
    if regex is not None:
        out["regex"] = regex
    if schema is not None:
        out["json_schema"] = schema
    return out


def _include_usage(body: Sampling) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# ---- /v1/completions ---------------------------------------------------------------------

def completion(served: Served, body: CompletionRequest, limits: PromptLimits
               ) -> Answer | Stream:
    served.check_model(body.model)
    params = sampling(body, body.max_tokens, 16)
    if body.logprobs is not None:
        params["logprobs"], params["top_logprobs"] = True, body.logprobs
    best_of = _best_of(body)
    if best_of > body.n:
        params["logprobs"] = True  # the candidates are ranked by them
    prompts = body.prompt
    if body.stream and len(prompts) > 1:
        raise BadRequest("stream=True takes one prompt in sgl-nb serve")
    rt = served.runtime
    special = True if body.add_special_tokens is None else body.add_special_tokens
    ids = [p if isinstance(p, list) else limits.encode(
        rt.tokenizer, p, special, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        for i, p in enumerate(prompts)]
    asked = "max_tokens" if body.max_tokens is not None else None
    each = [{**params, "max_tokens": limits.max_tokens(len(p), params["max_tokens"], asked)}
            for p in ids]
    groups = served.sample(ids, each, best_of, stream=body.stream)
    head = {"id": f"cmpl-{body.request_id or uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": served.model_name}
    if body.stream:
        return Stream(_stream_completion(head, groups[0], body.return_token_ids,
                                         _include_usage(body)), groups)
    return Answer(lambda: _completion_answer(rt, head, groups, body), groups)


def _best_of(body: CompletionRequest) -> int:
    """How many candidates each prompt gets (best_of, OpenAI's default n)."""
    best_of = body.n if body.best_of is None else body.best_of
    if best_of < body.n:
        raise BadRequest(f"best_of ({best_of}) must be at least n ({body.n})")
    if body.stream and best_of > body.n:
        raise BadRequest("best_of > n cannot be streamed (the best are known at the end)")
    return best_of


def _completion_answer(rt, head: dict, groups: list[Samples], body: CompletionRequest
                       ) -> dict:
    """vLLM's order: prompt i's samples are choices i * n to i * n + n - 1."""
    choices, usage = [], _Usage()
    for i, group in enumerate(groups):
        outs = group.outputs()
        usage.add_samples(group, outs)
        if len(outs) > body.n:
            outs = best_by_logprob(outs, body.n)
        prompt_lps = (None if body.prompt_logprobs is None
                      else prompt_logprobs(rt, group.prompt))  # one prompt: the same for all
        for j, out in enumerate(outs):
            choice = {"index": i * body.n + j, "text": out.text,
                      "finish_reason": out.meta["finish_reason"],
                      "stop_reason": _stop_reason(out.meta),
                      "logprobs": _logprobs(rt, out) if body.logprobs is not None else None}
            if body.return_token_ids:
                choice["token_ids"] = out.token_ids
                choice["prompt_token_ids"] = group.prompt
            if prompt_lps is not None:
                choice["prompt_logprobs"] = prompt_lps
            choices.append(choice)
    return {**head, "choices": choices, "usage": usage.as_dict()}


def _stream_completion(head: dict, samples: Samples, want_ids: bool, include_usage: bool
                       ) -> Iterator[dict]:
    """The n choices' text interleaved, each under its index; each ends with its own
    finish_reason."""
    def event(index: int, text: str, finish=None, stop=None, ids=None) -> dict:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish,
                  "stop_reason": stop}
        if ids is not None:
            choice["token_ids"] = ids
        return {**head, "choices": [choice]}

    outs = []
    for d in samples.deltas():
        if not d.end:
            yield event(d.index, d.text)
            continue
        out = samples.output(d.index)  # raises its own error: before any event, a 400
        outs.append(out)
        yield event(d.index, "", out.meta["finish_reason"], _stop_reason(out.meta),
                    out.token_ids if want_ids else None)
    if include_usage:
        yield {**head, "choices": [], "usage": _Usage().add_samples(samples, outs).as_dict()}


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

    def add_samples(self, samples: Samples, outputs: list) -> _Usage:
        """One prompt, counted once (it was computed once), and every sample's output."""
        prompt, cached = samples.prompt_usage()
        self.prompt += prompt
        self.cached += cached
        self.completion += sum(out.meta["completion_tokens"] for out in outputs)
        return self

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached}}


# ---- /v1/chat/completions ------------------------------------------------------------------

def chat_completion(served: Served, body: ChatCompletionRequest, limits: PromptLimits
                    ) -> Answer | Stream:
    served.check_model(body.model)
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
    prompt = chat_prompt(rt, body, template, tools)
    special = True if body.add_special_tokens is None else body.add_special_tokens
    ids = limits.encode(rt.tokenizer, prompt, special, CHAT_PROMPT)
    params["max_tokens"] = limits.max_tokens(len(ids), params["max_tokens"],
                                             _max_tokens_field(body))
    samples = served.sample([ids], params, body.n, stream=body.stream)[0]
    head = {"id": f"chatcmpl-{body.request_id or uuid.uuid4().hex}",
            "created": int(time.time()), "model": served.model_name}
    readers = [tool_calls.reader_for(tools, template) for _ in range(body.n)]  # one a choice
    if body.stream:
        return Stream(_stream_chat(head, samples, _include_usage(body), readers), [samples])
    return Answer(lambda: _chat_answer(rt, head, samples, readers), [samples])


def _max_tokens_field(body: ChatCompletionRequest) -> str | None:
    """The field that set the answer's length (None: the default)."""
    if body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens" if body.max_tokens is not None else None


def chat_prompt(rt, body: ChatCompletionRequest | TokenizeChatRequest, template: ChatTemplate,
                tools: ToolUse | None) -> str:
    from jinja2 import TemplateError

    listed = template_tools(tools)
    messages = template_messages(body.messages, template, listed)
    try:
        return rt.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                      tools=listed if template.takes_tools else None)
    except TemplateError as e:  # the model's template refuses these messages (its words)
        raise BadRequest(f"messages: the model's chat template refused them: {e}") from e


def _chat_answer(rt, head: dict, samples: Samples, readers: list[Reader]) -> dict:
    outs = samples.outputs()
    return {**head, "object": "chat.completion",
            "choices": [_chat_choice(rt, i, out, reader)
                        for i, (out, reader) in enumerate(zip(outs, readers))],
            "usage": _Usage().add_samples(samples, outs).as_dict()}


def _chat_choice(rt, index: int, out, reader: Reader) -> dict:
    msg = tool_calls.message(tool_calls.read_all(reader, out.text))
    return {"index": index, "message": msg,
            "finish_reason": tool_calls.finish_reason(out.meta["finish_reason"],
                                                      "tool_calls" in msg),
            "logprobs": _chat_logprobs(rt, out)}


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


def _stream_chat(head: dict, samples: Samples, include_usage: bool, readers: list[Reader]
                 ) -> Iterator[dict]:
    """The n choices interleaved, each under its index: its role first, then its pieces,
    then its finish_reason."""
    head = {**head, "object": "chat.completion.chunk"}

    def event(index: int, delta: dict, finish=None) -> dict:
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}

    deltas = samples.deltas()
    # The roles go with the first text, not before it: a request its own input fails
    # fails before any event, so the server answers a 400, not a 200 stream.
    first = next(deltas)
    if first.end:
        samples.output(first.index)  # raises its error, if it failed
    for i, reader in enumerate(readers):
        # With tools the answer may be calls alone: its content stays null until text comes.
        yield event(i, {"role": "assistant",
                        "content": "" if isinstance(reader, PlainReader) else None})
    outs = []
    for d in itertools.chain([first], deltas):
        reader = readers[d.index]
        if not d.end:
            for piece in reader.feed(d.text):
                yield event(d.index, tool_calls.delta(piece))
            continue
        for piece in reader.finish():
            yield event(d.index, tool_calls.delta(piece))
        out = samples.output(d.index)
        outs.append(out)
        yield event(d.index, {}, tool_calls.finish_reason(out.meta["finish_reason"],
                                                          reader.calls > 0))
    if include_usage:
        yield {**head, "choices": [], "usage": _Usage().add_samples(samples, outs).as_dict()}
