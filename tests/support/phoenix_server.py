"""Start and stop a local Arize Phoenix (`phoenix serve`) from its own venv: the real OTLP
receiver that the tracing tests and `make bench-tracing` (through with_server.py) export
to."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from support import REPO
from support.ports import free_port
from support.waits import WAIT, limit

DEFAULT_VENV = REPO / ".venv-phoenix"


_READ_SPANS = """
import json, sys, time
from phoenix.client import Client
url, project, expect, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
client, deadline, spans = Client(base_url=url), time.monotonic() + timeout, []
while True:
    try:
        spans = client.spans.get_spans(project_identifier=project, limit=max(1000, expect))
    except Exception:  # the project appears with its first ingested span
        spans = []
    if len(spans) >= expect or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps(spans, default=str))
"""


class PhoenixServer:
    """`with PhoenixServer() as px:` runs Phoenix on 127.0.0.1 (free ports, a working
    folder of its own) until the block ends; px.traces_url is its OTLP/HTTP endpoint."""

    def __init__(self, venv: str | os.PathLike = DEFAULT_VENV):
        self.venv = Path(venv)
        self.exe = self.venv / "bin" / "phoenix"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def available(self) -> bool:
        return self.exe.exists()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def traces_url(self) -> str:
        return f"{self.url}/v1/traces"

    def start(self, timeout: float | None = None) -> PhoenixServer:
        """Start it and wait until /healthz answers (`timeout`: default generous for a
        slow, busy machine)."""
        timeout = limit(300) if timeout is None else timeout
        if not self.available:
            raise FileNotFoundError(f"no Phoenix at {self.exe}: run `make phoenix`")
        self._dir = tempfile.TemporaryDirectory(prefix="sgl-nb-phoenix-")
        self.port = free_port()
        env = {**os.environ, "PHOENIX_WORKING_DIR": self._dir.name, "PHOENIX_HOST": "127.0.0.1",
               "PHOENIX_PORT": str(self.port), "PHOENIX_GRPC_PORT": str(free_port()),
               "PHOENIX_TELEMETRY_ENABLED": "false"}
        log = open(Path(self._dir.name) / "phoenix.log", "w")  # noqa: SIM115 - Popen keeps it
        self.proc = subprocess.Popen([str(self.exe), "serve"], env=env, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait(timeout)
        return self

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"phoenix serve exited ({self.proc.returncode}):\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"phoenix serve did not answer in {timeout:g} s")

    def log_tail(self, n: int = 30) -> str:
        if self._dir is None:
            return ""
        lines = (Path(self._dir.name) / "phoenix.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def spans(self, project: str, expect: int = 1, timeout: float = WAIT) -> list[dict]:
        """The spans Phoenix stored for `project`, read with the Phoenix client (it lives
        in Phoenix's venv, so it runs there), polling until `expect` of them are in
        (Phoenix ingests in the background) or `timeout` passes."""
        out = subprocess.run([str(self.venv / "bin" / "python"), "-c", _READ_SPANS, self.url,
                              project, str(expect), str(timeout)],
                             capture_output=True, text=True, timeout=timeout + 120)
        if out.returncode != 0:
            raise RuntimeError(f"phoenix client failed:\n{out.stderr[-2000:]}")
        return json.loads(out.stdout)

    def __enter__(self) -> PhoenixServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
