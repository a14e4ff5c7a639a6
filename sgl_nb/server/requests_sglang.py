"""Request bodies of SGLang's native routes: /generate's GenerateReqInput and its
sampling_params, as SGLang documents them. Fields for what a text-only, one-machine engine
does not do (images, LoRA, sessions, disaggregation) are known and refused by name."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

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


class SGLangSamplingParams(Strict):
    max_new_tokens: Count | None = None  # 0: only score the prompt (what a select sends)
    min_new_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    stop_regex: Stop | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: JsonSchema | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    sampling_seed: Seed | None = None
    n: PositiveCount | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stream_interval: PositiveCount | None = None
    logit_bias: LogitBias | None = None
    custom_params: dict[str, Any] | None = None

    def engine_params(self) -> dict:
        """SamplingParams fields (SGLang's defaults where absent)."""
        out: dict = {"max_tokens": 128, "temperature": 1.0}
        renamed = {"max_new_tokens": "max_tokens", "sampling_seed": "seed",
                   "min_new_tokens": "min_tokens"}
        same = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                "ignore_eos", "regex", "json_schema", "frequency_penalty", "presence_penalty",
                "repetition_penalty", "logit_bias")
        for key, value in self.model_dump(exclude_none=True).items():
            if key in renamed or key in same:
                out[renamed.get(key, key)] = value
        return out

    def unsupported(self) -> dict[str, bool]:
        return {"sampling_params.stop_regex": bool(self.stop_regex),
                "sampling_params.ebnf": self.ebnf is not None,
                "sampling_params.structural_tag": self.structural_tag is not None,
                "sampling_params.custom_params": bool(self.custom_params),
                "sampling_params.skip_special_tokens=false": self.skip_special_tokens is False,
                "sampling_params.no_stop_trim": bool(self.no_stop_trim)}


class GenerateRequest(TopLevel):
    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    rid: str | list[str] | None = None
    session_id: str | None = None  # sgl.Runtime.generate sends it (None)
    return_logprob: bool | None = None
    logprob_start_len: int | None = Field(None, ge=-1, le=2**31 - 1)
    top_logprobs_num: TopLogprobs | None = None
    token_ids_logprob: list[TokenId] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: bool = False
    input_embeds: list[Any] | None = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    modalities: list[Any] | None = None
    lora_path: str | list[str | None] | None = None
    lora_id: str | list[str | None] | None = None
    session_params: dict[str, Any] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    data_parallel_rank: int | None = None
    priority: int | None = None  # SGLang's scheduling hint; this engine orders by its own

    @classmethod
    def check_sizes(cls, data: dict, limits) -> None:
        limits.check_id_lists(data.get("input_ids"), "input_ids")

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give text or input_ids (one of them)")
        if self.input_ids == [] or self.text == []:
            raise ValueError("an empty batch: give at least one prompt")
        return self

    @property
    def batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return isinstance(self.input_ids[0], list)

    def sampling_for(self, n: int) -> list[SGLangSamplingParams]:
        """One sampling_params per prompt (SGLang takes one for all, or a list)."""
        sp = self.sampling_params
        if isinstance(sp, list):
            if len(sp) != n:
                raise ValueError(f"sampling_params: {len(sp)} given for {n} prompts")
            return sp
        return [sp or SGLangSamplingParams()] * n

    def unsupported(self) -> dict[str, bool]:
        return {"input_embeds": self.input_embeds is not None,
                "image_data": self.image_data is not None,
                "audio_data": self.audio_data is not None,
                "video_data": self.video_data is not None,
                "modalities": bool(self.modalities),
                "lora_path": _given(self.lora_path), "lora_id": _given(self.lora_id),
                "session_params": self.session_params is not None,
                "session_id": self.session_id is not None,
                "custom_logit_processor": _given(self.custom_logit_processor),
                "token_ids_logprob": self.token_ids_logprob is not None,
                "return_hidden_states": self.return_hidden_states,
                "bootstrap_host (disaggregated serving)": _given(self.bootstrap_host)}


def _given(value: Any) -> bool:
    return value is not None and value != [] and not (
        isinstance(value, list) and all(v is None for v in value))


class FlushCacheRequest(TopLevel):
    """SGLang's /flush_cache takes no parameters."""


RequestId = Annotated[str, Field(min_length=1)]


class ConcateAndAppendRequest(TopLevel):
    """What SGLang's frontend sends for `forks.join("concate_and_append")`: the ids of the
    fork branches (src_rids, in order) and of the program they join (dst_rid). They are ids
    of the frontend's own program states, never sent with a /generate, so a server can check
    their shape but not look them up."""

    src_rids: list[RequestId] = Field(min_length=1)
    dst_rid: RequestId

    @model_validator(mode="after")
    def _distinct(self) -> ConcateAndAppendRequest:
        if self.dst_rid in self.src_rids:
            raise ValueError("dst_rid is also one of src_rids (a state cannot be appended to "
                             "itself)")
        if len(set(self.src_rids)) != len(self.src_rids):
            raise ValueError("src_rids names a branch twice")
        return self
