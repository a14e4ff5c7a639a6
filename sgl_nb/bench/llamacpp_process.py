"""The parent's side of llama.cpp's child process (sgl_nb/bench/peers_llamacpp.py, run by
the python of the venv that has llama-cpp-python: `make llamacpp`), for `sgl-nb bench peers`
and `sgl-nb bench engine`."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

CHILD = Path(__file__).with_name("peers_llamacpp.py")
REPLY_TIMEOUT_S = 1800.0  # one request's answer; only a hung child reaches it


def venv_python(venv: str | Path) -> Path:
    return Path(venv) / "bin" / "python"


class LlamaCpp:
    """The child process running llama.cpp: one JSON request a line, one answer a line."""

    def __init__(self, python: Path):
        """python: one that has llama-cpp-python (a venv's: venv_python)."""
        if not python.is_file():
            raise SystemExit(f"--llamacpp-venv: no {python}; `make llamacpp` builds "
                             "llama-cpp-python in .venv-llamacpp")
        self.log = tempfile.TemporaryFile(mode="w+")
        # -I: the script's folder is not put on sys.path (its copy.py would shadow the
        # standard library's copy module).
        self.proc = subprocess.Popen([str(python), "-I", str(CHILD)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.version = self.ask({"ping": True})["version"]

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = "\n".join(self.log.read().splitlines()[-20:])
            raise RuntimeError(f"llama.cpp child exited ({self.proc.wait()}):\n{tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp failed on {request.get('model')}: {reply['error']}")
        return reply

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=REPLY_TIMEOUT_S)
        self.log.close()
