"""`sgl-nb serve`: the engine behind the OpenAI-compatible API (checked with the official
`openai` client) and SGLang's native /generate (shapes from SGLang's documentation)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from sgl_nb.server.serve import start_in_thread

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server(runtime):
    srv = start_in_thread(runtime)
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def model(runtime) -> str:
    """A name the server answers to (by default, the model folder's base name)."""
    return runtime.model_path.name


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def post(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


def test_models_lists_the_model(client, runtime):
    """By default the model folder's name (its path is the model's root)."""
    ids = [m.id for m in client.models.list().data]
    assert ids == [runtime.model_path.name]


def test_completion_equals_the_engine(client, runtime, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    want = runtime.generate(PROMPT, max_tokens=12)
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == want.meta["prompt_tokens"]
    assert out.usage.completion_tokens == 12


def test_completion_stream_joins_to_the_same_text(client, runtime, model):
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # really streamed
    assert text == runtime.generate(PROMPT, max_tokens=12).text
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_uses_the_chat_template(client, runtime, model):
    messages = [{"role": "user", "content": "Name one fruit."}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                         temperature=0)
    want = runtime.generate(runtime.apply_chat_template(messages), max_tokens=10)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.text
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want.text


def test_stop_and_regex(client, model):
    out = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=20,
                                    temperature=0, stop=[","])
    assert "," not in out.choices[0].text and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=model, prompt="A year: ", max_tokens=8,
                                    temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[12][0-9]{3}"}})
    assert re.fullmatch("[12][0-9]{3}", out.choices[0].text)


def test_bad_requests_are_400_naming_the_problem(client, model):
    import openai

    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1)
    with pytest.raises(openai.BadRequestError, match=r"best_of \(1\) must be at least n"):
        client.completions.create(model=model, prompt="x", max_tokens=4, n=2,
                                  best_of=1)
    with pytest.raises(openai.NotFoundError, match="The model `any` does not exist"):
        client.completions.create(model="any", prompt="x", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=model, messages=[], max_tokens=4)


def test_sglang_generate_shapes(server, runtime):
    res = json.loads(post(server.url + "/generate", {
        "text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}))
    assert res["text"] == runtime.generate(PROMPT, max_tokens=8).text
    info = res["meta_info"]
    assert info["completion_tokens"] == 8 and info["finish_reason"]["type"] == "length"
    assert info["prompt_tokens"] == len(runtime.tokenizer.encode(PROMPT))
    # A batch, with prompt logprobs from logprob_start_len on (SGLang's documented count:
    # len(input_token_logprobs) + logprob_start_len == prompt_tokens).
    res = json.loads(post(server.url + "/generate", {
        "text": [PROMPT, "Hello there, how are you?"], "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 2}))
    assert len(res) == 2
    for r in res:
        lps = r["meta_info"]["input_token_logprobs"]
        assert len(lps) + 2 == r["meta_info"]["prompt_tokens"]
        assert all(lp[0] < 0 for lp in lps)


def test_sglang_generate_stream_carries_the_text_so_far(server, runtime):
    raw = post(server.url + "/generate", {
        "text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        "stream": True})
    events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == runtime.generate(PROMPT, max_tokens=8).text
    assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "length"


def test_model_info(server, runtime):
    with urllib.request.urlopen(server.url + "/get_model_info", timeout=30) as r:
        info = json.loads(r.read())
    assert info["model_path"] == str(runtime.model_path) and info["is_generation"] is True


def test_the_serve_command_starts_and_stops(model_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "sgl_nb.cli", "serve", "--port", "0", "--quiet",
         "--model", str(model_path), "--kv-pool-tokens", "2048",
         "--served-model-name", "smol", "smol-alias"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        for line in proc.stdout:
            if m := re.search(r"serving on (http://127\.0\.0\.1:\d+)", line):
                url = m.group(1)
                break
        assert url, "sgl-nb serve did not report its address"
        res = json.loads(post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                                         "temperature": 0,
                                                         "model": "smol-alias"}))
        assert res["usage"]["completion_tokens"] == 4 and res["model"] == "smol"
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["smol", "smol-alias"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
