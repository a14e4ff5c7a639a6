"""`sgl-nb serve` as a child process for the tests that stop it: its flags, its output kept
whole (the stop's lines, and that no traceback is among them), signals, the exit code."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import httpx

from support.waits import WAIT, limit, until

READY = re.compile(r"serving on (http://\S+) ")


class ServeChild:
    """Started with `flags` after `sgl-nb serve --port 0`; `.url` once it says it serves."""

    def __init__(self, *flags: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sgl_nb.cli", "serve", "--port", "0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        until(lambda: self._ready_url() or self.proc.poll() is not None,
              "sgl-nb serve's ready line", timeout=limit(600))
        url = self._ready_url()
        assert url, f"sgl-nb serve exited ({self.proc.returncode}):\n{self.output()}"
        self.url = url
        # The line is the promise: one request at once, no retry, is answered.
        assert httpx.get(self.url + "/health", timeout=WAIT).status_code == 200

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def _ready_url(self) -> str | None:
        for line in list(self.lines):
            if found := READY.search(line):
                return found.group(1)
        return None

    def output(self) -> str:
        return "".join(self.lines)

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self) -> int:
        """Its exit code, and all its output read."""
        code = self.proc.wait(WAIT)
        self._reader.join(WAIT)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT)
