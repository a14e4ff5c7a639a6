"""The OpenAI-compatible completions API as vLLM serves it (and SGLang, and `sgl-nb serve`):
request bodies from SamplingParams, answers back into our GenerateOutput shape.

vLLM extensions used: top_k, min_p, stop_token_ids, ignore_eos, min_tokens,
repetition_penalty, structured_outputs (older servers: guided_regex / guided_json),
prompt_logprobs (for select), return_token_ids."""

from __future__ import annotations

import json
import re

from sgl_nb.backends.remote.http import HttpClient, RemoteError, RemoteFeatureError
from sgl_nb.runtime.sampling_params import SamplingParams


class OpenAIApi:
    name = "openai"

    def __init__(self, client: HttpClient, model: str | None):
        self.client = client
        self._model = model
        self._guided_style: str | None = None  # "structured_outputs" or "guided"

    # ---- what the server is ----------------------------------------------------------

    def model(self) -> str:
        if self._model is None:
            models = self.client.get_json("/v1/models", "GET /v1/models (the model name)")
            data = models.get("data") or []
            if not data:
                raise RemoteError(self.client.base_url, "GET /v1/models", "no model served")
            self._model = data[0]["id"]
        return self._model

    def model_paths(self) -> list[str]:
        """Where the server says the model lives (a local folder if it runs here)."""
        models = self.client.get_json("/v1/models")
        out = []
        for m in models.get("data") or []:
            out += [p for p in (m.get("root"), m.get("id")) if p]
        return out

    def _structured_key(self) -> str:
        """vLLM renamed guided_regex/guided_json to structured_outputs in 0.10.2 and later
        dropped the old names; ask the server's /version once."""
        if self._guided_style is None:
            style = "structured_outputs"
            try:
                version = str(self.client.get_json("/version").get("version", ""))
                numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
                if numbers and numbers < (0, 10, 2):
                    style = "guided"
            except (RemoteError, ValueError):
                pass  # no /version (not vLLM): the current name
            self._guided_style = style
        return self._guided_style

    # ---- generation ------------------------------------------------------------------

    def generate_body(self, prompt: str | list[int], p: SamplingParams, stream: bool) -> dict:
        body: dict = {"model": self.model(), "prompt": prompt, "max_tokens": p.max_tokens,
                      "temperature": p.temperature, "top_p": p.top_p, "stream": stream,
                      "return_token_ids": True}
        if p.top_k != -1:
            body["top_k"] = p.top_k
        if p.min_p:
            body["min_p"] = p.min_p
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.ignore_eos:
            body["ignore_eos"] = True
        body.update(_penalties(p))
        if p.top_logprobs:
            raise RemoteFeatureError(
                self.client.base_url, "gen(top_logprobs_num=...)", "the OpenAI-compatible API "
                "returns the alternatives as text without token ids; use api='sglang'")
        if p.logprobs:
            body["logprobs"] = 0
        if p.regex is not None or p.json_schema is not None:
            body.update(self._structured(p))
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _structured(self, p: SamplingParams) -> dict:
        schema = p.json_schema
        if isinstance(schema, str):
            schema = json.loads(schema)
        if self._structured_key() == "guided":
            return {"guided_regex": p.regex} if p.regex is not None else {"guided_json": schema}
        # Compact JSON, as the in-kernel engine decodes it: free whitespace lets a small
        # model loop on newlines until max_tokens.
        so = {"regex": p.regex} if p.regex is not None else {
            "json": schema, "disable_any_whitespace": True}
        return {"structured_outputs": so}

    def parse_answer(self, obj: dict, request: str) -> tuple[str, list[int], dict]:
        choices = obj.get("choices") or []
        if not choices:
            raise RemoteError(self.client.base_url, request, f"no choices in the answer: {obj}")
        c = choices[0]
        meta = _finish_meta(c)
        meta.update(_usage_meta(obj.get("usage")))
        meta["id"] = obj.get("id")
        return c.get("text") or "", list(c.get("token_ids") or []), meta

    def parse_logprobs(self, obj: dict) -> tuple[list[float] | None, None]:
        """The chosen tokens' logprobs (completions' `logprobs.token_logprobs`)."""
        lp = ((obj.get("choices") or [{}])[0]).get("logprobs")
        return (None, None) if not lp else (list(lp.get("token_logprobs") or []), None)

    def stream_step(self, event: dict, acc: dict) -> str:
        """One streamed event: returns its new text; fills `acc` with ids and meta."""
        for c in event.get("choices") or []:
            acc.setdefault("token_ids", []).extend(c.get("token_ids") or [])
            if c.get("finish_reason") is not None:
                acc.setdefault("meta", {}).update(_finish_meta(c))
        if event.get("usage"):
            acc.setdefault("meta", {}).update(_usage_meta(event["usage"]))
        acc.setdefault("meta", {}).setdefault("id", event.get("id"))
        return "".join(c.get("text") or "" for c in event.get("choices") or [])

    # ---- select ----------------------------------------------------------------------

    def score_body(self, prefix: list[int], choices: list[list[int]]) -> dict:
        # One request, one prompt per choice: the server batches them and its prefix cache
        # shares the prefix. max_tokens=1: some servers refuse 0.
        return {"model": self.model(), "prompt": [prefix + c for c in choices],
                "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}

    def parse_score(self, obj: dict, prefix: list[int], choices: list[list[int]],
                    request: str) -> tuple[list[list[float]], dict]:
        by_index = {c.get("index", i): c for i, c in enumerate(obj.get("choices") or [])}
        out = []
        for i, ids in enumerate(choices):
            c = by_index.get(i)
            plp = None if c is None else c.get("prompt_logprobs")
            if plp is None:
                raise RemoteFeatureError(
                    self.client.base_url, request,
                    "select needs prompt logprobs (vLLM's `prompt_logprobs`), which this "
                    "OpenAI-compatible server did not return")
            full = prefix + ids
            row = []
            for pos in range(len(prefix), len(full)):
                entry = plp[pos] or {}
                lp = entry.get(str(full[pos]))
                if lp is None:
                    raise RemoteError(self.client.base_url, request,
                                      f"no logprob for prompt token {full[pos]} at {pos}")
                row.append(lp["logprob"] if isinstance(lp, dict) else float(lp))
            out.append(row)
        return out, _usage_meta(obj.get("usage"))


def _finish_meta(c: dict) -> dict:
    return {"finish_reason": c.get("finish_reason"), "matched_stop": c.get("stop_reason")}


def _usage_meta(usage: dict | None) -> dict:
    if not usage:
        return {}
    details = usage.get("prompt_tokens_details") or {}
    return {"prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens")}


# OpenAI's frequency / presence, vLLM's min_tokens / repetition_penalty, and their "off".
_PENALTIES_OFF = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "min_tokens": 0,
                  "repetition_penalty": 1.0}


def _penalties(p: SamplingParams) -> dict:
    """The penalties this request sets (a server that lacks one never sees it unset)."""
    return {k: getattr(p, k) for k, off in _PENALTIES_OFF.items() if getattr(p, k) != off}
