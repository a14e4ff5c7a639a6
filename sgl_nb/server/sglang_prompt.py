"""A /generate prompt's own engine work besides generating: its KV into the radix cache
(max_new_tokens=0, what SGLang's frontend sends to cache a prefix, to commit a fork
branch's text before a concatenating join, and before it scores a select's choices) and
the logprobs of its tokens (return_logprob with a logprob_start_len). Either is one score
request, made (so checked) before anything of the /generate is submitted and submitted with
the rest, so the reply waits for it and a client that leaves cancels it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sgl_nb.runtime.request import Request
from sgl_nb.runtime.request_handle import RequestHandle
from sgl_nb.server.refusals import BadRequest

# (logprob or None, token id) -> SGLang's [logprob, token id, text or None]
Entry = Callable[[float | None, int], list]


def report_start(return_logprob: bool | None, logprob_start_len: int | None,
                 prompt_len: int, prompt_only: bool) -> int | None:
    """The first prompt position whose logprob the answer reports (SGLang's rules), or None
    when it has no input_token_logprobs."""
    if not return_logprob:
        return None
    if logprob_start_len is None or logprob_start_len == -1:
        # SGLang reports none here (it starts at the prompt's end). A prompt-only request
        # gets all of them: SGLang's frontend sends just that for select's
        # unconditional_likelihood_normalized and reads them from position 0.
        return 0 if prompt_only else prompt_len
    if logprob_start_len > prompt_len:
        raise BadRequest(f"logprob_start_len={logprob_start_len} is more than the prompt's "
                         f"{prompt_len} tokens")
    return logprob_start_len


@dataclass
class PromptScore:
    """One prompt's score request (None when there is nothing to compute) and where its
    reported logprobs start (None: none reported)."""

    ids: list[int]
    start: int | None
    request: Request | None = None
    handle: RequestHandle | None = None

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    def input_token_logprobs(self, entry: Entry) -> list:
        """From `start` on (the first prompt token has none); waits for the score."""
        if self.start is None or self.start >= len(self.ids):
            return []
        head = [entry(None, self.ids[0])] if self.start == 0 else []
        if self.handle is None:
            return head
        first = max(self.start, 1)
        scores = self.handle.result().input_logprobs
        return head + [entry(lp, t) for lp, t in zip(scores, self.ids[first:], strict=True)]

    def cached_tokens(self) -> int:
        """Prompt tokens the radix cache already held (waits for the score)."""
        if self.handle is None:
            return 0
        self.handle.result()
        return self.handle.usage()["cached_tokens"]


def prompt_score(engine, ids: list[int], start: int | None, prompt_only: bool) -> PromptScore:
    """The score request a prompt needs, made (and checked) but not submitted: from the
    first reported position, or of the last token only when nothing is reported but a
    prompt-only request still caches the prompt. A one-token prompt needs none."""
    if start is not None and start < len(ids):
        first = max(start, 1)
    elif prompt_only:
        first = len(ids) - 1
    else:
        return PromptScore(ids, start)
    if not 1 <= first < len(ids):
        return PromptScore(ids, start)
    return PromptScore(ids, start, engine.make_score_request(ids, first))


def submit_scores(served, scores: list[PromptScore]) -> None:
    """Submit the prepared score requests (all of them, or none: a failure cancels those
    already submitted)."""
    try:
        for s in scores:
            if s.request is not None:
                s.handle = served.runtime.engine.submit(s.request)
                served.log.add(s.handle)
    except BaseException:
        for s in scores:
            s.cancel()
        raise
