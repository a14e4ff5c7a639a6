"""The FastAPI app of `sgl-nb serve`: OpenAI's /v1 routes, vLLM's /tokenize and
/detokenize, SGLang's native ones, /health and Prometheus /metrics, over one Runtime.

Bodies are read on the event loop and parsed in worker threads (request_body.py), and a
route's own work (tokenizing, compiling a grammar, submitting) runs in one too: the loop
only moves bytes, so /health answers whatever the other requests carry."""

from __future__ import annotations

import anyio
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from sgl_nb.server import openai_routes, sglang_routes, tokenize_routes
from sgl_nb.server.auth import ApiKeyMiddleware
from sgl_nb.server.body_limit import BodyLimitMiddleware
from sgl_nb.server.errors import Json, error_response, install_error_handlers
from sgl_nb.server.metrics import exposition, metrics_registry
from sgl_nb.server.prompt_limits import PromptLimits
from sgl_nb.server.replies import Served, Stream
from sgl_nb.server.request_body import parsed_body
from sgl_nb.server.requests_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    tokenize_request_kind,
)
from sgl_nb.server.requests_sglang import (
    ConcateAndAppendRequest,
    FlushCacheRequest,
    GenerateRequest,
)
from sgl_nb.server.streaming import EventStream, answer, in_thread, submitted

MAX_BODY_BYTES = 32 * 2**20  # a context of token ids is well under 1 MiB
# Each request in flight holds a worker thread while it waits on the engine; anyio's
# default of 40 would queue requests the engine could already batch.
WORKER_THREADS = 256


def build_app(runtime, api_key: str | None = None, model_names: list[str] | None = None,
              clip_max_tokens: bool = False) -> FastAPI:
    """model_names: the names the OpenAI routes answer to, the first reported (default: the
    model folder's name). clip_max_tokens: a max_tokens past the context is lowered to fit
    (SGLang's --allow-auto-truncate for it) instead of a 400."""
    served = Served(runtime, model_names)
    limits = PromptLimits.of(runtime, clip_max_tokens)
    app = FastAPI(title="sgl-nb serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served  # the server's stop aborts its requests (runner.py)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BODY_BYTES)
    if api_key:  # added last, so checked first
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    limiter = anyio.CapacityLimiter(WORKER_THREADS)
    registry = metrics_registry(runtime, served.log)

    async def body_of(request: Request, model, optional: bool = False):
        return await parsed_body(request, model, limits, limiter, optional)

    async def reply(request: Request, route, model) -> Response:
        body = await body_of(request, model)
        out = await submitted(lambda: route(served, body, limits), limiter)
        if isinstance(out, Stream):
            return EventStream(out, limiter)
        return Json(await answer(request, out, limiter))

    @app.get("/health")
    async def health() -> Json:
        if not served.runtime.engine.alive():  # a load balancer must stop sending here
            return Json({"error": "the engine thread has stopped"}, status_code=503)
        return Json({})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Json:
        return Json(openai_routes.models(served))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await reply(request, openai_routes.completion, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await reply(request, openai_routes.chat_completion, ChatCompletionRequest)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Json:
        body = await body_of(request, tokenize_request_kind)
        return Json(await in_thread(tokenize_routes.tokenize, served, body, limits,
                                    limiter=limiter))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Json:
        body = await body_of(request, DetokenizeRequest)
        return Json(await in_thread(tokenize_routes.detokenize, served, body, limiter=limiter))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await reply(request, sglang_routes.generate, GenerateRequest)

    # SGLang 0.5.23 names these /model_info and /server_info, and keeps the /get_ names.
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Json:
        return Json(sglang_routes.model_info(served))

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Json:
        return Json(await in_thread(sglang_routes.server_info, served, limiter=limiter))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Json:
        await body_of(request, FlushCacheRequest, optional=True)  # no fields: only checked
        out = sglang_routes.flush_cache(served)
        return Json(await in_thread(out.build, limiter=limiter))

    @app.get("/health_generate")
    async def health_generate() -> Json:
        if await in_thread(sglang_routes.health_generate, served, limiter=limiter):
            return Json({})
        return error_response(503, "the engine did not generate a token")

    @app.post("/concate_and_append_request")
    async def concate_and_append(request: Request) -> Json:
        body = await body_of(request, ConcateAndAppendRequest)
        return Json(sglang_routes.concate_and_append(body))

    @app.api_route("/start_profile", methods=["GET", "POST"])
    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def profile() -> Json:
        raise sglang_routes.profiling_refused()

    @app.api_route("/encode", methods=["POST", "PUT"])
    async def encode() -> Json:
        raise sglang_routes.encode_refused(served)

    return app
