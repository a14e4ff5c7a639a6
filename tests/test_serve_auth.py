"""`sgl-nb serve --api-key`: every route but /health wants `Authorization: Bearer <key>`;
a non-loopback host without a key refuses to start, before the model loads."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

import sgl_nb as sgl
from sgl_nb.backends.remote.http import RemoteError
from sgl_nb.server.serve import API_KEY_ENV, is_loopback, refusal, start_in_thread

KEY = "sk-test-4f1c"


def serve_cmd(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    return subprocess.run([sys.executable, "-m", "sgl_nb.cli", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})})


def test_loopback_hosts():
    for host in ("127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.7", "10.0.0.1", "example.com"):
        assert not is_loopback(host), host
    assert refusal("0.0.0.0", None, False) and refusal("0.0.0.0", KEY, False) is None
    assert refusal("0.0.0.0", None, True) is None and refusal("127.0.0.1", None, False) is None


def test_a_public_host_without_a_key_refuses_before_loading_the_model(tmp_path):
    missing = tmp_path / "no-model-here"  # loading it would fail otherwise, and differently
    proc = serve_cmd("--host", "0.0.0.0", "--model", str(missing))
    assert proc.returncode == 2, proc.stderr
    assert "refusing to serve on 0.0.0.0 without an API key" in proc.stderr
    assert "--api-key" in proc.stderr and "--allow-unauthenticated" in proc.stderr
    assert API_KEY_ENV in proc.stderr
    assert "loaded" not in proc.stdout


@pytest.mark.parametrize("how", ["env", "flag", "allow"])
def test_a_key_or_the_explicit_flag_lets_it_go_on(tmp_path, how):
    """It gets as far as loading the model (which is missing here, so it stops there)."""
    missing = tmp_path / "no-model-here"
    args = ["--host", "0.0.0.0", "--model", str(missing)]
    env = {API_KEY_ENV: KEY} if how == "env" else None
    if how == "flag":
        args += ["--api-key", KEY]
    if how == "allow":
        args += ["--allow-unauthenticated"]
    proc = serve_cmd(*args, env=env)
    assert proc.returncode not in (0, 2) and "refusing" not in proc.stderr
    assert str(missing) in proc.stderr  # the model's own error
    assert ("without an API key" in proc.stderr) == (how == "allow")


@pytest.fixture(scope="module")
def server(runtime):
    srv = start_in_thread(runtime, api_key=KEY)
    yield srv
    srv.shutdown()


BODY = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.mark.slow
@pytest.mark.parametrize("headers,needle", [
    ({}, "missing API key"), ({"Authorization": "Bearer wrong"}, "invalid API key"),
    ({"Authorization": f"Bearer {KEY}x"}, "invalid API key"),
    ({"Authorization": f"Basic {KEY}"}, "must be 'Bearer <key>'"),
    ({"Authorization": "Bearer"}, "must be 'Bearer <key>'")])
def test_without_the_right_key_every_route_is_401(server, headers, needle):
    for method, path in (("POST", "/v1/completions"), ("POST", "/generate"),
                         ("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/flush_cache"),
                         ("GET", "/get_server_info"), ("GET", "/no-such-route")):
        r = httpx.request(method, server.url + path, json=BODY, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and err["code"] == 401
        assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.slow
def test_the_right_key_passes_and_health_needs_none(server, runtime):
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json=BODY, timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == runtime.generate("Hello", max_tokens=2).text
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert client.models.list().data[0].id == runtime.model_path.name


@pytest.mark.slow
def test_runtime_endpoint_sends_its_key(server, runtime):
    ep = sgl.RuntimeEndpoint(server.url, api_key=KEY)
    assert ep.generate("Hello", max_tokens=2).text == runtime.generate("Hello",
                                                                       max_tokens=2).text
    with pytest.raises(RemoteError, match="HTTP 401: missing API key"):
        sgl.RuntimeEndpoint(server.url, model="m").generate("Hello", max_tokens=2)
