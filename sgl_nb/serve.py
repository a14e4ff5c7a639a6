"""`sgl-nb serve`: the in-kernel engine behind HTTP, so other tools can use it: the
OpenAI-compatible /v1/completions and /v1/chat/completions (with streaming), SGLang's
native /generate, /get_model_info, /get_server_info and /flush_cache. Loopback by
default: there is no authentication.

Standard library only (ThreadingHTTPServer, one thread per connection): the engine is
thread-safe and does the batching, so the HTTP layer needs nothing faster."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sgl_nb.serve_openai import BadRequest, chat_completion, completion, models
from sgl_nb.serve_sglang import generate, model_info


class EngineServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never keeps the process alive

    def __init__(self, runtime, host: str = "127.0.0.1", port: int = 30000,
                 quiet: bool = False):
        self.runtime, self.quiet = runtime, quiet
        self.model_name = str(runtime.model_path)
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


GET_ROUTES = {"/v1/models": models, "/get_model_info": model_info,
              "/get_server_info": lambda server: server.runtime.get_server_info(),
              "/health": lambda server: {}}
POST_ROUTES = {"/v1/completions": completion, "/v1/chat/completions": chat_completion,
               "/generate": generate,
               "/flush_cache": lambda server, body: {
                   "flushed_tokens": server.runtime.flush_cache()}}


class _Handler(BaseHTTPRequestHandler):
    server: EngineServer
    protocol_version = "HTTP/1.0"  # one request per connection: a stream ends at close

    def do_GET(self) -> None:
        route = GET_ROUTES.get(self.path.split("?")[0])
        if route is None:
            return self._error(404, f"no route GET {self.path}")
        self._json(200, route(self.server))

    def do_POST(self) -> None:
        route = POST_ROUTES.get(self.path.split("?")[0])
        if route is None:
            return self._error(404, f"no route POST {self.path}")
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            answer = route(self.server, body)
        except (BadRequest, ValueError, TypeError) as e:
            return self._error(400, str(e) or type(e).__name__)
        except Exception as e:  # noqa: BLE001 - the engine failed: tell the client
            return self._error(500, f"{type(e).__name__}: {e}")
        if isinstance(answer, dict | list):
            return self._json(200, answer)
        self._stream(answer)

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._json(status, {"error": {"message": message, "type": kind, "code": status}})

    def _stream(self, events) -> None:
        """Server-sent events: one `data: {json}` per event, then `data: [DONE]`."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            for event in events:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return  # the client left; the engine finishes the request on its own
        except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
            self.wfile.write(f"data: {json.dumps({'error': {'message': str(e)}})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base's name
        if not self.server.quiet:
            sys.stderr.write(f"{time.strftime('%H:%M:%S')} {self.address_string()} "
                             f"{format % args}\n")


def start_in_thread(runtime, host: str = "127.0.0.1", port: int = 0,
                    quiet: bool = True) -> EngineServer:
    """Serve `runtime` from a background thread (port 0: a free one); .shutdown() stops."""
    server = EngineServer(runtime, host, port, quiet)
    threading.Thread(target=server.serve_forever, name="sgl-serve", daemon=True).start()
    return server


def cmd_serve(args: argparse.Namespace) -> int:
    from sgl_nb import Runtime

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host}: anyone who can reach it may use the model "
              "(there is no authentication)", file=sys.stderr)
    t0 = time.monotonic()
    rt = Runtime(args.model, kv_pool_tokens=args.kv_pool_tokens)
    server = EngineServer(rt, args.host, args.port, args.quiet)
    print(f"loaded {rt.model_path} in {time.monotonic() - t0:.1f} s", flush=True)
    print(f"serving on {server.url} (OpenAI: {server.url}/v1, SGLang: {server.url}/generate)",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        rt.shutdown()
    return 0
