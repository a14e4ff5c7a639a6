"""Prometheus /metrics, scraped for real and parsed with prometheus_client's own text
parser, before and after requests: counters move by what the requests did, gauges show
the queues, the time to first token is observed once per finished request."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.waits import WAIT

from sgl_nb.server.serve import start_in_thread

pytestmark = pytest.mark.slow

PROMPT = "A particular sentence for the metrics test, about owls and moonlight."


@pytest.fixture(scope="module")
def server(runtime):
    srv = start_in_thread(runtime)
    yield srv
    srv.shutdown()


def scrape(url: str) -> dict[str, dict]:
    """{family name: {"type": ..., "samples": {(sample name, labels): value}}}."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        out[fam.name] = {"type": fam.type, "samples": {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}}
    return out


def value(metrics: dict, family: str, sample: str | None = None, **labels) -> float:
    samples = metrics.get(family, {}).get("samples", {})
    return samples.get((sample or family, tuple(sorted(labels.items()))), 0.0)


def test_kinds_of_metric(server):
    m = scrape(server.url)
    for name in ("sgl_nb_prompt_tokens", "sgl_nb_cached_prompt_tokens",
                 "sgl_nb_generation_tokens", "sgl_nb_requests_aborted", "sgl_nb_preemptions",
                 "sgl_nb_retractions"):
        assert m[name]["type"] == "counter", name
    for state in ("waiting", "prefilling", "running", "suspended"):
        assert m[f"sgl_nb_num_requests_{state}"]["type"] == "gauge"
    assert m["sgl_nb_time_to_first_token_seconds"]["type"] == "histogram"


def test_a_request_moves_the_counters(server, runtime):
    before = scrape(server.url)
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "temperature": 0})
    usage = r.json()["usage"]
    again = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "temperature": 0}).json()
    after = scrape(server.url)

    def delta(family: str, sample: str | None = None, **labels) -> float:
        return value(after, family, sample, **labels) - value(before, family, sample,
                                                              **labels)

    total = "sgl_nb_prompt_tokens_total"
    assert delta("sgl_nb_prompt_tokens", total) == 2 * usage["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0  # the second time, the prompt came from the radix cache
    assert delta("sgl_nb_cached_prompt_tokens", "sgl_nb_cached_prompt_tokens_total") == \
        usage["prompt_tokens_details"]["cached_tokens"] + cached
    assert delta("sgl_nb_generation_tokens", "sgl_nb_generation_tokens_total") == 10
    assert delta("sgl_nb_requests_finished", "sgl_nb_requests_finished_total",
                 finish_reason="length") == 2
    ttft = "sgl_nb_time_to_first_token_seconds"
    assert delta(ttft, ttft + "_count") == 2
    assert delta(ttft, ttft + "_sum") > 0
    assert value(after, ttft, ttft + "_bucket", le="+Inf") == value(after, ttft,
                                                                   ttft + "_count")
    assert value(after, "sgl_nb_num_requests_running") == 0


def test_an_abort_is_counted_and_the_running_gauge_shows_work(server, runtime):
    before = scrape(server.url)
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT)
    body = (b'{"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": true, '
            b'"stream": true}')
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    while b"data:" not in sock.recv(65536):
        pass
    during = scrape(server.url)
    assert value(during, "sgl_nb_num_requests_running") == 1
    sock.close()
    deadline = time.monotonic() + WAIT
    while runtime.metrics()["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    after = scrape(server.url)
    aborted = "sgl_nb_requests_aborted"
    assert value(after, aborted, aborted + "_total") - value(before, aborted,
                                                             aborted + "_total") == 1
    fin = "sgl_nb_requests_finished"
    assert value(after, fin, fin + "_total", finish_reason="abort") - value(
        before, fin, fin + "_total", finish_reason="abort") == 1
    assert value(after, "sgl_nb_num_requests_running") == 0
