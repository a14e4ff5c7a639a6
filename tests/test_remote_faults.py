"""Faults on a remote backend: server down, a timeout, 4xx/5xx answers, a stream dropped
halfway, an error event, a server without prompt logprobs. Each gives a clear error on the
program's state naming the server and the request; other programs go on; nothing hangs.

The misbehaving server is a real one (a socket server in this file): the first path
segment of the URL picks how it misbehaves."""

from __future__ import annotations

import json
import socket
import socketserver
import threading

import pytest
from support.waits import WAIT

import sgl_nb as sgl
from sgl_nb.backends.remote.http import RemoteError, RemoteFeatureError

SSE_EVENT = {"id": "x", "choices": [{"index": 0, "text": "tok", "finish_reason": None}]}


class _Misbehaving(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        request_line = self.rfile.readline().decode()
        headers = {}
        while (line := self.rfile.readline().decode().strip()):
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        self.rfile.read(int(headers.get("content-length", 0)))
        self.server.seen.append((request_line.split()[1], headers))
        mode = request_line.split()[1].split("/")[1]
        getattr(self, f"do_{mode}")()

    def _send(self, status: str, body: bytes, kind: str = "application/json") -> None:
        self.wfile.write(f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                         + body)

    def do_hang(self) -> None:
        self.server.release.wait(60)  # never answers in time

    def do_e500(self) -> None:
        self._send("500 Internal Server Error",
                   json.dumps({"error": {"message": "CUDA out of memory"}}).encode())

    def do_e400(self) -> None:
        self._send("400 Bad Request", json.dumps({"error": {
            "message": "This model's maximum context length is 2048 tokens"}}).encode())

    def do_e404(self) -> None:
        self._send("404 Not Found", b'{"error": {"message": "no such route"}}')

    def do_garbage(self) -> None:
        self._send("200 OK", b"<html>proxy login</html>", "text/html")

    def do_drop(self) -> None:
        """Two events of a stream, then the connection closes: no finish, no [DONE]."""
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Connection: close\r\n\r\n")
        for _ in range(2):
            self.wfile.write(f"data: {json.dumps(SSE_EVENT)}\n\n".encode())
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)

    def do_errevent(self) -> None:
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Connection: close\r\n\r\n")
        self.wfile.write(f"data: {json.dumps(SSE_EVENT)}\n\n".encode())
        self.wfile.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')

    def do_nologprobs(self) -> None:
        """A plain OpenAI-compatible answer: no vLLM prompt_logprobs."""
        self._send("200 OK", json.dumps({"id": "c", "choices": [
            {"index": i, "text": "x", "finish_reason": "length"} for i in range(2)],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode())


@pytest.fixture(scope="module")
def bad_server():
    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    srv = Server(("127.0.0.1", 0), _Misbehaving)
    srv.seen, srv.release = [], threading.Event()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


@sgl.function
def ask(s):
    s += "Hello"
    s += sgl.gen("x", max_tokens=4)


def run_on(url: str, api: str = "openai", **kw) -> sgl.ProgramState:
    ep = sgl.RuntimeEndpoint(url, api=api, model="m", **kw)
    return ask.run(backend=ep)


def assert_error(st: sgl.ProgramState, server: str, *needles: str) -> RemoteError:
    err = st.error()
    assert isinstance(err, RemoteError), err
    msg = str(err)
    assert server in msg and f"program {st.id}" in msg
    assert "POST /v1/completions" in msg or "POST /generate" in msg
    for n in needles:
        assert n in msg, msg
    return err


def test_server_down():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    st = run_on(url)
    assert_error(st, url, "cannot connect", "connection refused")
    assert st.nodes[-2].status == "error"  # the Gen node; then Return


def test_timeout(bad_server):
    url = bad_server[0] + "/hang"
    st = run_on(url, timeout=1.0)
    assert_error(st, url, "timed out")


@pytest.mark.parametrize("mode,needle", [("e500", "HTTP 500: CUDA out of memory"),
                                         ("e400", "HTTP 400: This model's maximum context"),
                                         ("garbage", "expected an event stream, got text/html")])
def test_error_answers(bad_server, mode, needle):
    url = f"{bad_server[0]}/{mode}"
    for api in ("openai", "sglang"):
        st = run_on(url, api=api)
        err = assert_error(st, url, needle)
        assert err.status == (int(mode[1:]) if mode != "garbage" else None)
    # Without streaming (Runtime.generate's way) the same answers fail the same way.
    ep = sgl.RuntimeEndpoint(url, model="m")
    with pytest.raises(RemoteError, match="not JSON" if mode == "garbage" else needle):
        ep.generate("Hello", max_tokens=2)


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_stream_dropped_halfway(bad_server, api):
    url = bad_server[0] + "/drop"
    st = ask.run(backend=sgl.RuntimeEndpoint(url, api=api, model="m"), stream=True)
    assert "".join(st.text_iter()).startswith("Hello")  # the stream ends: no hang
    assert_error(st, url, "stream ended after 2 events")


def test_error_event_in_the_stream(bad_server):
    url = bad_server[0] + "/errevent"
    st = ask.run(backend=sgl.RuntimeEndpoint(url, model="m"), stream=True)
    assert_error(st, url, "engine died")


def test_select_without_prompt_logprobs_names_the_feature(bad_server, model_path):
    url = bad_server[0] + "/nologprobs"
    ep = sgl.RuntimeEndpoint(url, model="m", tokenizer_path=model_path)

    @sgl.function
    def pick(s):
        s += "Yes or no?"
        s += sgl.select("a", [" yes", " no"])

    err = pick.run(backend=ep).error()
    assert isinstance(err, RemoteFeatureError)
    assert "select needs prompt logprobs" in str(err) and url in str(err)


def test_traceparent_goes_with_each_request(bad_server):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    url, srv = bad_server[0] + "/e500", bad_server[1]
    ep = sgl.RuntimeEndpoint(url, model="m")
    spans = InMemorySpanExporter()
    sgl.enable_tracing(runtime=ep, exporter=spans)
    try:
        st = ask.run(backend=ep)
        assert st.error() is not None
    finally:
        sgl.disable_tracing()
    headers = [h for path, h in srv.seen if path.startswith("/e500")][-1]
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    gen_span = next(s for s in spans.get_finished_spans()
                    if format(s.context.span_id, "016x") == span_id)
    assert format(gen_span.context.trace_id, "032x") == trace_id  # the server joins it


def test_no_tokenizer_is_a_clear_error(bad_server):
    ep = sgl.RuntimeEndpoint(bad_server[0] + "/e404", model="m")
    with pytest.raises(RemoteError, match="tokenizer_path"):
        ep.chat_roles  # noqa: B018


@pytest.mark.slow
def test_other_programs_are_unaffected(bad_server, runtime):
    from sgl_nb.server.serve import start_in_thread

    good = start_in_thread(runtime)
    try:
        ep_good = sgl.RuntimeEndpoint(good.url)
        bad = ask.run_async(backend=sgl.RuntimeEndpoint(bad_server[0] + "/hang", model="m",
                                                        timeout=3.0))
        fine = [ask.run_async(backend=ep_good) for _ in range(3)]
        local = ask.run(backend=runtime)
        for f in fine:
            st = f.result(WAIT)
            assert st.error() is None and st.text() == local.text()
        assert isinstance(bad.result(WAIT).error(), RemoteError)
        # The same endpoint keeps working after a failed request on it.
        bad_ep = sgl.RuntimeEndpoint(good.url + "/nothing-here")
        assert isinstance(ask.run(backend=bad_ep).error(), RemoteError)
        assert ask.run(backend=ep_good).text() == local.text()
    finally:
        good.shutdown()
        good.server_close()
