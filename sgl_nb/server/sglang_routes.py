"""SGLang's native routes, everything SGLang's frontend (`sglang.RuntimeEndpoint`) calls:
/generate, /model_info, /server_info, /flush_cache, /health_generate,
/concate_and_append_request, /start_profile and /stop_profile (refused), /encode (refused:
no embedding model), in the shapes SGLang 0.5.23's server answers (GenerateReqInput,
sampling_params, meta_info; a stream's events carry the text so far)."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from sgl_nb.runtime.engine import EngineError
from sgl_nb.server.choices import Samples
from sgl_nb.server.prompt_limits import PromptLimits
from sgl_nb.server.refusals import BadRequest
from sgl_nb.server.replies import Answer, Served, Stream
from sgl_nb.server.requests_common import refuse_unsupported
from sgl_nb.server.requests_sglang import (
    ConcateAndAppendRequest,
    GenerateRequest,
    SGLangSamplingParams,
)
from sgl_nb.server.sglang_prompt import PromptScore, prompt_score, report_start, submit_scores

# How long /health_generate waits for the engine to make progress (SGLang's default
# HEALTH_CHECK_TIMEOUT); a busy engine passes at its next step.
HEALTH_TIMEOUT_SECONDS = 20.0


def model_info(served: Served) -> dict:
    path = served.runtime.model_path
    config = _config_json(str(path))
    return {"model_path": str(path), "tokenizer_path": str(path),
            "served_model_name": served.model_name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": config.get("model_type"), "architectures": config.get("architectures")}


@functools.lru_cache(maxsize=4)
def _config_json(folder: str) -> dict:
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def server_info(served: Served) -> dict:
    """The runtime's own account (the one source of it)."""
    return served.runtime.get_server_info()


def flush_cache(served: Served) -> Answer:
    return Answer(lambda: {"flushed_tokens": served.runtime.flush_cache()})


def concate_and_append(body: ConcateAndAppendRequest) -> dict:
    """`forks.join("concate_and_append")` in SGLang's frontend: before calling, it has
    committed each branch's text (a max_new_tokens=0 /generate each, which prefills it) and
    appended the branches' text to the joining program's own; what it asks for is the KV of
    that text without computing it again. Here nothing is copied: that program's next
    /generate sends its whole text and the radix cache serves every prefix it holds, the
    parent's and the first branch's; the other branches' tokens are computed in place, after
    the text before them, so the result is what the text says (SGLang's server 0.5.23 has no
    such route: a 404)."""
    return {"success": True, "src_rids": body.src_rids, "dst_rid": body.dst_rid,
            "message": "no KV copied: the next /generate of dst_rid sends the joined text, "
                       "and the radix cache serves what it holds of it"}


def health_generate(served: Served) -> bool:
    """Whether the engine generates (SGLang's check): a one-token request on a one-token
    prompt finishes, or the engine produces any token meanwhile (a busy engine reaches this
    request late, but is healthy)."""
    rt = served.runtime
    if not rt.engine.alive():
        return False
    before = rt.engine.generated_tokens
    try:
        handle = rt.submit([0], max_tokens=1, temperature=0.0)
    except RuntimeError:  # shut down
        return False
    deadline = time.monotonic() + HEALTH_TIMEOUT_SECONDS
    try:
        while time.monotonic() < deadline:
            try:
                handle.result(timeout=0.5)
                return True
            except TimeoutError:
                if rt.engine.generated_tokens > before:
                    return True
            except EngineError:
                return False
        return False
    finally:
        handle.cancel()


def profiling_refused() -> BadRequest:
    return BadRequest("profiling (/start_profile, /stop_profile) is not supported by sgl-nb "
                     "serve: SGLang's runs torch's profiler on its GPU workers. The engine's "
                     "figures are on /metrics and /server_info; `sgl-nb bench` measures it")


def encode_refused(served: Served) -> BadRequest:
    return BadRequest(f"/encode is for embedding models; {served.model_name} is a generative "
                     "model (use /generate)")


def _params(sp: SGLangSamplingParams) -> dict:
    refuse_unsupported(sp.unsupported())
    out = sp.engine_params()
    if isinstance(out.get("json_schema"), str):
        try:
            out["json_schema"] = json.loads(out["json_schema"])
        except ValueError as e:
            raise BadRequest(f"sampling_params.json_schema is not valid JSON: {e}") from e
    return out


def _fitted_params(sps: list[SGLangSamplingParams], ids: list[list[int]],
                   limits: PromptLimits) -> list[dict]:
    """Each prompt's engine params, max_new_tokens checked against the context (SGLang's
    rule: prompt + max_new_tokens within it)."""
    out = []
    for sp, prompt in zip(sps, ids, strict=True):
        p = _params(sp)
        if p["max_tokens"] > 0:
            asked = None if sp.max_new_tokens is None else "sampling_params.max_new_tokens"
            p["max_tokens"] = limits.max_tokens(len(prompt), p["max_tokens"], asked)
        out.append(p)
    return out


class _Options:
    """What one /generate asks for besides sampling: logprobs (the prompt's: PromptScore),
    how many alternatives, with text."""

    def __init__(self, body: GenerateRequest):
        self.want_lp = bool(body.return_logprob)
        self.top = body.top_logprobs_num or 0
        self.with_text = body.return_text_in_logprobs


def generate(served: Served, body: GenerateRequest, limits: PromptLimits) -> Answer | Stream:
    refuse_unsupported(body.unsupported())
    rt = served.runtime
    if body.text is not None:
        texts = body.text if body.batch else [body.text]
        ids = [limits.encode(rt.tokenizer, t, what="text" if not body.batch else f"text[{i}]")
               for i, t in enumerate(texts)]
    else:
        ids = [list(p) for p in (body.input_ids if body.batch else [body.input_ids])]
    if body.stream and body.batch:
        raise BadRequest("stream=True takes one prompt in sgl-nb serve")
    opts = _Options(body)
    params = _fitted_params(body.sampling_for(len(ids)), ids, limits)
    if opts.want_lp:
        for p in params:
            p.update(logprobs=True, top_logprobs=opts.top)
    rids = _rids(body, len(ids))
    # max_new_tokens=0 generates nothing: the prompt is prefilled into the radix cache, and
    # scored when its logprobs are asked for (what the frontend's select sends).
    gen = [i for i, p in enumerate(params) if p["max_tokens"] > 0]
    prompts = _prompt_scores(rt, body, ids, params)
    n = _samples_per_prompt(body)
    if n > 1:
        return _generate_samples(served, body, prompts, params, rids, gen, n, opts)
    if body.stream and not gen:
        raise BadRequest("stream=True needs sampling_params.max_new_tokens > 0")
    handles = served.submit_all([ids[i] for i in gen], [params[i] for i in gen],
                                stream=body.stream)
    _submit_scores_or_cancel(served, prompts, handles)
    by_index = dict(zip(gen, handles))
    if body.stream:
        return Stream(_stream(rt, rids[0], prompts[0], handles[0], opts), handles + prompts)

    def build() -> dict | list:
        answers = [_one(rt, rids[i], prompts[i], by_index.get(i), opts)
                   for i in range(len(ids))]
        return answers if body.batch else answers[0]

    return Answer(build, handles + prompts)


def _prompt_scores(rt, body: GenerateRequest, ids: list[list[int]], params: list[dict]
                   ) -> list[PromptScore]:
    out = []
    for prompt, p in zip(ids, params, strict=True):
        prompt_only = p["max_tokens"] == 0
        start = report_start(body.return_logprob, body.logprob_start_len, len(prompt),
                             prompt_only)
        out.append(prompt_score(rt.engine, prompt, start, prompt_only))
    return out


def _submit_scores_or_cancel(served: Served, prompts: list[PromptScore], handles) -> None:
    try:
        submit_scores(served, prompts)
    except BaseException:
        for h in handles:
            h.cancel()
        raise


def _rids(body: GenerateRequest, n: int) -> list[str]:
    rid = body.rid
    if isinstance(rid, list):
        if len(rid) != n:
            raise BadRequest(f"rid: {len(rid)} given for {n} prompts")
        return list(rid)
    if rid is not None and n > 1:
        raise BadRequest(f"rid: give a list of {n} ids for a batch")
    return [rid or uuid.uuid4().hex for _ in range(n)]


def _one(rt, rid: str, prompt: PromptScore, handle, opts: _Options) -> dict:
    if handle is not None:
        out = handle.result()
        return {"text": out.text, "output_ids": out.token_ids,
                "meta_info": {"id": rid, **_meta(out.meta), **_logprobs(rt, prompt, out, opts)}}
    meta = {"id": rid, "prompt_tokens": len(prompt.ids), "completion_tokens": 0,
            "cached_tokens": prompt.cached_tokens(),
            "finish_reason": {"type": "length", "length": 0}, "e2e_latency": 0.0,
            **_logprobs(rt, prompt, None, opts)}
    return {"text": "", "output_ids": [], "meta_info": meta}


def _entry(rt, logprob: float | None, token: int, with_text: bool) -> list:
    return [logprob, token, rt.tokenizer.decode([token]) if with_text else None]


def _logprobs(rt, prompt: PromptScore, out, opts: _Options) -> dict:
    """With return_logprob, what SGLang's meta_info always has: input_token_logprobs,
    output_token_logprobs and its length, and output_top_logprobs with top_logprobs_num;
    [logprob, token id, text or None] each. `out` None: nothing was generated."""
    if not opts.want_lp:
        return {}
    def entry(x, t):
        return _entry(rt, x, t, opts.with_text)

    chosen = [] if out is None else [entry(x, t) for x, t in zip(out.logprobs, out.token_ids)]
    meta = {"input_token_logprobs": prompt.input_token_logprobs(entry),
            "output_token_logprobs": chosen, "output_token_logprobs_length": len(chosen)}
    if opts.top:
        tops = [] if out is None else out.top_logprobs
        meta["output_top_logprobs"] = [[entry(x, t) for t, x in alts] for alts in tops]
    return meta


def _meta(m: dict) -> dict:
    reason = m.get("finish_reason")
    if reason == "stop":
        fr = {"type": "stop", "matched": m.get("matched_stop")}
    else:
        fr = {"type": reason, "length": m.get("completion_tokens")}
    return {"prompt_tokens": m["prompt_tokens"], "completion_tokens": m["completion_tokens"],
            "cached_tokens": m.get("cached_tokens") or 0, "finish_reason": fr,
            "e2e_latency": m.get("e2e_latency")}


def _stream(rt, rid: str, prompt: PromptScore, handle, opts: _Options) -> Iterator[dict]:
    text, progress = "", _Progress(rt, prompt, handle.req, opts)
    for chunk in handle.chunks():
        text += chunk
        out_ids, meta = progress.now()
        yield {"text": text, "output_ids": out_ids, "meta_info": {"id": rid, **meta}}
    yield _last_event(rt, rid, prompt, handle.result(), opts)


def _last_event(rt, rid: str, prompt: PromptScore, out, opts: _Options) -> dict:
    meta = {"id": rid, **_meta(out.meta), **_logprobs(rt, prompt, out, opts)}
    return {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}


class _Progress:
    """A streamed request's meta so far, as SGLang's events carry it (its default,
    non-incremental streaming): the tokens so far and, with return_logprob, the logprob
    lists so far. Read off the request while the engine runs it (its lists only grow; a
    token id goes in before its logprob), so it may count a token whose text the next
    event brings."""

    def __init__(self, rt, prompt: PromptScore, req, opts: _Options):
        self.rt, self.prompt, self.req, self.opts = rt, prompt, req, opts
        self.chosen: list[list] = []
        self.tops: list[list[list]] = []
        self.input: list | None = None  # the prompt's, once scored

    def _entry(self, logprob: float | None, token: int) -> list:
        return _entry(self.rt, logprob, token, self.opts.with_text)

    def now(self) -> tuple[list[int], dict]:
        req, opts = self.req, self.opts
        ids = list(req.output_ids)
        meta = {"finish_reason": None, "prompt_tokens": len(self.prompt.ids),
                "cached_tokens": max(req.prompt_cached_tokens, 0)}
        if opts.want_lp:
            lps = list(req.logprobs)
            tops = list(req.top_logprobs) if opts.top else []
            n = min(len(ids), len(lps), len(tops) if opts.top else len(lps))
            ids = ids[:n]
            self.chosen += [self._entry(lps[i], ids[i]) for i in range(len(self.chosen), n)]
            self.tops += [[self._entry(x, t) for t, x in tops[i]]
                          for i in range(len(self.tops), n if opts.top else 0)]
            if self.input is None:
                self.input = self.prompt.input_token_logprobs(self._entry)
            meta.update(input_token_logprobs=self.input, output_token_logprobs=self.chosen[:n],
                        output_token_logprobs_length=n)
            if opts.top:
                meta["output_top_logprobs"] = self.tops[:n]
        meta["completion_tokens"] = len(ids)
        return ids, meta


# ---- sampling_params.n > 1 -------------------------------------------------------------------

def _samples_per_prompt(body: GenerateRequest) -> int:
    """SGLang's rule: one n for the whole request."""
    sp = body.sampling_params
    ns = {s.n or 1 for s in (sp if isinstance(sp, list) else [sp or SGLangSamplingParams()])}
    if len(ns) > 1:
        raise BadRequest("sampling_params.n must be the same for every prompt")
    return ns.pop()


def _generate_samples(served: Served, body: GenerateRequest, prompts: list[PromptScore],
                      params: list[dict], rids: list[str], gen: list[int], n: int,
                      opts: _Options) -> Answer | Stream:
    """n samples of each prompt (choices.py: the prompt computed once), as SGLang answers
    them: a list, prompt i's samples at i * n .. i * n + n - 1, sample j's id "<rid>_<j>";
    streamed, each event carries its sample's `index`."""
    rt = served.runtime
    if body.stream and not gen:
        raise BadRequest("stream=True needs sampling_params.max_new_tokens > 0")
    groups = served.sample([prompts[i].ids for i in gen], [params[i] for i in gen], n,
                           stream=body.stream)
    _submit_scores_or_cancel(served, prompts, groups)
    by_index = dict(zip(gen, groups))
    if body.stream:
        return Stream(_stream_samples(rt, rids[0], prompts[0], groups[0], opts),
                      groups + prompts)

    def build() -> list:
        answers = []
        for i, prompt in enumerate(prompts):
            group = by_index.get(i)
            if group is not None:
                group.outputs()  # submitted, and finished
            answers += [_one(rt, f"{rids[i]}_{j}", prompt,
                             None if group is None else group.handles[j], opts)
                        for j in range(n)]
        return answers

    return Answer(build, groups + prompts)


def _stream_samples(rt, rid: str, prompt: PromptScore, samples: Samples, opts: _Options
                    ) -> Iterator[dict]:
    texts = [""] * samples.n
    for d in samples.deltas():
        sample_rid = f"{rid}_{d.index}"
        if d.end:
            yield {**_last_event(rt, sample_rid, prompt, samples.output(d.index), opts),
                   "index": d.index}
            continue
        texts[d.index] += d.text
        yield {"text": texts[d.index], "meta_info": {
            "id": sample_rid, "finish_reason": None, "prompt_tokens": len(prompt.ids)},
            "index": d.index}
