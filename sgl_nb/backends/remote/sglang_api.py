"""SGLang's native `/generate` API (request and answer shapes from SGLang's documentation:
sampling_params, return_logprob / logprob_start_len, meta_info; streamed events carry the
text so far, not a delta)."""

from __future__ import annotations

import json

from sgl_nb.backends.remote.http import HttpClient, RemoteError
from sgl_nb.runtime.sampling_params import SamplingParams


class SGLangApi:
    name = "sglang"

    def __init__(self, client: HttpClient, model: str | None):
        self.client = client
        self._model = model
        self._info: dict | None = None

    def info(self) -> dict:
        if self._info is None:
            self._info = self.client.get_json("/get_model_info")
        return self._info

    def model(self) -> str:
        if self._model is None:
            self._model = str(self.info().get("model_path") or "")
        return self._model

    def model_paths(self) -> list[str]:
        info = self.info()
        return [p for p in (info.get("tokenizer_path"), info.get("model_path")) if p]

    def generate_body(self, prompt: str | list[int], p: SamplingParams, stream: bool) -> dict:
        sp: dict = {"max_new_tokens": p.max_tokens, "temperature": p.temperature,
                    "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p}
        if p.stop:
            sp["stop"] = list(p.stop)
        if p.stop_token_ids:
            sp["stop_token_ids"] = list(p.stop_token_ids)
        if p.ignore_eos:
            sp["ignore_eos"] = True
        if p.adjusts_logits:
            sp.update(frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                      repetition_penalty=p.repetition_penalty, min_new_tokens=p.min_tokens)
        if p.seed is not None:
            sp["sampling_seed"] = p.seed
        if p.regex is not None:
            sp["regex"] = p.regex
        if p.json_schema is not None:
            schema = p.json_schema
            sp["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
        key = "text" if isinstance(prompt, str) else "input_ids"
        body = {key: prompt, "sampling_params": sp, "stream": stream}
        if p.logprobs or p.top_logprobs:
            body["return_logprob"] = True
            body["top_logprobs_num"] = p.top_logprobs
        return body

    def parse_answer(self, obj: dict, request: str) -> tuple[str, list[int], dict]:
        if isinstance(obj, list):
            obj = obj[0] if obj else {}
        if "text" not in obj:
            raise RemoteError(self.client.base_url, request, f"no text in the answer: {obj}")
        return obj["text"], list(obj.get("output_ids") or []), _meta(obj.get("meta_info") or {})

    def parse_logprobs(self, obj) -> tuple[list[float] | None, list | None]:
        """meta_info's output_token_logprobs / output_top_logprobs, as our (logprob) list
        and (token id, logprob) alternatives."""
        if isinstance(obj, list):
            obj = obj[0] if obj else {}
        info = obj.get("meta_info") or {}
        chosen, top = info.get("output_token_logprobs"), info.get("output_top_logprobs")
        if chosen is None:
            return None, None
        alts = None if top is None else [[(e[1], e[0]) for e in step or []] for step in top]
        return [e[0] for e in chosen], alts

    def stream_step(self, event: dict, acc: dict) -> str:
        text = event.get("text") or ""
        seen = acc.get("text", "")
        # Each event carries the whole text so far: the new part is what follows it.
        delta = text[len(seen):] if text.startswith(seen) else text
        acc["text"] = seen + delta
        if event.get("output_ids"):
            acc["token_ids"] = list(event["output_ids"])
        info = event.get("meta_info") or {}
        if info.get("finish_reason") is not None:
            acc["meta"] = _meta(info)
        return delta

    def score_body(self, prefix: list[int], choices: list[list[int]]) -> dict:
        return {"input_ids": [prefix + c for c in choices],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                "return_logprob": True, "logprob_start_len": len(prefix)}

    def parse_score(self, obj, prefix: list[int], choices: list[list[int]],
                    request: str) -> tuple[list[list[float]], dict]:
        items = obj if isinstance(obj, list) else [obj]
        if len(items) != len(choices):
            raise RemoteError(self.client.base_url, request,
                              f"{len(items)} answers for {len(choices)} choices")
        out, usage = [], {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
        for item, ids in zip(items, choices):
            info = item.get("meta_info") or {}
            entries = info.get("input_token_logprobs") or []
            # Entries run from logprob_start_len to the end (one per token: logprob, id,
            # text); take the choice's own, the last len(ids).
            tail = entries[len(entries) - len(ids):] if len(entries) >= len(ids) else []
            if not tail or any(e[0] is None for e in tail):
                raise RemoteError(self.client.base_url, request,
                                  f"input_token_logprobs too short for the choice: {entries}")
            out.append([float(e[0]) for e in tail])
            for k in usage:
                usage[k] += info.get(k) or 0
        return out, usage


def _meta(info: dict) -> dict:
    fr = info.get("finish_reason")
    reason, matched = (fr.get("type"), fr.get("matched")) if isinstance(fr, dict) else (fr, None)
    return {"id": info.get("id"), "prompt_tokens": info.get("prompt_tokens"),
            "completion_tokens": info.get("completion_tokens"),
            "cached_tokens": info.get("cached_tokens"), "finish_reason": reason,
            "matched_stop": matched}
