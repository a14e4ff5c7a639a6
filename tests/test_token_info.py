"""Why this token, on the real model: the engine's TokenChoices against its own
top_logprobs, a regex's masked alternatives and allowed counts, forced tokens,
`state.token_info(var, i)` and its errors, and token-level traces that carry it all."""

from __future__ import annotations

import dataclasses
import math

import pytest

import sgl_nb as sgl
from sgl_nb.runtime.engine_config import EngineConfig
from sgl_nb.runtime.token_choice import Alternative, TokenChoice
from sgl_nb.tracing import load

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]

YES_NO = r"(yes|no)"


@sgl.function
def capital(s):
    s += "The capital of France is"
    s += sgl.gen("city", max_tokens=5, ignore_eos=True, return_logprob=True,
                 top_logprobs_num=5)


@sgl.function
def yes_no(s):
    s += "Is the sky blue? Answer yes or no.\nAnswer: "
    s += sgl.gen("ans", regex=YES_NO, max_tokens=4)


@sgl.function
def forced_prefix(s):
    s += "Is water wet?\n"
    s += sgl.gen("a", regex=r"The answer is (yes|no)\.", max_tokens=12)


@sgl.function
def mixed(s):
    s += "Pick a color."
    s += sgl.select("pick", choices=[" red", " blue"])
    forks = s.fork(2)
    forks += lambda i: f" Fruit {i + 1}:"
    forks += sgl.gen("fruit", max_tokens=3, ignore_eos=True)
    forks.join()


def _ok(state):
    assert state.error() is None, state.error()
    return state


def test_tokens_match_the_engines_top_logprobs(default_backend):
    """Without a grammar the alternatives are the engine's top_logprobs (penalties
    included): same ids, same logprobs; the chosen token's logprob is its logprob."""
    out = default_backend.generate("The capital of France is", max_tokens=6, ignore_eos=True,
                                   logprobs=True, top_logprobs=5, repetition_penalty=1.3)
    assert len(out.tokens) == len(out.token_ids) == 6
    for choice, top, lp, tok in zip(out.tokens, out.top_logprobs, out.logprobs,
                                    out.token_ids):
        assert choice.token == tok and choice.allowed == -1 and not choice.forced
        assert [a.token for a in choice.top] == [t for t, _ in top]
        assert [a.logprob for a in choice.top] == pytest.approx([x for _, x in top], abs=1e-4)
        assert choice.logprob == pytest.approx(lp, abs=1e-4)
        assert not any(a.masked for a in choice.top)
        assert choice.text == default_backend.tokenizer.decode([tok])


def test_token_info_of_a_free_gen():
    st = _ok(capital.run())
    meta = st.get_meta_info("city")
    n = len(meta["output_token_logprobs"])
    for i in range(n):
        info = st.token_info("city", i)
        top = meta["output_top_logprobs"][i]
        assert [a.token for a in info.top] == [t for _, t, _ in top]
        assert [a.logprob for a in info.top] == pytest.approx([lp for lp, _, _ in top],
                                                              abs=1e-4)
        assert info.token == meta["output_token_logprobs"][i][1]
        assert info.prob == pytest.approx(math.exp(meta["output_token_logprobs"][i][0]),
                                          rel=1e-3)
    last = st.token_info("city", -1)
    assert last.index == n - 1 and last.token == st.token_info("city", n - 1).token
    info = st.token_info("city", 0)
    gen = next(node for node in st.nodes if node.name == "city")
    assert (info.node, info.label, info.line) == (gen.id, "Gen city", gen.line)
    assert info.instruction.kind == "Decode" and info.instruction.request == meta["id"]
    assert info.prompt_tokens == meta["prompt_tokens"]
    assert info.cached_tokens == meta["cached_tokens"]
    text = str(info)
    assert "Gen city" in text and f"line {gen.line}" in text and "rank" in text
    assert "> " in text  # the chosen row is marked


def test_a_regex_gen_lists_its_masked_alternatives(default_backend):
    st = _ok(yes_no.run())
    vocab = default_backend.tokenizer.get_vocab()
    first = st.token_info("ans", 0)
    # The first step allows exactly the vocabulary's tokens that begin "yes" or "no".
    prefixes = {w[:j] for w in ("yes", "no") for j in range(1, len(w) + 1)}
    assert first.allowed == sum(p in vocab for p in prefixes)
    for a in first.top:
        assert a.masked == (a.text not in prefixes), a
    assert first.masked, "the model's own favourites include tokens the regex rules out"
    assert not any(a.token == first.token for a in first.masked)
    assert "masked" in str(first)
    tokens = st.snapshot().tokens[first.node]
    # The pattern complete, the grammar's end is the stop token's (its text not output).
    stops = default_backend.engine.eos_ids
    assert "".join(t.text for t in tokens if t.token not in stops) == st["ans"]
    assert all(t.allowed > 0 for t in tokens)


def test_forced_tokens_are_marked(default_backend):
    """After the first token the rest of "The answer is" is jump-forward drafts (forced);
    the model's yes or no is its own pick; the closing "." is forced again."""
    st = _ok(forced_prefix.run())
    tokens = st.snapshot().tokens[st.token_info("a", 0).node]
    assert "".join(t.text for t in tokens).startswith(st["a"])
    choice = next(i for i, t in enumerate(tokens) if t.text.strip() in ("yes", "no", "y", "n"))
    assert choice >= 2 and all(t.forced for t in tokens[1:choice])
    info = st.token_info("a", 1)
    assert info.forced and "forced" in str(info)
    assert not tokens[choice].forced and tokens[choice].allowed > 1
    assert tokens[-2].text == "." and tokens[-2].forced
    # Then the pattern is complete: the stop token that ends it is all the grammar leaves.
    assert tokens[-1].token in default_backend.engine.eos_ids
    assert tokens[-1].forced and tokens[-1].allowed == 1


def test_token_info_errors():
    st = _ok(mixed.run())
    with pytest.raises(KeyError, match=r"'nope'.*fruit \(fork branches: pass branch=k\)"):
        st.token_info("nope", 0)
    with pytest.raises(ValueError, match=r"gathered from 2 fork branches: pass branch=k"):
        st.token_info("fruit", 0)
    with pytest.raises(ValueError, match=r"bound by a Select"):
        st.token_info("pick", 0)
    info = st.token_info("fruit", 1, branch=1)
    assert info.branch == 1 and info.index == 1 and "(branch 1)" in str(info)
    with pytest.raises(IndexError, match=r"token 3 of 'fruit': it has 3 tokens"):
        st.token_info("fruit", 3, branch=0)  # max_tokens=3, ignore_eos
    with pytest.raises(IndexError, match=r"token -4 of 'fruit': it has 3 tokens"):
        st.token_info("fruit", -4, branch=0)
    with pytest.raises(IndexError, match=r"branch 2 of 'fruit': the fork has 2 branches"):
        st.token_info("fruit", 0, branch=2)


def test_recording_off(default_backend):
    engine = default_backend.engine
    on = engine.settings
    engine.settings = dataclasses.replace(on, token_alternatives=0)
    try:
        out = default_backend.generate("Hello", max_tokens=2, ignore_eos=True)
        st = _ok(capital.run())
    finally:
        engine.settings = on
    assert out.tokens is None
    with pytest.raises(ValueError, match=r"no recorded tokens.*token_alternatives=0"):
        st.token_info("city", 0)
    with pytest.raises(ValueError, match="token_alternatives"):
        EngineConfig(token_alternatives=-1)


@pytest.mark.parametrize("level", ["node", "token"])
def test_trace_round_trips_top_and_allowed(default_backend, tmp_path, level):
    """At the default level they ride in the compact token columns' extra, at the token
    level on each token's span event: load() rebuilds them either way."""
    path = tmp_path / f"{level}.jsonl"
    sgl.enable_tracing(file=path, level=level, runtime=default_backend)
    try:
        st = _ok(yes_no.run())
    finally:
        sgl.disable_tracing()
    node = st.token_info("ans", 0).node
    replayed = load(path).nodes[node].tokens
    recorded = st.snapshot().tokens[node]
    assert len(replayed) == len(recorded)
    for view, choice in zip(replayed, recorded):
        assert view.allowed == choice.allowed
        assert view.top == [tuple(a.to_json()) for a in choice.top]


def test_token_choice_json():
    c = TokenChoice(5, "yes", -0.1, True, 2, [Alternative(5, "yes", -0.1, False),
                                              Alternative(7, "Yes", -2.5, True)])
    assert TokenChoice.from_json(c.to_json()) == c
    assert c.rank == 0
    old = TokenChoice.from_json({"token": 3, "text": "a"})  # a trace from before
    assert (old.top, old.allowed, old.logprob, old.forced) == ([], -1, None, False)
