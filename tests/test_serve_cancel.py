"""A client that disconnects aborts its request: streamed or not, on each POST route, a
real socket closed mid-generation leaves nothing running in the engine within a couple of
engine steps, the abort is counted, and the server answers the next request. Stopping the
server cancels what still runs."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from sgl_nb.server.serve import start_in_thread

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
LONG = 4000  # tokens: minutes on a CPU, unless aborted
BODIES = {
    "/v1/completions": {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True,
                        "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}],
                             "max_tokens": LONG, "ignore_eos": True, "temperature": 0},
    "/generate": {"text": PROMPT, "sampling_params": {"max_new_tokens": LONG,
                                                      "ignore_eos": True, "temperature": 0}},
}


@pytest.fixture(scope="module")
def server(runtime):
    srv = start_in_thread(runtime)
    yield srv
    srv.shutdown()


def open_request(url: str, path: str, body: dict) -> socket.socket:
    """A POST sent on a raw socket, left open."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_events(sock: socket.socket, n: int) -> bytes:
    got = b""
    while got.count(b"data:") < n:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended early: {got[-300:]!r}"
        got += chunk
    return got


def wait_running(rt, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while rt.metrics()["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def idle(m: dict) -> bool:
    return m["running"] == m["waiting"] == m["prefilling"] == m["suspended"] == 0


def wait_aborted(rt, before: int, timeout: float = 10.0) -> float:
    """Seconds until the engine has aborted one more request and runs nothing."""
    t0 = time.monotonic()
    while True:
        m = rt.metrics()
        if m["aborted"] > before and idle(m):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"not aborted after {timeout} s: {m}"
        time.sleep(0.01)


def step_seconds(rt) -> float:
    """The engine's mean step so far: what 'within one engine step' means on this machine."""
    m = rt.metrics()
    return m["busy_seconds"] / max(1, sum(m["steps"].values()))


def assert_serves(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                   "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_aborts_its_request(server, runtime, path, stream):
    before = runtime.metrics()["aborted"]
    sock = open_request(server.url, path, {**BODIES[path], "stream": stream})
    if stream:
        read_events(sock, 3)  # tokens are flowing
    else:
        wait_running(runtime)
        time.sleep(0.3)  # a few decode steps in
    generated = runtime.metrics()["generated_tokens"]
    sock.close()
    took = wait_aborted(runtime, before)
    print(f"{path} stream={stream}: aborted {took * 1000:.0f} ms after the disconnect "
          f"(mean engine step {step_seconds(runtime) * 1000:.0f} ms)")
    # A few steps of slack: the two cores here are shared with other work.
    assert took < max(2.0, 10 * step_seconds(runtime)), took
    assert runtime.metrics()["generated_tokens"] - generated < 100  # it did not run on
    assert_serves(server.url)


def test_a_client_gone_before_the_first_token_aborts_too(server, runtime):
    """Disconnect while the request may still be queued or prefilling: the watch is on the
    connection, not on the next write."""
    before = runtime.metrics()["aborted"]
    long_prompt = "Tell me a story about a lighthouse keeper. " * 150  # a long prefill
    sock = open_request(server.url, "/v1/completions", {
        "prompt": long_prompt, "max_tokens": LONG, "ignore_eos": True, "stream": True})
    time.sleep(0.05)
    sock.close()
    wait_aborted(runtime, before)
    assert_serves(server.url)


def test_shutdown_cancels_what_still_runs(runtime):
    srv = start_in_thread(runtime)
    before = runtime.metrics()["aborted"]
    sock = open_request(srv.url, "/v1/completions", {**BODIES["/v1/completions"],
                                                     "stream": True})
    read_events(sock, 2)
    t0 = time.monotonic()
    srv.shutdown()
    assert time.monotonic() - t0 < 10  # the grace period, then cancelled; not 4000 tokens
    wait_aborted(runtime, before)
    sock.close()
