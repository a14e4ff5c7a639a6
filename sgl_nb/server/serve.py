"""`sgl-nb serve`: the in-kernel engine behind HTTP, so other tools can use it: the
OpenAI-compatible /v1/completions and /v1/chat/completions (with streaming), SGLang's
native /generate, /get_model_info, /get_server_info and /flush_cache, /health and
Prometheus /metrics. FastAPI on uvicorn (sgl_nb/server/); the engine does the batching.

Loopback by default. With an API key (`--api-key` or SGL_NB_API_KEY) every route but
/health wants `Authorization: Bearer <key>`; a non-loopback host without one is refused
unless `--allow-unauthenticated` says so."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import time

API_KEY_ENV = "SGL_NB_API_KEY"
EXIT_USAGE = 2  # argparse's code for a command line that cannot run


def start_in_thread(runtime, host: str = "127.0.0.1", port: int = 0, quiet: bool = True,
                    api_key: str | None = None, served_model_names: list[str] | None = None):
    """Serve `runtime` from a background thread (port 0: a free one). The result has
    `.url` and `.shutdown()`. served_model_names: the names the OpenAI routes accept, the
    first reported (default: the model folder's path and its base name)."""
    from sgl_nb.server.runner import ServerThread

    return ServerThread(runtime, host, port, quiet, api_key, served_model_names)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def refusal(host: str, api_key: str | None, allow_unauthenticated: bool) -> str | None:
    """Why serving on `host` is refused, or None."""
    if api_key or allow_unauthenticated or is_loopback(host):
        return None
    return (f"error: refusing to serve on {host} without an API key: anyone who can reach "
            f"it could use the model. Give --api-key KEY (or set {API_KEY_ENV}), or pass "
            "--allow-unauthenticated to serve without one.")


def cmd_serve(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    problem = refusal(args.host, api_key, args.allow_unauthenticated)
    if problem:  # before the model loads: a refused start costs nothing
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    if not api_key and not is_loopback(args.host):
        print(f"warning: serving on {args.host} without an API key (--allow-unauthenticated)",
              file=sys.stderr)
    from sgl_nb import Runtime
    from sgl_nb.server.replies import default_model_names
    from sgl_nb.server.runner import bind, serve_forever, url_of

    sock = bind(args.host, args.port)  # a busy port fails before the model loads
    t0 = time.monotonic()
    rt = Runtime(args.model, kv_pool_tokens=args.kv_pool_tokens)
    url = url_of(sock)
    print(f"loaded {rt.model_path} in {time.monotonic() - t0:.1f} s", flush=True)
    names = args.served_model_name or default_model_names(rt)
    print(f"model names: {', '.join(names)}", flush=True)
    print(f"serving on {url} (OpenAI: {url}/v1, SGLang: {url}/generate, metrics: "
          f"{url}/metrics{', API key required' if api_key else ''})", flush=True)
    # uvicorn re-raises SIGTERM after its own shutdown: make it an exit that still runs
    # the finally below (the engine thread stopped and joined).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve_forever(rt, sock, args.quiet, api_key, names)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        rt.shutdown()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
