"""A gen's logprobs in its meta info, in SGLang's shape: lists of (logprob, token id, text or
None) for the output tokens, the top alternatives at each, and the prompt from a start."""

from __future__ import annotations

from sgl_nb.runtime.request import GenerateOutput


def logprob_meta(result: GenerateOutput, options: dict, backend, prompt: str) -> dict:
    """options: return_text_in_logprobs, logprob_start_len (None: no prompt logprobs)."""
    if result.logprobs is None:
        return {}
    tok = backend.tokenizer
    with_text = bool(options.get("return_text_in_logprobs"))

    def entry(logprob: float | None, token: int) -> tuple:
        return (logprob, token, tok.decode([token]) if with_text else None)

    meta = {"output_token_logprobs": [entry(lp, t)
                                      for lp, t in zip(result.logprobs, result.token_ids)]}
    if result.top_logprobs is not None:
        meta["output_top_logprobs"] = [[entry(lp, t) for t, lp in top]
                                       for top in result.top_logprobs]
    start = options.get("logprob_start_len")
    if start is not None and start >= 0:
        meta["input_token_logprobs"] = _prompt_logprobs(backend, prompt, start, entry)
    return meta


def _prompt_logprobs(backend, prompt: str, start: int, entry) -> list[tuple]:
    ids = backend.tokenizer.encode(prompt)
    return [entry(lp, t) for lp, t in prompt_token_logprobs(backend, ids, start)]


def prompt_token_logprobs(backend, ids: list[int], start: int) -> list[tuple[float | None, int]]:
    """(logprob, token id) of each prompt token from `start` on; the very first token has
    no logprob (None). One Score request, whose prefix the radix cache usually holds."""
    if start >= len(ids):
        return []
    head = [(None, ids[0])] if start == 0 else []
    first = max(start, 1)
    if first >= len(ids):
        return head
    (scores,) = backend.score(ids[:first], [ids[first:]])
    return head + list(zip(scores, ids[first:]))


class ChunkMeta:
    """A streamed gen's meta for each text chunk, in SGLang's streaming shape:
    completion_tokens so far and, with return_logprob, output_token_logprobs of the tokens
    since the chunk before (output_token_logprobs_length: all so far). `next()` runs on the
    executor's thread as each chunk is delivered, after `handle` is set (so no chunk goes
    without), and counts the tokens decoded by then: a chunk may count a token whose text
    comes with the next one, and that one then counts none. A server's requests carry no
    tokens here: no meta."""

    def __init__(self, with_text: bool | None, backend):
        self.handle = None
        self.with_text, self.backend = bool(with_text), backend
        self.seen = 0  # tokens reported by the chunks before

    def next(self) -> dict | None:
        req = getattr(self.handle, "req", None)
        if req is None:
            return None
        # Copies: the engine's thread appends a token id, then its logprob.
        ids, logprobs = list(req.output_ids), list(req.logprobs)
        n = min(len(ids), len(logprobs)) if req.params.logprobs else len(ids)
        meta: dict = {"completion_tokens": n}
        if req.params.logprobs:
            tok = self.backend.tokenizer
            meta["output_token_logprobs"] = [
                (logprobs[i], ids[i], tok.decode([ids[i]]) if self.with_text else None)
                for i in range(self.seen, n)]
            meta["output_token_logprobs_length"] = n
        self.seen = max(self.seen, n)
        return meta
