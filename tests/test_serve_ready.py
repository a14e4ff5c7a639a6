"""`sgl-nb serve`'s readiness: a refused bind (a public host without a key) is refused before
anything heavy is imported, and the "serving on ..." line comes only once the socket
accepts, so a client that starts on it is answered at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from support.serve_child import ServeChild
from support.waits import WAIT, until

from sgl_nb.server.runner import bind, make_server
from sgl_nb.server.serve import API_KEY_ENV, GRACE_SECONDS

HEAVY = ("torch", "transformers", "numpy", "uvicorn", "fastapi")

REFUSE = f"""
import json, sys
from sgl_nb.cli import main
code = main(["serve", "--host", "0.0.0.0", "--port", "0"])
print(json.dumps({{"code": code, "imported": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def test_an_unsafe_bind_is_refused_before_any_heavy_import():
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proc = subprocess.run([sys.executable, "-c", REFUSE], capture_output=True, text=True,
                          timeout=WAIT, env=env)
    assert "refusing to serve on 0.0.0.0 without an API key" in proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"code": 2, "imported": []}, out


@pytest.mark.slow
def test_on_ready_comes_once_the_socket_accepts(runtime):
    """What prints the ready line, on a socket bound but not yet listening (a connection
    is refused there): called back only when a connection is accepted."""
    sock = bind("127.0.0.1", 0)
    address = sock.getsockname()[:2]
    with pytest.raises(ConnectionRefusedError), socket.create_connection(address):
        pass
    accepted: list[bool] = []

    def ready() -> None:
        with socket.create_connection(address, timeout=WAIT):
            accepted.append(True)

    server = make_server(runtime, quiet=True, api_key=None, thread=True, model_names=None,
                         grace=GRACE_SECONDS, on_ready=ready)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    until(lambda: accepted or not thread.is_alive(), "the ready callback")
    server.stop()
    thread.join(WAIT)
    sock.close()
    assert accepted == [True]


@pytest.mark.slow
def test_the_ready_line_is_a_promise_and_an_idle_server_stops_cleanly(model_path):
    child = ServeChild("--model", str(model_path), "--kv-pool-tokens", "2048", "--quiet")
    try:  # ServeChild sent one request, with no retry, as soon as the line came
        assert httpx.get(child.url + "/health", timeout=WAIT).status_code == 200
        child.signal(signal.SIGTERM)
        code = child.wait()
    finally:
        child.kill()
    assert code == 0, child.output()
    assert "stopped: 0 requests were in flight, 0 aborted" in child.output()
