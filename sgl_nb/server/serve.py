"""`sgl-nb serve`: the in-kernel engine behind HTTP, so other tools can use it: the
OpenAI-compatible /v1/completions and /v1/chat/completions (with streaming), SGLang's
native /generate, /get_model_info, /get_server_info and /flush_cache, /health and
Prometheus /metrics. FastAPI on uvicorn (sgl_nb/server/); the engine does the batching.

Loopback by default. With an API key (`--api-key` or SGL_NB_API_KEY) every route but
/health wants `Authorization: Bearer <key>`; a non-loopback host without one is refused
unless `--allow-unauthenticated` says so. That refusal comes before anything heavy is
imported (this module imports only the standard library at the top).

Ctrl-C or SIGTERM stops it in order (shutdown.py): new requests 503, the grace period for
those in flight, then the engine aborts the rest, each answered with its text so far."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import time

API_KEY_ENV = "SGL_NB_API_KEY"
EXIT_USAGE = 2  # argparse's code for a command line that cannot run
EXIT_FORCED = 130  # stopped by a second Ctrl-C without waiting (a shell's 128 + SIGINT)
# On a stop, requests in flight get this long before the engine aborts them: stopping
# never waits for a long generation.
GRACE_SECONDS = 2.0


def start_in_thread(runtime, host: str = "127.0.0.1", port: int = 0, quiet: bool = True,
                    api_key: str | None = None, served_model_names: list[str] | None = None,
                    shutdown_grace: float = GRACE_SECONDS, clip_max_tokens: bool = False):
    """Serve `runtime` from a background thread (port 0: a free one). The result has
    `.url` and `.shutdown()` (which stops as SIGTERM stops `sgl-nb serve`, and returns
    what it did). served_model_names: the names the OpenAI routes accept, the first
    reported (default: the model folder's name). clip_max_tokens: a max_tokens past the
    context is lowered to fit instead of a 400."""
    from sgl_nb.server.runner import ServerThread

    return ServerThread(runtime, host, port, quiet, api_key, served_model_names,
                        shutdown_grace, clip_max_tokens=clip_max_tokens)


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
    if problem:  # before the model loads, and before torch is imported: a refusal is quick
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    if args.shutdown_grace < 0:
        print(f"error: --shutdown-grace {args.shutdown_grace:g}: seconds, 0 or more",
              file=sys.stderr)
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

    def ready() -> None:  # called once the socket accepts: a client may start on this line
        print(f"serving on {url} (OpenAI: {url}/v1, SGLang: {url}/generate, metrics: "
              f"{url}/metrics{', API key required' if api_key else ''})", flush=True)

    try:
        stopped = serve_forever(rt, sock, args.quiet, api_key, names, args.shutdown_grace,
                                on_ready=ready, say=_say,
                                clip_max_tokens=args.clip_max_tokens)
    except KeyboardInterrupt:  # before uvicorn took over the signals
        return EXIT_FORCED
    finally:
        sock.close()
        rt.shutdown()
    print(stopped.summary(), flush=True)
    return EXIT_FORCED if stopped.forced else 0


def _say(line: str) -> None:
    print(line, flush=True)
