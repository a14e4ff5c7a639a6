"""Stopping `sgl-nb serve` while it is busy: every client gets a well-formed end with the text
it had so far. Non-streamed and streamed requests (the `openai` package and raw HTTP, OpenAI's
routes and SGLang's /generate) are generating when the server gets SIGTERM or SIGINT (a real
child process on the default model), or when a notebook's `start_in_thread(...).shutdown()`
is called. After the grace period the engine aborts them: each non-streamed one gets a 200
with finish_reason "abort" and its text so far, each stream its last chunk (finish_reason,
usage) and `data: [DONE]` on a body that ends properly; no 500, no traceback, exit code 0,
and the aborts counted. Meanwhile new requests get 503 with Retry-After, and a second
SIGINT exits at once."""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.serve_child import ServeChild
from support.waits import WAIT, limit, until

from sgl_nb.server.serve import start_in_thread

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": PROMPT}]
# Tokens: minutes on a CPU, so every request is still generating when the grace period
# (2 s) ends. The 8 engine requests fit the KV pools used here.
LONG = 1500
ENGINE_REQUESTS = 8  # the completion's n=2, chat, /generate, and 4 streams
KV_POOL = "16384"
STOPPED = re.compile(r"stopped: (\d+) requests were in flight, (\d+) aborted")


@dataclass
class Ending:
    text: str
    finish: str | None
    token_ids: list[int] | None = None


@dataclass
class Client:
    """One request on its own thread: what came back, and how it ended."""

    name: str
    stream: bool
    run: Callable[[Client], None]
    text: str = ""  # a stream's text so far
    at_stop: str | None = None  # a stream's text when the stop began
    endings: list[Ending] = field(default_factory=list)
    usage: dict | None = None
    done: bool = False  # a raw stream: `data: [DONE]` came, last
    error: BaseException | None = None
    first_text: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self._main, name=self.name, daemon=True)
        t.start()
        return t

    def _main(self) -> None:
        try:
            self.run(self)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def streamed(self, text: str, cumulative: bool = False) -> None:
        self.text = text if cumulative else self.text + text
        if self.text:
            self.first_text.set()


def openai_client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", timeout=WAIT, max_retries=0)


def clients(url: str) -> list[Client]:
    oa = openai_client(url)
    model = oa.models.list().data[0].id
    long = {"max_tokens": LONG, "temperature": 0}
    usage = {"stream_options": {"include_usage": True}}

    def completion(c: Client) -> None:  # n=2: two engine requests after a shared prefill
        out = oa.completions.create(model=model, prompt=PROMPT, n=2, **long, extra_body={
            "ignore_eos": True, "return_token_ids": True})
        c.endings = [Ending(ch.text, ch.finish_reason, ch.model_extra["token_ids"])
                     for ch in out.choices]
        c.usage = out.usage.model_dump()

    def chat(c: Client) -> None:
        out = oa.chat.completions.create(model=model, messages=MESSAGES, **long,
                                         extra_body={"ignore_eos": True})
        c.endings = [Ending(out.choices[0].message.content, out.choices[0].finish_reason)]
        c.usage = out.usage.model_dump()

    def generate(c: Client) -> None:
        r = httpx.post(url + "/generate", timeout=WAIT, json={
            "text": PROMPT, "sampling_params": {"max_new_tokens": LONG, "temperature": 0,
                                                "ignore_eos": True}})
        assert r.status_code == 200, r.text
        out = r.json()
        c.endings = [Ending(out["text"], out["meta_info"]["finish_reason"]["type"],
                            out["output_ids"])]
        c.usage = {"completion_tokens": out["meta_info"]["completion_tokens"]}

    def completion_stream(c: Client) -> None:
        finish = None
        for chunk in oa.completions.create(model=model, prompt=PROMPT, stream=True, **long,
                                           **usage, extra_body={"ignore_eos": True}):
            if chunk.choices:
                c.streamed(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                c.usage = chunk.usage.model_dump()
        c.endings = [Ending(c.text, finish)]

    def chat_stream(c: Client) -> None:
        finish = None
        for chunk in oa.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                                **long, **usage,
                                                extra_body={"ignore_eos": True}):
            if chunk.choices:
                c.streamed(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                c.usage = chunk.usage.model_dump()
        c.endings = [Ending(c.text, finish)]

    def raw_completion_stream(c: Client) -> None:
        finish = None
        for event in sse(url + "/v1/completions", c, {
                "prompt": PROMPT, "stream": True, "ignore_eos": True, **long, **usage}):
            if event["choices"]:
                c.streamed(event["choices"][0]["text"])
                finish = event["choices"][0]["finish_reason"] or finish
            if event.get("usage"):
                c.usage = event["usage"]
        c.endings = [Ending(c.text, finish)]

    def raw_generate_stream(c: Client) -> None:
        last = None
        for last in sse(url + "/generate", c, {
                "text": PROMPT, "stream": True, "sampling_params": {
                    "max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}}):
            c.streamed(last["text"], cumulative=True)  # SGLang's events carry the text so far
        meta = last["meta_info"]
        c.endings = [Ending(last["text"], meta["finish_reason"]["type"], last["output_ids"])]
        c.usage = {"completion_tokens": meta["completion_tokens"]}

    return [Client("openai completion n=2", False, completion),
            Client("openai chat", False, chat),
            Client("raw /generate", False, generate),
            Client("openai completion stream", True, completion_stream),
            Client("openai chat stream", True, chat_stream),
            Client("raw /v1/completions stream", True, raw_completion_stream),
            Client("raw /generate stream", True, raw_generate_stream)]


def sse(url: str, c: Client, body: dict):
    """A stream's events read off the wire; `data: [DONE]` must come last, and the chunked
    body must end properly (httpx raises on one cut short)."""
    with httpx.stream("POST", url, json=body, timeout=WAIT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            assert not c.done, f"an event after [DONE]: {line!r}"
            if line == "data: [DONE]":
                c.done = True
            else:
                yield json.loads(line.removeprefix("data: "))


def scrape(url: str) -> dict[tuple, float]:
    r = httpx.get(url + "/metrics", timeout=WAIT)
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def engine_running(url: str) -> float:
    return scrape(url).get(("sgl_nb_num_requests_running", ()), 0.0)


def aborted_total(url: str) -> float:
    return scrape(url).get(("sgl_nb_requests_aborted_total", ()), 0.0)


def start_all(url: str) -> tuple[list[Client], list[threading.Thread]]:
    """Every client's request generating, and every stream's first text received."""
    cs = clients(url)
    threads = [c.start() for c in cs]
    until(lambda: engine_running(url) >= ENGINE_REQUESTS
          or any(c.error for c in cs), "every request generating", timeout=limit(600))
    for c in cs:
        if c.stream:
            until(lambda c=c: c.first_text.is_set() or c.error, f"{c.name}: its first text")
    assert not [c for c in cs if c.error], [(c.name, c.error) for c in cs if c.error]
    return cs, threads


def stop_began(cs: list[Client]) -> None:
    for c in cs:
        c.at_stop = c.text


def check_endings(cs: list[Client], threads: list[threading.Thread], tokenizer) -> None:
    for t in threads:
        t.join(WAIT)
    for c in cs:
        assert c.error is None, f"{c.name}: {c.error!r}"
        assert c.endings, f"{c.name}: no answer"
        for e in c.endings:
            assert e.finish == "abort", f"{c.name}: finish_reason {e.finish!r}"
            assert e.text, f"{c.name}: the text so far is missing"
            if e.token_ids is not None:  # the text is exactly the tokens generated
                assert tokenizer.decode(e.token_ids, skip_special_tokens=True) == e.text
        assert c.usage and c.usage["completion_tokens"] >= len(c.endings), c.name
        if c.stream:
            assert c.at_stop and c.endings[0].text.startswith(c.at_stop), (
                f"{c.name}: streamed {c.at_stop!r} before the stop, ended with "
                f"{c.endings[0].text!r}")
        if c.name.startswith("raw") and c.stream:
            assert c.done, f"{c.name}: no data: [DONE]"


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_every_request_well(model_path, tokenizer, sig):
    child = ServeChild("--model", str(model_path), "--kv-pool-tokens", KV_POOL)
    try:
        cs, threads = start_all(child.url)
        stop_began(cs)
        child.signal(sig)
        check_endings(cs, threads, tokenizer)
        code = child.wait()
    finally:
        child.kill()
    out = child.output()
    assert code == 0, out
    assert "Traceback" not in out and "ERROR" not in out, out
    found = STOPPED.search(out)
    assert found, out
    assert (int(found[1]), int(found[2])) == (len(cs), ENGINE_REQUESTS), found[0]


def test_while_stopping_new_requests_get_503_and_a_second_sigint_exits_at_once(model_path):
    """A grace period longer than the test: a short request in flight finishes in it, a
    long stream still streams; /health and new requests get 503 with Retry-After, /metrics
    still answers; only the second SIGINT ends it, at once."""
    child = ServeChild("--model", str(model_path), "--kv-pool-tokens", KV_POOL,
                       "--shutdown-grace", str(limit(3600)))
    try:
        long = Client("long stream", True, lambda c: [
            c.streamed(e["choices"][0]["text"]) for e in sse(
                child.url + "/v1/completions", c, {"prompt": PROMPT, "stream": True,
                                                   "max_tokens": LONG, "ignore_eos": True})
            if e["choices"]])
        long.start()
        until(lambda: long.first_text.is_set() or long.error, "the long stream's first text")
        short = httpx.Client(base_url=child.url, timeout=WAIT)
        short_reply: list[httpx.Response] = []
        threading.Thread(target=lambda: short_reply.append(short.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True})), daemon=True).start()
        until(lambda: engine_running(child.url) >= 2 or short_reply, "both requests generating")
        child.signal(signal.SIGTERM)

        until(lambda: httpx.get(child.url + "/health", timeout=WAIT).status_code == 503,
              "/health answering 503")
        health = httpx.get(child.url + "/health", timeout=WAIT)
        assert int(health.headers["retry-after"]) >= 1
        new = httpx.post(child.url + "/v1/completions", timeout=WAIT,
                         json={"prompt": PROMPT, "max_tokens": 2})
        assert new.status_code == 503 and int(new.headers["retry-after"]) >= 1
        assert new.json()["error"]["code"] == 503
        assert httpx.get(child.url + "/metrics", timeout=WAIT).status_code == 200

        until(lambda: short_reply, "the short request's answer")
        assert short_reply[0].status_code == 200
        assert short_reply[0].json()["choices"][0]["finish_reason"] == "length"
        streamed = len(long.text)
        until(lambda: len(long.text) > streamed, "the long stream going on in the grace")

        child.signal(signal.SIGINT)
        assert child.wait() == 130
    finally:
        child.kill()


def test_shutdown_from_a_notebook_ends_every_request_well(runtime, tokenizer, caplog):
    srv = start_in_thread(runtime)
    try:
        before = aborted_total(srv.url)
        cs, threads = start_all(srv.url)
        stop_began(cs)
        stopped = srv.shutdown(timeout=WAIT)
        check_endings(cs, threads, tokenizer)
    finally:
        srv.shutdown()
    assert (stopped.in_flight, stopped.aborted, stopped.forced) == (len(cs), ENGINE_REQUESTS,
                                                                    False)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], [
        r.getMessage() for r in caplog.records]
    again = start_in_thread(runtime)  # the same Runtime served again: its /metrics
    try:
        assert aborted_total(again.url) - before == ENGINE_REQUESTS
    finally:
        again.shutdown()
