"""Request bodies of /v1/completions and /v1/chat/completions: OpenAI's documented
parameters, and the vLLM extensions its clients send (top_k, min_p, stop_token_ids,
ignore_eos, min_tokens, repetition_penalty, structured_outputs / guided_*, prompt_logprobs,
return_token_ids, ...). A known field this server cannot honour is accepted here and
refused by name when it asks for something (`unsupported()`), so a client learns what is
missing instead of getting a different answer than it asked for."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from sgl_nb.server.refusals import BadRequest
from sgl_nb.server.requests_common import (
    Count,
    JsonSchema,
    LogitBias,
    MinP,
    Penalty,
    PositiveCount,
    RepetitionPenalty,
    Seed,
    Stop,
    Strict,
    Temperature,
    TokenId,
    TopK,
    TopLevel,
    TopLogprobs,
    TopP,
)
from sgl_nb.server.tool_calls import Tool, ToolCall, ToolChoice


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM


class JsonSchemaFormat(Strict):
    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel attribute: the field is named apart, aliased.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's structured_outputs (0.10.2 on); whitespace is always compact here."""

    json_: JsonSchema | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


class Sampling(TopLevel):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: PositiveCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PositiveCount = 1
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: TopK | None = None
    min_p: MinP | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Count | None = None
    repetition_penalty: RepetitionPenalty | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_regex: str | None = None
    guided_json: JsonSchema | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    add_special_tokens: bool | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    truncate_prompt_tokens: Count | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    priority: int | None = None  # vLLM's scheduling hint; this engine orders by its own
    request_id: str | None = None

    def unsupported(self) -> dict[str, bool]:
        so = self.structured_outputs or StructuredOutputs()
        return {
            "use_beam_search": self.use_beam_search,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens=false": not self.skip_special_tokens,
            "truncate_prompt_tokens": self.truncate_prompt_tokens is not None,
            "allowed_token_ids": bool(self.allowed_token_ids),
            "bad_words": bool(self.bad_words),
            "guided_choice": self.guided_choice is not None,
            "guided_grammar": self.guided_grammar is not None,
            "guided_whitespace_pattern": self.guided_whitespace_pattern is not None,
            "structured_outputs.choice": so.choice is not None,
            "structured_outputs.grammar": so.grammar is not None,
            "structured_outputs.structural_tag": so.structural_tag is not None,
            "structured_outputs.whitespace_pattern": so.whitespace_pattern is not None,
            "stream_options.continuous_usage_stats": bool(
                self.stream_options and self.stream_options.continuous_usage_stats),
        }


class CompletionRequest(Sampling):
    prompt: Any = Field(..., description="a string, token ids, or a list of those")
    echo: bool = False
    best_of: PositiveCount | None = None
    suffix: str | None = None
    logprobs: TopLogprobs | None = None
    prompt_logprobs: TopLogprobs | None = None

    @classmethod
    def check_sizes(cls, data: dict, limits) -> None:
        limits.check_id_lists(data.get("prompt"), "prompt")

    @field_validator("prompt")
    @classmethod
    def _prompt_list(cls, prompt: Any) -> list[str | list[int]]:
        """One or several prompts, each a string or token ids."""
        if _is_text_or_ids(prompt):
            return [prompt]
        if isinstance(prompt, list) and prompt and all(_is_text_or_ids(p) for p in prompt):
            return list(prompt)
        raise ValueError("must be a string, a non-empty list of token ids, or a non-empty "
                         "list of those")

    def unsupported(self) -> dict[str, bool]:
        return {"echo": self.echo, "suffix": bool(self.suffix), **super().unsupported()}


def _is_text_or_ids(p: Any) -> bool:
    if isinstance(p, str):
        return True
    return (isinstance(p, list) and bool(p)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in p))


class ContentPart(Strict):
    type: str
    text: str | None = None
    # Other part kinds carry their own fields: refused by their type, not by those.
    model_config = {**Strict.model_config, "extra": "allow"}


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    # What the openai package's message of an earlier answer carries when it is sent back
    # as it is (`messages.append(completion.choices[0].message)`): nothing to render.
    annotations: list[dict[str, Any]] | None = None
    parsed: Any = None
    audio: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r} ones")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if self.audio is not None:
            raise BadRequest("audio in messages is not supported by sgl-nb serve")
        if self.function_call:
            raise BadRequest("function_call in messages (the legacy functions API) is not "
                             "supported by sgl-nb serve: use tool_calls")
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            if any(p.type != "text" for p in self.content):
                raise BadRequest("only text message parts are supported by sgl-nb serve")
            return "".join(p.text or "" for p in self.content)
        return self.content or ""


class ChatCompletionRequest(Sampling):
    messages: list[Message]
    max_completion_tokens: PositiveCount | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's chat extensions
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None

    @field_validator("messages")
    @classmethod
    def _some(cls, messages: list[Message]) -> list[Message]:
        if not messages:
            raise ValueError("must be a non-empty list of {role, content}")
        return messages

    def unsupported(self) -> dict[str, bool]:
        return {
            "functions (the legacy API; use tools)": bool(self.functions),
            "function_call": self.function_call not in (None, "none", "auto"),
            "modalities other than text": bool(self.modalities) and self.modalities != ["text"],
            "audio": self.audio is not None, "prediction": self.prediction is not None,
            "web_search_options": self.web_search_options is not None,
            "echo": self.echo, "continue_final_message": self.continue_final_message,
            "chat_template": self.chat_template is not None,
            "chat_template_kwargs": bool(self.chat_template_kwargs),
            "documents": bool(self.documents), **super().unsupported()}


# ---- vLLM's /tokenize and /detokenize --------------------------------------------------------

class TokenizeCompletionRequest(TopLevel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(TopLevel):
    """The prompt a chat request would have (its template applied), as vLLM tokenizes it."""

    model: str | None = None
    messages: list[Message]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes its own
    return_token_strs: bool | None = False
    tools: list[Tool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    # What the tools' checks read off a chat request: the tools are only listed here.
    tool_choice: ClassVar[None] = None
    parallel_tool_calls: ClassVar[None] = None

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if not self.messages:
            raise ValueError("messages must be a non-empty list of {role, content}")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true")
        return self

    def unsupported(self) -> dict[str, bool]:
        return {"continue_final_message": self.continue_final_message,
                "chat_template": self.chat_template is not None,
                "chat_template_kwargs": bool(self.chat_template_kwargs),
                "mm_processor_kwargs": bool(self.mm_processor_kwargs)}


def tokenize_request_kind(data: Any) -> type[TokenizeCompletionRequest | TokenizeChatRequest]:
    """vLLM's rule: a body with `messages` is a chat, any other a text prompt."""
    chat = isinstance(data, dict) and "messages" in data
    return TokenizeChatRequest if chat else TokenizeCompletionRequest


class DetokenizeRequest(TopLevel):
    model: str | None = None
    tokens: list[TokenId]

    @classmethod
    def check_sizes(cls, data: dict, limits) -> None:
        """No sequence of this model is longer than its context (a prompt and its output)."""
        tokens = data.get("tokens")
        if isinstance(tokens, list) and len(tokens) > limits.context_len:
            raise ValueError(f"tokens: {len(tokens)} token ids, more than the model's "
                             f"context of {limits.context_len} tokens")
