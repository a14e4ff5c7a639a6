"""`sgl-nb serve` against the official `openai` package as clients use it, sync and async,
streamed and not: n choices (one prompt computed once), best_of, logit_bias, model names
(an unknown one a 404 in vLLM's shape) and the JSON modes; SGLang's /generate with
sampling_params.n and logit_bias. The real model and a real server throughout."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from sgl_nb.runtime.grammar import MAX_KEY_CHARS
from sgl_nb.server.serve import start_in_thread

pytestmark = pytest.mark.slow

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
CHAT = [{"role": "user", "content": "Name one fruit and say why you like it."}]


@pytest.fixture(scope="module")
def server(runtime):
    srv = start_in_thread(runtime)
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def model(runtime) -> str:
    return runtime.model_path.name


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300,
                         max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300,
                              max_retries=0)


def texts_by_index(choices) -> list[str]:
    assert [c.index for c in choices] == list(range(len(choices)))
    return [c.text for c in choices]


# ---- n choices ----------------------------------------------------------------------------

def test_n_greedy_choices_are_the_greedy_text(client, runtime, model):
    out = client.completions.create(model=model, prompt=STORY, max_tokens=6, n=3,
                                    temperature=0)
    want = runtime.generate(STORY, max_tokens=6).text
    assert texts_by_index(out.choices) == [want] * 3
    assert out.usage.prompt_tokens == len(runtime.tokenizer.encode(STORY))  # counted once
    assert out.usage.completion_tokens == 3 * 6


def test_the_prompt_is_computed_once_for_n_choices(client, server, runtime, model):
    """The engine's own counters: prompt tokens admitted minus those found cached is what
    was computed. n=4: the prompt once (a prefill), then each choice its last token."""
    prompt_len = len(runtime.tokenizer.encode(STORY))
    runtime.flush_cache()
    before = runtime.cache_stats()
    out = client.completions.create(model=model, prompt=STORY, max_tokens=3, n=4,
                                    temperature=1, seed=3)
    after = runtime.cache_stats()
    computed = ((after["prompt_tokens"] - before["prompt_tokens"])
                - (after["cached_prompt_tokens"] - before["cached_prompt_tokens"]))
    assert len(out.choices) == 4
    assert computed == prompt_len + 4  # without sharing: 4 * prompt_len
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # it was not cached before
    # SGLang's /generate: each sample's meta says it found all but its last token cached.
    runtime.flush_cache()
    res = httpx.post(server.url + "/generate", timeout=300, json={
        "text": STORY, "sampling_params": {"n": 3, "max_new_tokens": 3, "temperature": 1}})
    assert [r["meta_info"]["cached_tokens"] for r in res.json()] == [prompt_len - 1] * 3


def test_a_seeded_choice_is_reproducible_on_its_own(client, model):
    """vLLM's rule: choice i of a request with seed s is the request n=1 with seed s + i."""
    out = client.completions.create(model=model, prompt=STORY, max_tokens=8, n=3,
                                    temperature=1, seed=11)
    texts = texts_by_index(out.choices)
    assert len(set(texts)) > 1, texts  # n samples, not one sample n times
    for i, text in enumerate(texts):
        alone = client.completions.create(model=model, prompt=STORY, max_tokens=8,
                                          temperature=1, seed=11 + i)
        assert alone.choices[0].text == text
    again = client.completions.create(model=model, prompt=STORY, max_tokens=8, n=3,
                                      temperature=1, seed=11)
    assert texts_by_index(again.choices) == texts


def test_n_with_several_prompts_orders_choices_by_prompt(client, runtime, model):
    prompts = ["The capital of France is", "Two plus two is"]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=4, n=2,
                                    temperature=0)
    want = [runtime.generate(p, max_tokens=4).text for p in prompts]
    assert texts_by_index(out.choices) == [want[0], want[0], want[1], want[1]]


def test_a_streamed_n_interleaves_choices_and_ends_each(client, model):
    kw = dict(model=model, prompt=STORY, max_tokens=6, n=2, temperature=1, seed=5)
    whole = texts_by_index(client.completions.create(**kw).choices)
    events = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    order = [e.choices[0].index for e in events if e.choices]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # interleaved, not in turn
    for i in range(2):
        mine = [e.choices[0] for e in events if e.choices and e.choices[0].index == i]
        assert "".join(c.text for c in mine) == whole[i]
        assert [c.finish_reason for c in mine][-1] == "length"
        assert all(c.finish_reason is None for c in mine[:-1])
    assert events[-1].usage.completion_tokens == 12


def test_chat_n_sync_and_async_streamed(client, aclient, model):
    kw = dict(model=model, messages=CHAT, max_tokens=8, n=2, temperature=1, seed=21)
    out = client.chat.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1]
    contents = [c.message.content for c in out.choices]
    assert out.usage.completion_tokens == 16

    async def stream() -> list:
        return [e async for e in await aclient.chat.completions.create(**kw, stream=True)]

    events = asyncio.run(stream())
    for i in range(2):
        deltas = [e.choices[0] for e in events if e.choices[0].index == i]
        assert deltas[0].delta.role == "assistant"
        assert "".join(d.delta.content or "" for d in deltas) == contents[i]
        assert [d.finish_reason for d in deltas][-1] == out.choices[i].finish_reason


def test_concurrent_async_requests_with_n(aclient, client, model):
    kw = dict(model=model, prompt=STORY, max_tokens=5, temperature=1)

    async def both():
        return await asyncio.gather(aclient.completions.create(**kw, n=2, seed=1),
                                    aclient.completions.create(**kw, n=3, seed=2))

    a, b = asyncio.run(both())
    assert texts_by_index(a.choices) == texts_by_index(
        client.completions.create(**kw, n=2, seed=1).choices)
    assert texts_by_index(b.choices) == texts_by_index(
        client.completions.create(**kw, n=3, seed=2).choices)


def test_best_of_returns_the_candidate_best_per_token(client, model):
    kw = dict(model=model, prompt="The weather today is", max_tokens=6, temperature=1, seed=8)
    best = client.completions.create(**kw, n=1, best_of=4)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None  # not asked for
    assert best.usage.completion_tokens == 4 * 6  # every candidate was generated
    # The same 4 candidates (seeds 8..11), with their logprobs: the best mean logprob.
    every = client.completions.create(**kw, n=4, logprobs=0)

    def mean(c) -> float:
        return sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)

    assert best.choices[0].text == max(every.choices, key=mean).text
    with pytest.raises(openai.BadRequestError, match=r"best_of \(2\) must be at least n"):
        client.completions.create(**kw, n=3, best_of=2)


# ---- logit_bias ---------------------------------------------------------------------------

def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_logit_bias_bans_and_forces_tokens(client, runtime, model):
    kw = dict(model=model, prompt="The capital of France is", max_tokens=5, temperature=0,
              extra_body={"return_token_ids": True})
    plain = ids_of(client.completions.create(**kw).choices[0])
    banned = plain[0]
    out = client.completions.create(**kw, logit_bias={str(banned): -100})
    assert banned not in ids_of(out.choices[0]) and ids_of(out.choices[0]) != plain
    forced = runtime.tokenizer.encode(" banana")[0]
    assert forced not in plain
    out = client.completions.create(**kw, logit_bias={str(forced): 100})
    assert ids_of(out.choices[0]) == [forced] * 5
    sampled = client.completions.create(**{**kw, "temperature": 1.0}, seed=4,
                                        logit_bias={str(forced): 100})
    assert ids_of(sampled.choices[0]) == [forced] * 5
    # A small bias only shifts the odds: the greedy text may stay what it was.
    assert ids_of(client.completions.create(**kw, logit_bias={str(forced): 0.5}).choices[0]) \
        == plain


def test_logit_bias_in_chat_and_in_sglang_generate(client, server, runtime, model):
    forced = runtime.tokenizer.encode("Yes")[0]
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3,
                                         temperature=0, logit_bias={str(forced): 100})
    assert out.choices[0].message.content == "Yes" * 3
    res = httpx.post(server.url + "/generate", timeout=300, json={
        "text": "The capital of France is", "sampling_params": {
            "max_new_tokens": 3, "temperature": 0, "logit_bias": {str(forced): 100}}})
    assert res.json()["output_ids"] == [forced] * 3


def test_batched_requests_keep_their_own_bias(runtime):
    """Submitted together, so they decode in one batch: each row gets its own bias only."""
    prompt = "My favourite animal is the"
    a, b = runtime.tokenizer.encode(" cat")[0], runtime.tokenizer.encode(" dog")[0]
    biases = [{a: 100}, {b: 100}, {}, {a: -100, b: -100}]
    alone = [runtime.submit(prompt, max_tokens=4, logit_bias=bias).result().token_ids
             for bias in biases]
    handles = [runtime.submit(prompt, max_tokens=4, logit_bias=bias) for bias in biases]
    together = [h.result() for h in handles]
    assert max(h.req.max_batch for h in handles) > 1  # they did share a batch
    assert [out.token_ids for out in together] == alone
    assert alone[0] == [a] * 4 and alone[1] == [b] * 4
    assert a not in alone[3] and b not in alone[3]


def test_token_alternatives_are_reported_after_the_bias(runtime):
    """runtime/token_choice.py: a forced token shows as the model's choice, logprob ~0."""
    forced = runtime.tokenizer.encode(" banana")[0]
    out = runtime.submit("The capital of France is", max_tokens=2,
                         logit_bias={forced: 100}).result()
    first = out.tokens[0]
    assert first.token == forced and first.top[0].token == forced
    assert first.logprob > -1e-3


def test_logit_bias_is_checked_by_the_engine(runtime):
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        runtime.submit("Hi", max_tokens=2, logit_bias={10**6: 1.0})
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must be a number from -100 to 100"):
        runtime.submit("Hi", max_tokens=2, logit_bias={5: 100.5})
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        runtime.submit("Hi", max_tokens=2, logit_bias={"5": 1.0})


# ---- model names --------------------------------------------------------------------------

def test_an_unknown_model_is_a_404_in_vllms_shape(client, server, runtime, model):
    assert [m.id for m in client.models.list().data] == [model]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
    assert e.value.body == {"message": "The model `gpt-4o` does not exist.",
                            "type": "NotFoundError", "param": "model", "code": 404}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    out = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert out.model == model
    # No model at all is this one (vLLM serves it too; the openai package always sends one).
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == model


def test_served_model_names(runtime):
    srv = start_in_thread(runtime, served_model_names=["smol", "smol-alias"])
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
        assert [m.id for m in c.models.list().data] == ["smol", "smol-alias"]
        assert c.completions.create(model="smol-alias", prompt="Hi", max_tokens=2).model \
            == "smol"
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            c.completions.create(model=str(runtime.model_path), prompt="Hi", max_tokens=2)
    finally:
        srv.shutdown()


# ---- JSON modes ---------------------------------------------------------------------------

JSON_PROMPTS = ["Give me a JSON object describing a cat.", "Describe a car as JSON.",
                "List three fruits in JSON.", "Output a JSON config for a web server."]


def outside_strings(text: str) -> str:
    """The JSON text with every string literal taken out (what whitespace rules apply to)."""
    out, in_string, escaped = [], False, False
    for ch in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = ch == "\\", ch != '"'
        elif ch == '"':
            in_string = True
        else:
            out.append(ch)
    return "".join(out)


def keys_in(text: str) -> list[str]:
    """The property names a JSON text has finished so far (whole or cut short)."""
    return [json.loads(f'"{k}"') for k in re.findall(r'"((?:[^"\\]|\\.)*)": ', text)]


def test_json_object_never_runs_away_on_whitespace_or_a_key(client, model):
    """The runaways found (runtime/grammar.py, MAX_KEY_CHARS) were property names that never
    end, not whitespace: whitespace is compact (one space after ':' and ','), a name ends
    within MAX_KEY_CHARS characters, and an answer that ends by itself is valid JSON."""
    answers = []
    for prompt in JSON_PROMPTS:
        for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
            out = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=96,
                temperature=temperature, seed=seed, response_format={"type": "json_object"})
            answers.append((out.choices[0].message.content, out.choices[0].finish_reason))
    for text, finish in answers:
        bare = outside_strings(text)
        assert not re.search(r"\s\s|[\n\r\t]|(?<![,:]) ", bare), text
        assert all(len(k) <= MAX_KEY_CHARS for k in keys_in(text)), text
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
    closed = sum(finish == "stop" for _, finish in answers)
    assert closed >= len(answers) // 2, answers
