"""`sgl-nb serve` in a child process, for the serve bench and its test: started on a free
port, its resident memory read from /proc, stopped as a terminal would (SIGTERM)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVING = re.compile(r"serving on (http://\S+) ")


class ServerProcess:
    """`with ServerProcess() as srv:` serves the default model (or `model`) until the block
    ends; srv.url answers once the block starts."""

    def __init__(self, model: str | None = None, kv_pool_tokens: int | None = None,
                 start_timeout_s: float = 600.0):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sgl-nb-serve-", suffix=".log",
                                               delete=False)
        # -P: the working directory off sys.path (Makefile, PYTHONSAFEPATH).
        cmd = [sys.executable, "-P", "-m", "sgl_nb.cli", "serve", "--port", "0", "--quiet"]
        if model:
            cmd += ["--model", model]
        if kv_pool_tokens:
            cmd += ["--kv-pool-tokens", str(kv_pool_tokens)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.url = self._wait_serving(start_timeout_s)

    def _wait_serving(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = SERVING.search(self.log_text())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"sgl-nb serve exited ({self.proc.returncode}):\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"sgl-nb serve did not start in {timeout_s:g} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def rss_mb(self) -> float | None:
        """Its resident memory now (Linux /proc), None where that cannot be read."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        return int(found.group(1)) / 1024 if found else None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (running requests get the server's grace period), then SIGKILL; the exit
        code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
