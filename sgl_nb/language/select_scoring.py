"""How `select` turns each choice's token logprobs into one pick (SGLang's three methods)."""

from __future__ import annotations


def choose(method: str, logprobs: list[list[float]], unconditional: list[list[float]] | None
           ) -> tuple[int, dict]:
    """logprobs[i]: the logprob of each token of choice i after the prompt. Returns the
    chosen index and meta info (every choice's score)."""
    normalized = [sum(lp) / len(lp) for lp in logprobs]
    meta = {"normalized_prompt_logprobs": normalized, "input_token_logprobs": logprobs}
    if method == "token_length_normalized":
        scores = normalized
    elif method == "unconditional_likelihood_normalized":
        # Subtract how likely each choice is with no prompt at all (its first token has no
        # unconditional logprob of its own, so it is left out on both sides).
        scores = []
        for lp, un in zip(logprobs, unconditional or []):
            rest, un_rest = lp[1:] or lp, un[1:] or un
            scores.append(sum(rest) / len(rest) - sum(un_rest) / len(un_rest))
        meta["unconditional_token_logprobs"] = unconditional
    elif method == "greedy_token_selection":
        scores = _greedy_scores(logprobs)
    else:
        raise ValueError(f"unknown select method {method!r}")
    meta["scores"] = scores
    best = max(range(len(scores)), key=lambda i: scores[i])
    return best, meta


def _greedy_scores(logprobs: list[list[float]]) -> list[float]:
    """Compare choices token by token, as greedy decoding would have: the first position
    where they differ decides. A shorter choice is padded with its own mean logprob."""
    width = max(len(lp) for lp in logprobs)
    padded = [lp + [sum(lp) / len(lp)] * (width - len(lp)) for lp in logprobs]
    order = sorted(range(len(padded)), key=lambda i: padded[i], reverse=True)
    # Rank as scores: the best gets the highest number.
    scores = [0.0] * len(padded)
    for rank, i in enumerate(order):
        scores[i] = float(len(padded) - rank)
    return scores
