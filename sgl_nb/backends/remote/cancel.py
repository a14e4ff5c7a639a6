"""Cancelling a remote request from another thread: its connection is shut down, which
wakes the thread blocked reading it and tells the server the client has gone (SGLang,
vLLM and `sgl-nb serve` abort a request whose client disconnects)."""

from __future__ import annotations

import http.client
import socket
import threading


class CancelToken:
    def __init__(self):
        self._lock = threading.Lock()
        self._conns: set[http.client.HTTPConnection] = set()
        self.cancelled = False

    def cancel(self) -> bool:
        """False if it was cancelled before."""
        with self._lock:
            if self.cancelled:
                return False
            self.cancelled = True
            conns = list(self._conns)
        for conn in conns:
            _shut(conn)
        return True

    def attach(self, conn: http.client.HTTPConnection) -> None:
        """Watch `conn` until detach(); a token already cancelled shuts it at once."""
        with self._lock:
            self._conns.add(conn)
            cancelled = self.cancelled
        if cancelled:
            _shut(conn)

    def detach(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._conns.discard(conn)


def _shut(conn: http.client.HTTPConnection) -> None:
    # shutdown, not close: close() from another thread leaves a blocked recv() waiting.
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed
