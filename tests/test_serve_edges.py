"""`sgl-nb serve` at its edges, with the `openai` package and raw HTTP against real servers
on the default model: 10 MB bodies (token ids refused by their length, text refused by its
size before the tokenizer sees it, a body whose validation is slow) while /health answers
and after which the server's memory comes back; prompt + max_tokens past the context or the
KV pool (a 400 naming both numbers, or lowered to fit with --clip-max-tokens); vLLM's
/tokenize and /detokenize; the served model's names."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from support.serve_child import ServeChild
from support.waits import WAIT, limit, until
from transformers import AutoTokenizer

from sgl_nb.server.prompt_limits import PromptLimits, text_bytes_per_token
from sgl_nb.server.serve import start_in_thread

CHAT = [{"role": "user", "content": "Name one fruit."}]
# The small servers' KV pool, which caps their context: a prompt that fills it prefills in
# seconds on a CPU (the model's own 8192 would take minutes).
SMALL_POOL = 1024
# What a process may keep of the 10 MB requests it refused: the worker threads' stacks and
# the allocator's own tables. Measured: the server ends 80 MB *below* its start (the trim
# after a large body gives back what earlier requests left too); without the trim it kept
# 30-40 MB, and tokenizing a 10 MB text took 1.3 GB.
RSS_SLACK_MB = 16
TEN_MB_IDS = list(range(1000, 1000 + 1_400_000))  # 11 MB of JSON
TEN_MB_TEXT = "hello " * 1_700_000


def json_post(http: httpx.Client, path: str, body) -> httpx.Response:
    return http.post(path, content=body if isinstance(body, bytes) else json.dumps(body),
                     headers={"Content-Type": "application/json"})


def refusal(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == "invalid_request_error"
    return err["message"]


# ---- the text bound (the real tokenizer, no model) ----------------------------------------

def test_a_text_over_the_bound_never_fits(model_path):
    """The bound's promise: a token stands for at most bytes_per_token bytes, so a text over
    context * bytes_per_token bytes has more tokens than the context. Checked on the texts
    that pack the most bytes into a token (the longest vocabulary entries repeated) and on
    mixed text (multi-byte characters, code, runs of spaces)."""
    tok = AutoTokenizer.from_pretrained(str(model_path))
    per_token = text_bytes_per_token(tok)
    assert per_token is not None
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=False)
    longest = sorted(vocab, key=len, reverse=True)[:20]
    texts = [tok.convert_tokens_to_string([t]) * 50 for t in longest]
    texts += ["naïve café 日本語 🚀🚀 " * 40, "def f(x):\n    return x  # \t\n" * 40,
              " " * 5000, "\n" * 3000, "<|im_start|>user\nhi<|im_end|>" * 30]
    for text in texts:
        n_bytes, n_tokens = len(text.encode()), len(tok.encode(text))
        assert n_tokens * per_token >= n_bytes, (text[:40], n_tokens, n_bytes, per_token)
    limits = PromptLimits(context_len=64, model_context=64, bytes_per_token=per_token)
    over = texts[0] * (64 * per_token // len(texts[0].encode()) + 1)
    with pytest.raises(ValueError, match="refused without tokenizing it"):
        limits.check_text(over)
    assert len(tok.encode(over)) > 64
    limits.check_text(over.encode()[:64 * per_token].decode(errors="ignore"))  # at the bound


# ---- a real child server: big bodies, /health, memory --------------------------------------

@pytest.fixture(scope="module")
def child():
    server = ServeChild("--quiet", "--kv-pool-tokens", str(SMALL_POOL), "--clip-max-tokens")
    yield server
    server.kill()


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.mark.slow
def test_huge_bodies_are_refused_cheaply_and_the_memory_comes_back(child):
    """Refused: 10 MB of token ids by their count, 10 MB of text by its size (untokenized),
    on every route that takes a prompt. The server's RSS returns to where it was."""
    rss = lambda: vm_rss_mb(child.proc.pid)  # noqa: E731
    with httpx.Client(base_url=child.url, timeout=WAIT) as http:
        for path, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
                           ("/generate", {"input_ids": [1, 2], "sampling_params": {
                               "max_new_tokens": 2}}),
                           ("/tokenize", {"prompt": "Hi"})]:
            assert json_post(http, path, body).status_code == 200  # warm: lazy state built
        start = rss()
        ids = [("/v1/completions", {"prompt": TEN_MB_IDS}),
               ("/generate", {"input_ids": TEN_MB_IDS}),
               ("/detokenize", {"tokens": TEN_MB_IDS})]
        texts = [("/v1/completions", {"prompt": TEN_MB_TEXT}),
                 ("/v1/chat/completions", {"messages": [{"role": "user",
                                                         "content": TEN_MB_TEXT}]}),
                 ("/generate", {"text": TEN_MB_TEXT}),
                 ("/tokenize", {"prompt": TEN_MB_TEXT})]
        for path, body in ids:
            message = refusal(json_post(http, path, json.dumps(body).encode()))
            assert "1400000" in message and f"context of {SMALL_POOL} tokens" in message
        until(lambda: rss() <= start + RSS_SLACK_MB, "the memory of the id lists given back",
              timeout=limit(60))
        settled = rss()
        for path, body in texts:
            message = refusal(json_post(http, path, json.dumps(body).encode()))
            assert "bytes of text" in message and "refused without tokenizing it" in message
        until(lambda: rss() <= settled + RSS_SLACK_MB, "the memory of the texts given back",
              timeout=limit(60))
        assert json_post(http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}
                         ).status_code == 200


@pytest.mark.slow
def test_health_answers_while_a_big_body_is_validated(child):
    """A 10 MB body whose validation takes long (two million prompts, then a bad field) is
    parsed in a worker thread: /health, asked once the body is uploaded, is answered before
    that body's 400. Parsed on the event loop, the 400 would come first (the loop would not
    read /health until the parse ended)."""
    body = json.dumps({"prompt": ["a"] * 2_000_000, "temperature": "hot"}).encode()
    uploaded, order = threading.Event(), []

    def pieces():
        for i in range(0, len(body), 2**20):
            yield body[i:i + 2**20]
        uploaded.set()  # httpx asks for more only once the last piece is sent

    def big() -> None:
        r = httpx.post(child.url + "/v1/completions", content=pieces(), timeout=WAIT,
                       headers={"Content-Type": "application/json",
                                "Content-Length": str(len(body))})
        order.append(("big", r))

    sender = threading.Thread(target=big)
    sender.start()
    assert uploaded.wait(WAIT)
    health = httpx.get(child.url + "/health", timeout=WAIT)
    order.append(("health", health))
    sender.join(WAIT)
    assert [name for name, _ in order] == ["health", "big"]
    assert health.status_code == 200
    assert "temperature" in refusal(order[1][1])


@pytest.mark.slow
def test_clip_max_tokens_lowers_it_to_fit(child):
    """`sgl-nb serve --clip-max-tokens`: today's lowering, for clients that rely on it."""
    prompt = list(range(1000, 1000 + SMALL_POOL - 24))
    with httpx.Client(base_url=child.url, timeout=WAIT) as http:
        r = json_post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 50,
                                                "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (SMALL_POOL - 24, 24)


# ---- context limits: the session's runtime, and one with a small KV pool --------------------

@pytest.fixture(scope="module")
def server(runtime):
    srv = start_in_thread(runtime)
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=WAIT,
                         max_retries=0)


@pytest.mark.slow
def test_max_tokens_past_the_context_is_a_400_naming_both(client, server, runtime):
    context = runtime.engine.context_len
    n = len(runtime.tokenizer.encode("Hello there"))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=runtime.model_path.name, prompt="Hello there",
                                  max_tokens=context)
    message = e.value.body["message"]
    assert f"max_tokens is too large: {context}" in message
    assert f"context is {context} tokens and the prompt has {n} tokens" in message
    assert e.value.body["code"] == 400 and e.value.body["type"] == "invalid_request_error"
    chat_n = len(runtime.tokenizer.encode(runtime.apply_chat_template(CHAT)))
    with pytest.raises(openai.BadRequestError,
                       match=rf"max_completion_tokens is too large: 9000\. .* the prompt has "
                             rf"{chat_n} tokens \(9000 > {context} - {chat_n}\)"):
        client.chat.completions.create(model=runtime.model_path.name, messages=CHAT,
                                       max_completion_tokens=9000)
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        message = refusal(json_post(http, "/generate", {
            "input_ids": [5] * 100, "sampling_params": {"max_new_tokens": context}}))
        assert f"sampling_params.max_new_tokens is too large: {context}" in message
        assert f"({context} > {context} - 100)" in message
        ok = json_post(http, "/generate", {"input_ids": [5] * 100, "sampling_params": {
            "max_new_tokens": 3, "ignore_eos": True}}).json()
        assert ok["meta_info"]["completion_tokens"] == 3


@pytest.fixture(scope="module")
def small_runtime(model_path):
    from sgl_nb import Runtime

    with pytest.warns(UserWarning, match="requests are capped"):
        rt = Runtime(model_path, kv_pool_tokens=SMALL_POOL)
    yield rt
    rt.shutdown()


@pytest.mark.slow
def test_the_kv_pool_caps_the_context_and_a_default_is_lowered(small_runtime):
    srv = start_in_thread(small_runtime)
    try:
        with httpx.Client(base_url=srv.url, timeout=WAIT) as http:
            message = refusal(json_post(http, "/v1/completions",
                                        {"prompt": [5] * 10, "max_tokens": 2000}))
            assert (f"context is {SMALL_POOL} tokens (the KV pool's capacity; the model's own "
                    f"is 8192) and the prompt has 10 tokens" in message)
            assert f"(2000 > {SMALL_POOL} - 10)" in message
            # Unset, max_tokens is OpenAI's default (16), lowered to the 4 tokens left.
            prompt = list(range(1000, 1000 + SMALL_POOL - 4))
            r = json_post(http, "/v1/completions", {"prompt": prompt, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            assert r.json()["choices"][0]["finish_reason"] == "length"
            tokenized = json_post(http, "/tokenize", {"prompt": "Hi"}).json()
            assert tokenized["max_model_len"] == SMALL_POOL
    finally:
        srv.shutdown()


@pytest.mark.slow
def test_start_in_thread_clip_max_tokens(small_runtime):
    srv = start_in_thread(small_runtime, clip_max_tokens=True)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=WAIT, max_retries=0)
        out = c.completions.create(model=small_runtime.model_path.name,
                                   prompt=list(range(1000, 1000 + SMALL_POOL - 3)),
                                   max_tokens=500, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
    finally:
        srv.shutdown()


# ---- /tokenize and /detokenize -------------------------------------------------------------

@pytest.mark.slow
def test_tokenize_a_text_in_vllms_shape(server, runtime):
    text = "The three primary colors are red, yellow and blue."
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        out = json_post(http, "/tokenize", {"model": runtime.model_path.name, "prompt": text,
                                            "return_token_strs": True}).json()
        ids = runtime.tokenizer.encode(text)
        assert out == {"count": len(ids), "max_model_len": runtime.engine.context_len,
                       "tokens": ids, "token_strs": runtime.tokenizer.convert_ids_to_tokens(ids)}
        plain = json_post(http, "/tokenize", {"prompt": text}).json()
        assert plain["tokens"] == ids and plain["token_strs"] is None
        back = json_post(http, "/detokenize", {"model": runtime.model_path.name,
                                               "tokens": ids}).json()
        assert back == {"prompt": text}


@pytest.mark.slow
def test_tokenize_a_chat_counts_what_the_chat_route_sends(server, client, runtime):
    """The count /tokenize gives for messages is the prompt_tokens of the chat answer."""
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        out = json_post(http, "/tokenize", {"messages": CHAT}).json()
    want = runtime.tokenizer.encode(runtime.apply_chat_template(CHAT), add_special_tokens=False)
    assert out["tokens"] == want and out["count"] == len(want)
    answer = client.chat.completions.create(model=runtime.model_path.name, messages=CHAT,
                                            max_tokens=1)
    assert answer.usage.prompt_tokens == out["count"]
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        bare = json_post(http, "/tokenize", {"messages": CHAT,
                                             "add_generation_prompt": False}).json()
    assert bare["tokens"] == runtime.tokenizer.encode(
        runtime.apply_chat_template(CHAT, add_generation_prompt=False),
        add_special_tokens=False)
    assert bare["count"] < out["count"]


@pytest.mark.slow
def test_tokenize_refusals_name_the_problem(server, runtime):
    vocab = runtime.engine.config.vocab_size
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        message = refusal(json_post(http, "/detokenize", {"tokens": [5, vocab + 7]}))
        assert f"tokens[1]: {vocab + 7} is not a token id of this model" in message
        assert "tokens[0]" in refusal(json_post(http, "/detokenize", {"tokens": [-1]}))
        assert "unknown field 'foo'" in refusal(json_post(http, "/tokenize",
                                                          {"prompt": "a", "foo": 1}))
        assert "continue_final_message" in refusal(json_post(http, "/tokenize", {
            "messages": CHAT, "continue_final_message": True}))
        assert "prompt" in refusal(json_post(http, "/tokenize", {"prompt": 5}))
        for path, body in [("/tokenize", {"model": "gpt-4o", "prompt": "a"}),
                           ("/detokenize", {"model": "gpt-4o", "tokens": [5]})]:
            r = json_post(http, path, body)
            assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# ---- names ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_default_name_is_the_folders_not_its_path(client, server, runtime):
    name = runtime.model_path.name
    models = client.models.list().data
    assert [m.id for m in models] == [name]
    assert "/" not in name and models[0].root == str(runtime.model_path)
    out = client.completions.create(model=name, prompt="Hi", max_tokens=1)
    assert out.model == name
    chat = client.chat.completions.create(model=name, messages=CHAT, max_tokens=1)
    assert chat.model == name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model=str(runtime.model_path), prompt="Hi", max_tokens=1)
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        assert http.get("/model_info").json()["served_model_name"] == name
