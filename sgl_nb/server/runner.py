"""Running the app under uvicorn: in the foreground (`sgl-nb serve`) or from a background
thread (a notebook, the tests). The socket is bound here, before uvicorn starts, so a busy
port fails at once with the OS's own error and port 0 is known before the first request."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from sgl_nb.server.app import build_app

# On shutdown, requests still running get this long, then they are cancelled (aborted in
# the engine): stopping never waits for a long generation.
GRACE_SECONDS = 2.0


def bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def make_server(runtime, quiet: bool, api_key: str | None, thread: bool,
                model_names: list[str] | None = None) -> uvicorn.Server:
    config = uvicorn.Config(
        build_app(runtime, api_key, model_names), lifespan="off", access_log=not quiet,
        log_level="warning" if quiet else "info", timeout_graceful_shutdown=GRACE_SECONDS,
        # From a thread, leave the host program's logging as it was configured.
        **({"log_config": None} if thread else {}))
    return uvicorn.Server(config)


class ServerThread:
    """uvicorn serving `runtime` from a daemon thread; `.shutdown()` stops it."""

    def __init__(self, runtime, host: str, port: int, quiet: bool, api_key: str | None,
                 model_names: list[str] | None = None):
        self.socket = bind(host, port)
        self.url = url_of(self.socket)
        self.socket.listen(2048)
        self._server = make_server(runtime, quiet, api_key, thread=True,
                                   model_names=model_names)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self.socket]},
                                        name="sgl-serve", daemon=True)
        self._thread.start()
        self._wait_started(30.0)

    def _wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.socket.close()
                raise RuntimeError(f"sgl-nb serve did not start on {self.url}")
            time.sleep(0.01)

    def shutdown(self, timeout: float = GRACE_SECONDS + 10.0) -> None:
        """Stop accepting, cancel what still runs after the grace period, join."""
        self._server.should_exit = True
        self._thread.join(timeout)

    def server_close(self) -> None:
        """Close the listening socket (shutdown() does; kept for callers that call both)."""
        self.socket.close()


def serve_forever(runtime, sock: socket.socket, quiet: bool, api_key: str | None,
                  model_names: list[str] | None = None) -> None:
    """In the foreground until SIGINT or SIGTERM (uvicorn handles both, then re-raises)."""
    sock.listen(2048)
    make_server(runtime, quiet, api_key, thread=False,
                model_names=model_names).run(sockets=[sock])
