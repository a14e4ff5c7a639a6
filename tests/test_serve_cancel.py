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
from support.waits import WAIT, until

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
    sock = socket.create_connection((host, int(port)), timeout=WAIT)
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


def wait_running(rt, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while rt.metrics()["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def wait_decoded(rt, since: int, n: int = 3) -> None:
    """Until the engine has generated n more tokens than `since` (its generated_tokens)."""
    until(lambda: rt.metrics()["generated_tokens"] >= since + n, f"{n} tokens decoded")


def wait_admitted(rt) -> None:
    """Until the engine has the request (queued, prefilling or decoding)."""
    until(lambda: rt.metrics()["waiting"] + rt.metrics()["prefilling"]
          + rt.metrics()["running"] > 0, "the request reaching the engine")


def idle(m: dict) -> bool:
    return m["running"] == m["waiting"] == m["prefilling"] == m["suspended"] == 0


def wait_aborted(rt, before: int, timeout: float = WAIT) -> float:
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
                                                   "temperature": 0}, timeout=WAIT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_aborts_its_request(server, runtime, path, stream):
    before = runtime.metrics()["aborted"]
    since = runtime.metrics()["generated_tokens"]
    sock = open_request(server.url, path, {**BODIES[path], "stream": stream})
    if stream:
        read_events(sock, 3)  # tokens are flowing
    else:
        wait_running(runtime)
        wait_decoded(runtime, since)  # a few decode steps in
    generated = runtime.metrics()["generated_tokens"]
    sock.close()
    took = wait_aborted(runtime, before)
    print(f"{path} stream={stream}: aborted {took * 1000:.0f} ms after the disconnect "
          f"(mean engine step {step_seconds(runtime) * 1000:.0f} ms)")
    # Counted in tokens (engine steps), not seconds: a busy machine slows both alike.
    assert runtime.metrics()["generated_tokens"] - generated < 100  # it did not run on
    assert_serves(server.url)


def test_a_client_gone_before_the_first_token_aborts_too(server, runtime):
    """Disconnect while the request may still be queued or prefilling: the watch is on the
    connection, not on the next write."""
    before = runtime.metrics()["aborted"]
    long_prompt = "Tell me a story about a lighthouse keeper. " * 150  # a long prefill
    sock = open_request(server.url, "/v1/completions", {
        "prompt": long_prompt, "max_tokens": LONG, "ignore_eos": True, "stream": True})
    wait_admitted(runtime)
    sock.close()
    wait_aborted(runtime, before)
    assert_serves(server.url)


def test_shutdown_cancels_what_still_runs(runtime):
    srv = start_in_thread(runtime)
    before = runtime.metrics()["aborted"]
    sock = open_request(srv.url, "/v1/completions", {**BODIES["/v1/completions"],
                                                     "stream": True})
    read_events(sock, 2)
    srv.shutdown(timeout=WAIT)  # returns once the server thread has ended
    # Aborted with its client still connected: the shutdown cancelled it after the grace
    # period (its 4,000 tokens would take minutes).
    wait_aborted(runtime, before)
    sock.close()
