"""Property-based fuzzing of `sgl-nb serve`'s POST routes with hypothesis: malformed JSON,
wrong types, huge, negative and non-finite numbers, unknown fields, lone surrogates, random
nesting, and bodies that are valid. Every answer is a 200 or a 4xx with a message (never a
5xx, never a dropped connection, never an error inside a 200 stream), and afterwards a
valid request still gets the right answer.

Bodies that would be valid always ask for 1-3 tokens, so the model work stays small."""

from __future__ import annotations

import json
import os
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_nb.server.serve import start_in_thread

pytestmark = pytest.mark.slow

# Per endpoint; SGL_NB_FUZZ_EXAMPLES=2000 searches harder.
EXAMPLES = int(os.environ.get("SGL_NB_FUZZ_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VOCAB = 49152
TRIED: dict[str, Counter] = {}


@pytest.fixture(scope="module")
def server(runtime):
    srv = start_in_thread(runtime)
    yield srv
    srv.shutdown()
    print("\ninputs tried per endpoint (status: count):")
    for path, counts in TRIED.items():
        print(f"  {path}: {sum(counts.values())} ({dict(sorted(counts.items()))})")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


# ---- values ------------------------------------------------------------------------------

texts = st.one_of(st.text(max_size=24), st.text(max_size=24),
                  st.text(st.characters(exclude_categories=()), max_size=8))  # + surrogates
numbers = st.one_of(st.integers(), st.integers(min_value=-(2**80), max_value=2**80),
                    st.floats(allow_nan=True, allow_infinity=True), st.just(1e-300),
                    st.just(-0.0), st.just(2**63))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
ascii_junk = st.recursive(  # for grammars (see regexes)
    st.one_of(st.none(), st.booleans(), numbers, st.text(st.characters(max_codepoint=127))),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(
        st.text(st.characters(max_codepoint=127)), inner, max_size=3)), max_leaves=8)
# A size that, if valid at all, is tiny; never absent or null (that would mean a default
# of up to 512 tokens).
sizes = st.one_of(st.integers(1, 3), st.integers(max_value=0), st.integers(min_value=2**31),
                  st.floats(allow_nan=True), st.booleans(), texts, st.lists(scalars, max_size=2))
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
# OpenAI's logit_bias: token ids as strings (some outside the vocabulary), -100 to 100.
biases = st.dictionaries(st.integers(0, VOCAB + 10).map(str), st.floats(-100, 100), max_size=3)
# Random regexes, any character: one no token sequence can spell (U+526CB with this
# vocabulary) fails its request alone (see the test at the end).
regexes = st.one_of(st.sampled_from(["[0-9]{1,2}", "(yes|no)", "a+", "[", "(", "\\", ".*",
                                     "\U000526cb"]),
                    st.text(max_size=10))
schemas = st.one_of(st.sampled_from([{"type": "integer"}, {"type": "object"},
                                     {"type": "string", "maxLength": 3}, {"enum": ["a", "b"]},
                                     {"type": 5}, {"properties": []}]),
                    st.dictionaries(st.sampled_from(["type", "properties", "enum", "items"]),
                                    ascii_junk, max_size=3))


def maybe(valid: st.SearchStrategy, benign: st.SearchStrategy | None = None
          ) -> st.SearchStrategy:
    """Mostly a valid value (one the server may still refuse by name), sometimes anything."""
    return st.one_of(valid, valid, junk)


def exact(valid: st.SearchStrategy, benign: st.SearchStrategy | None = None
          ) -> st.SearchStrategy:
    """A value the server takes: what a client means to send."""
    return valid if benign is None else benign


plain = st.text(max_size=24)
small = st.integers(1, 3)


def body(required: dict, optional: dict) -> st.SearchStrategy:
    """A JSON object with the required fields, some optional ones, maybe unknown ones."""
    return st.fixed_dictionaries(required, optional=optional).flatmap(
        lambda d: st.dictionaries(texts, junk, max_size=2).map(lambda extra: {**extra, **d})
        if d.get("_extra") else st.just(d)).map(lambda d: {k: v for k, v in d.items()
                                                           if k != "_extra"})


def sampling(v, extra) -> dict:
    """OpenAI's and vLLM's fields, shared by both /v1 routes; v wraps each valid value."""
    return {
        "temperature": v(st.floats(0, 2)), "top_p": v(st.floats(0.01, 1)),
        "top_k": v(st.integers(-1, 50)), "min_p": v(st.floats(0, 1)),
        "seed": v(st.integers(-(2**63), 2**63 - 1)),
        "stop": v(st.lists(texts, max_size=2), st.lists(plain.filter(bool), max_size=2)),
        "stop_token_ids": v(token_ids), "ignore_eos": v(st.booleans()),
        "frequency_penalty": v(st.floats(-2, 2)), "presence_penalty": v(st.floats(-2, 2)),
        "repetition_penalty": v(st.floats(0.5, 2)), "min_tokens": v(st.integers(0, 1)),
        "stream": v(st.booleans()),
        "stream_options": v(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "n": v(st.integers(1, 2), st.just(1)), "user": v(texts), "logit_bias": v(biases),
        "model": v(texts, st.none()),
        "response_format": v(st.one_of(
            st.just({"type": "text"}), st.just({"type": "json_object"}),
            schemas.map(lambda s: {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": s}}))),
        # One way to constrain the output in a valid body (two at once is refused).
        "structured_outputs": v(st.one_of(regexes.map(lambda r: {"regex": r}),
                                          schemas.map(lambda s: {"json": s})), st.none()),
        "guided_regex": v(regexes, st.none()), "return_token_ids": v(st.booleans()),
        "_extra": extra}


def completion(v, extra) -> st.SearchStrategy:
    prompt = st.one_of(texts, token_ids, st.lists(st.one_of(texts, token_ids), max_size=3))
    return body({"prompt": v(prompt), "max_tokens": v(sizes, small)},
                {**sampling(v, extra), "logprobs": v(st.integers(0, 3)),
                 "prompt_logprobs": v(st.integers(0, 2)), "best_of": v(st.integers(1, 3)),
                 "echo": v(st.booleans(), st.just(False)), "suffix": v(texts, st.none())})


# A function tool: a name and, maybe, a schema of its arguments (junk when not exact).
tools = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_time", "add"])},
    optional={"parameters": schemas.filter(lambda s: s == {"type": "object"}) | st.just(
        {"type": "object", "properties": {"a": {"type": "integer"}}})})})


def tool_name(tool: dict) -> str:
    return tool["function"]["name"]


def chat(v, extra) -> st.SearchStrategy:
    part = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                     st.fixed_dictionaries({"type": texts}))
    message = st.fixed_dictionaries(
        {"role": v(st.sampled_from(["system", "user", "assistant"])),
         "content": v(st.one_of(texts, st.lists(part, max_size=2)))},
        optional={"name": v(texts)})
    return body({"messages": v(st.lists(message, max_size=3),
                               st.lists(message, min_size=1, max_size=3)),
                 "max_tokens": v(sizes, small)},
                {**sampling(v, extra), "max_completion_tokens": v(sizes, small),
                 "logprobs": v(st.booleans()), "top_logprobs": v(st.integers(0, 3)),
                 "tools": v(st.lists(tools, max_size=2), st.lists(tools, min_size=1, max_size=2,
                                                                 unique_by=tool_name)),
                 # Alone, only "none" is valid (a choice needs tools).
                 "tool_choice": v(st.sampled_from(["none", "auto", "required"]), st.just("none"))})


def generate(v, extra) -> st.SearchStrategy:
    sp = body({"max_new_tokens": v(st.one_of(st.just(0), sizes), st.integers(0, 3))}, {
        "temperature": v(st.floats(0, 2)), "top_p": v(st.floats(0.01, 1)),
        "top_k": v(st.integers(-1, 50)), "stop": v(st.lists(texts, max_size=2)),
        "ignore_eos": v(st.booleans()), "regex": v(regexes),
        "json_schema": v(schemas.map(json.dumps)), "n": v(st.integers(1, 2), st.just(1)),
        "logit_bias": v(biases),
        "min_new_tokens": v(st.integers(0, 1)), "sampling_seed": v(st.integers()),
        "_extra": extra})
    logprobs = {"return_logprob": v(st.booleans()), "logprob_start_len": v(st.integers(-1, 6)),
                "top_logprobs_num": v(st.integers(0, 3)), "stream": v(st.booleans())}
    return st.one_of(
        body({"text": v(st.one_of(texts, st.lists(texts, min_size=1, max_size=3))),
              "sampling_params": v(st.one_of(sp, st.lists(sp, max_size=3)), sp)},
             {**logprobs, "return_text_in_logprobs": v(st.booleans()), "rid": v(texts),
              "image_data": v(st.none()), "_extra": extra}),
        body({"input_ids": v(st.one_of(token_ids, st.lists(token_ids, min_size=1,
                                                            max_size=2))),
              "sampling_params": sp}, {**logprobs, "_extra": extra}))


def flush(v, extra) -> st.SearchStrategy:
    return st.one_of(st.just({}), st.dictionaries(texts, junk, max_size=3))


def wire(make) -> st.SearchStrategy:
    """Bytes on the wire: bodies of valid values only (what a client means to send), of
    values sometimes junk, any JSON at all, bytes that are not JSON, a body cut short."""
    valid, mixed = make(exact, st.just(False)), make(maybe, st.booleans())
    dumps = lambda b: json.dumps(b).encode()  # noqa: E731
    return st.one_of(valid.map(dumps), valid.map(dumps), mixed.map(dumps), mixed.map(dumps),
                     junk.map(dumps), st.binary(max_size=64),
                     mixed.map(lambda b: dumps(b)[:-1]))


# ---- the property ------------------------------------------------------------------------

def check_answer(http: httpx.Client, path: str, data: bytes) -> None:
    with http.stream("POST", path, content=data,
                     headers={"Content-Type": "application/json"}) as r:
        raw = r.read()
    TRIED.setdefault(path, Counter())[r.status_code] += 1
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, raw[:500], data)
    if r.status_code != 200:
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"], raw
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", raw[-300:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), (e, data)
    else:
        json.loads(raw)


@SETTINGS
@given(data=wire(completion))
def test_fuzz_completions(http, data):
    check_answer(http, "/v1/completions", data)


@SETTINGS
@given(data=wire(chat))
def test_fuzz_chat_completions(http, data):
    check_answer(http, "/v1/chat/completions", data)


@SETTINGS
@given(data=wire(generate))
def test_fuzz_generate(http, data):
    check_answer(http, "/generate", data)


@SETTINGS
@given(data=wire(flush))
def test_fuzz_flush_cache(http, data):
    check_answer(http, "/flush_cache", data)


def test_after_the_fuzz_a_valid_request_answers_correctly(http, runtime):
    r = http.post("/v1/completions", json={"prompt": "The capital of France is",
                                            "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == runtime.generate("The capital of France is",
                                                              max_tokens=6).text
    r = http.post("/generate", json={"text": "Hello", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0}})
    assert r.json()["text"] == runtime.generate("Hello", max_tokens=3).text
    m = runtime.metrics()
    assert m["running"] == m["waiting"] == 0


def test_a_regex_the_vocabulary_cannot_spell_is_not_a_500(model_path):
    """On its own Runtime: the session's must not be the one that dies."""
    from sgl_nb import Runtime

    rt = Runtime(model_path, kv_pool_tokens=2048)
    srv = start_in_thread(rt)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for temperature in (1.0, 0.0, 1.0):
                r = c.post("/generate", json={"text": "Hello", "sampling_params": {
                    "regex": "\U000526cb", "max_new_tokens": 2, "temperature": temperature}})
                assert r.status_code < 500, r.text
            # Streamed, it fails before the first event: a 400, not an error in a 200 stream.
            for path, body in (("/generate", {"text": "Hi", "sampling_params": {
                    "regex": "\U000526cb", "max_new_tokens": 2}}),
                    ("/v1/chat/completions", {"messages": [
                        {"role": "user", "content": "Hi"}], "guided_regex": "\U000526cb"}),
                    ("/v1/completions", {"prompt": "Hi",
                                         "guided_regex": "\U000526cb"})):
                r = c.post(path, json={**body, "stream": True})
                assert r.status_code == 400, (path, r.text)
                assert "allows no next token" in r.json()["error"]["message"]
            r = c.post("/generate", json={"text": "Hello", "sampling_params": {
                "max_new_tokens": 2}})
            assert r.status_code == 200
            assert c.get("/health").status_code == 200
            rt.engine.shutdown()  # an engine that has stopped is not healthy
            assert c.get("/health").status_code == 503
    finally:
        srv.shutdown()
        rt.shutdown()
