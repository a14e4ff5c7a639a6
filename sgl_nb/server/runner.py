"""Running the app under uvicorn: in the foreground (`sgl-nb serve`) or from a background
thread (a notebook, the tests). The socket is bound here, before uvicorn starts, so a busy
port fails at once with the OS's own error and port 0 is known before the first request.

Stopping is the server's own (shutdown.py): uvicorn's signal handler is replaced, and
uvicorn is told to exit only once every request in flight has been answered."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from sgl_nb.server.app import build_app
from sgl_nb.server.shutdown import ANSWER_SECONDS, ShutdownGate, Stopped

# uvicorn's own graceful timeout, after the drain: every answer has been sent by then,
# what is left is closing the connections.
CLOSE_SECONDS = 1.0


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


class Server(uvicorn.Server):
    """uvicorn's server, stopped in the server's order: the first SIGINT or SIGTERM (or
    `stop()` from another thread) drains through the gate, then uvicorn closes the
    connections; a second SIGINT exits at once. `on_ready` is called once the socket
    accepts connections; `say` gets a line when the stop begins."""

    def __init__(self, config: uvicorn.Config, gate: ShutdownGate,
                 on_ready: Callable[[], None] | None = None,
                 say: Callable[[str], None] | None = None):
        super().__init__(config)
        self.gate, self.on_ready, self.say = gate, on_ready, say
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_asked = False
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._loop = asyncio.get_running_loop()
        if self.started and self.on_ready is not None:
            self.on_ready()

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (uvicorn installs it in the main thread). Unlike uvicorn's,
        it does not re-raise the signal afterwards: the stop ends in a clean return."""
        if not self._stop_asked:
            self.stop()
        elif sig == signal.SIGINT:
            self.force_exit = self.should_exit = True

    def stop(self) -> None:
        """Begin the stop, from any thread."""
        self._stop_asked = True
        if self._loop is None:  # not serving yet: nothing in flight
            self.should_exit = True
            return
        try:
            self._loop.call_soon_threadsafe(self._begin_drain)
        except RuntimeError:  # the loop has already closed
            pass

    def _begin_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        if self.say is not None:
            self.say(f"stopping: {self.gate.in_flight} requests in flight get "
                     f"{self.gate.grace:g} s, then are aborted (Ctrl-C again: exit now)")
        await self.gate.drain()
        self.should_exit = True

    def stopped(self) -> Stopped:
        report = self.gate.report
        report.forced = self.force_exit
        return report


def make_server(runtime, quiet: bool, api_key: str | None, thread: bool,
                model_names: list[str] | None, grace: float,
                on_ready: Callable[[], None] | None = None,
                say: Callable[[str], None] | None = None,
                clip_max_tokens: bool = False) -> Server:
    app = build_app(runtime, api_key, model_names, clip_max_tokens)
    gate = ShutdownGate(app, app.state.served.log, grace)
    config = uvicorn.Config(
        gate, lifespan="off", access_log=not quiet,
        log_level="warning" if quiet else "info", timeout_graceful_shutdown=CLOSE_SECONDS,
        # From a thread, leave the host program's logging as it was configured.
        **({"log_config": None} if thread else {}))
    return Server(config, gate, on_ready, say)


class ServerThread:
    """uvicorn serving `runtime` from a daemon thread; `.shutdown()` stops it as a signal
    stops `sgl-nb serve`."""

    def __init__(self, runtime, host: str, port: int, quiet: bool, api_key: str | None,
                 model_names: list[str] | None, grace: float,
                 clip_max_tokens: bool = False):
        self.socket = bind(host, port)
        self.url = url_of(self.socket)
        self.socket.listen(2048)
        self._ready = threading.Event()
        self._server = make_server(runtime, quiet, api_key, thread=True,
                                   model_names=model_names, grace=grace,
                                   on_ready=self._ready.set, clip_max_tokens=clip_max_tokens)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self.socket]},
                                        name="sgl-serve", daemon=True)
        self._thread.start()
        self._wait_started(30.0)

    def _wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.01):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.socket.close()
                raise RuntimeError(f"sgl-nb serve did not start on {self.url}")

    def shutdown(self, timeout: float | None = None) -> Stopped:
        """Stop accepting (new requests get 503), give running requests the grace period,
        abort what is left (each answered with its text so far), then join. timeout: how
        long to wait for that (default: the grace period and the answers' limit)."""
        if timeout is None:
            timeout = self._server.gate.grace + ANSWER_SECONDS + 10.0
        if self._thread.is_alive():
            self._server.stop()
            self._thread.join(timeout)
        return self._server.stopped()

    def server_close(self) -> None:
        """Close the listening socket (shutdown() does; kept for callers that call both)."""
        self.socket.close()


def serve_forever(runtime, sock: socket.socket, quiet: bool, api_key: str | None,
                  model_names: list[str] | None, grace: float,
                  on_ready: Callable[[], None] | None = None,
                  say: Callable[[str], None] | None = None,
                  clip_max_tokens: bool = False) -> Stopped:
    """In the foreground until SIGINT or SIGTERM; what the stop did. The socket starts
    listening when uvicorn serves on it (then on_ready is called), not before."""
    server = make_server(runtime, quiet, api_key, thread=False, model_names=model_names,
                         grace=grace, on_ready=on_ready, say=say,
                         clip_max_tokens=clip_max_tokens)
    server.run(sockets=[sock])
    return server.stopped()
