"""A small HTTP client for remote backends: JSON requests and server-sent events, with a
connect timeout and a read timeout on every socket read, so a silent server never hangs a
program. Errors name the server and the request."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from sgl_nb.backends.remote.cancel import CancelToken


class RemoteError(RuntimeError):
    """A request to a remote server failed. The message names the server and the request."""

    def __init__(self, server: str, request: str, problem: str, status: int | None = None):
        super().__init__(f"{server}: {request}: {problem}")
        self.server, self.request, self.problem, self.status = server, request, problem, status


class RemoteFeatureError(RemoteError, ValueError):
    """The server (or its API) does not offer a feature the program uses."""


@dataclass
class Timeouts:
    connect: float = 10.0  # seconds to open the connection
    read: float = 300.0  # seconds any one read may wait (first token of a long prefill)


def server_root(base_url: str) -> str:
    """The server's root URL: OpenAI's clients take `http://host:8000/v1`, and this client
    adds the /v1 itself (SGLang's native routes are at the root)."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1").rstrip("/") if url.endswith("/v1") else url


class HttpClient:
    """One base URL (with or without OpenAI's /v1); every call opens its own connection, so
    concurrent requests (fork branches, batch items) never share a socket. A call given a
    CancelToken stops, with a RemoteError, once the token is cancelled."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None,
                 timeouts: Timeouts | None = None):
        url = urllib.parse.urlsplit(server_root(base_url))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url must be http(s)://host[:port][/path], got {base_url!r}")
        self.base_url = server_root(base_url)
        self._url = url
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.timeouts = timeouts or Timeouts()

    def _connect(self, request: str) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._url.scheme == "https" else \
            http.client.HTTPConnection
        conn = cls(self._url.hostname, self._url.port, timeout=self.timeouts.connect)
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise RemoteError(self.base_url, request, f"cannot connect ({_reason(e)})") from e
        conn.sock.settimeout(self.timeouts.read)
        return conn

    def _send(self, method: str, path: str, body: dict | None, headers: dict | None,
              request: str, cancel: CancelToken | None = None
              ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connect(request)
        if cancel is not None:
            cancel.attach(conn)
        data = None if body is None else json.dumps(body).encode()
        try:
            conn.request(method, self._url.path + path, body=data,
                         headers={**self.headers, **(headers or {})})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self._close(conn, cancel)
            raise RemoteError(self.base_url, request, _reason(e)) from e
        if resp.status >= 400:
            detail = _read_error(resp)
            self._close(conn, cancel)
            raise RemoteError(self.base_url, request, f"HTTP {resp.status}: {detail}",
                              resp.status)
        return conn, resp

    @staticmethod
    def _close(conn: http.client.HTTPConnection, cancel: CancelToken | None) -> None:
        if cancel is not None:
            cancel.detach(conn)
        conn.close()

    def get_json(self, path: str, request: str | None = None) -> dict:
        return self.request_json("GET", path, None, request=request or f"GET {path}")

    def request_bytes(self, method: str, path: str, body: dict | None,
                      headers: dict | None = None, request: str | None = None,
                      cancel: CancelToken | None = None) -> bytes:
        """The answer's body as it came (some SGLang routes answer in plain text)."""
        request = request or f"{method} {path}"
        conn, resp = self._send(method, path, body, headers, request, cancel)
        try:
            return resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise RemoteError(self.base_url, request, f"reading the answer: {_reason(e)}") from e
        finally:
            self._close(conn, cancel)

    def request_json(self, method: str, path: str, body: dict | None,
                     headers: dict | None = None, request: str | None = None,
                     cancel: CancelToken | None = None):
        request = request or f"{method} {path}"
        raw = self.request_bytes(method, path, body, headers, request, cancel)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise RemoteError(self.base_url, request,
                              f"the answer is not JSON: {raw[:200]!r}") from e

    def post_sse(self, path: str, body: dict, headers: dict | None = None,
                 request: str | None = None, cancel: CancelToken | None = None
                 ) -> Iterator[dict]:
        """Each server-sent event's JSON data, until `data: [DONE]`. A stream that ends
        before [DONE] raises RemoteError (the caller decides whether it was complete)."""
        request = request or f"POST {path}"
        conn, resp = self._send("POST", path, body, headers, request, cancel)
        kind = resp.getheader("Content-Type") or ""
        if not kind.startswith("text/event-stream"):
            head = resp.read(200)
            self._close(conn, cancel)
            raise RemoteError(self.base_url, request,
                              f"expected an event stream, got {kind or 'no content type'}: "
                              f"{head!r}")
        try:
            yield from _events(resp, self.base_url, request)
        finally:
            self._close(conn, cancel)


def _events(resp: http.client.HTTPResponse, server: str, request: str) -> Iterator[dict]:
    data: list[str] = []
    n = 0
    while True:
        try:
            line = resp.readline()
        except (OSError, http.client.HTTPException) as e:
            raise RemoteError(server, request, f"the stream broke after {n} events "
                              f"({_reason(e)})") from e
        if not line:
            raise RemoteError(server, request, f"the stream ended after {n} events, "
                              "before the response was complete")
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        if text.startswith("data:"):
            data.append(text[5:].lstrip(" "))
            continue
        if text or not data:
            continue  # comments, event names, keep-alives
        payload, data = "\n".join(data), []
        if payload == "[DONE]":
            return
        n += 1
        try:
            event = json.loads(payload)
        except ValueError as e:
            raise RemoteError(server, request, f"event {n} is not JSON: {payload[:200]!r}") \
                from e
        if isinstance(event, dict) and "error" in event:
            raise RemoteError(server, request, f"the server reported: {event['error']}")
        yield event


def _read_error(resp: http.client.HTTPResponse) -> str:
    try:
        raw = resp.read(4096).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return resp.reason or "(no body)"
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw.strip()[:500] or resp.reason or "(no body)"
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err)[:500]


def _reason(e: BaseException) -> str:
    if isinstance(e, socket.timeout | TimeoutError):
        return f"timed out: {e}" if str(e) else "timed out"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused: is the server running?"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
