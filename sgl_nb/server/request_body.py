"""A request body read on the event loop and parsed in a worker thread: decoding megabytes
of JSON and validating them takes long enough to stall every other request (/health
included) if done on the loop. The request models get the prompt limits as validation
context, so a list of token ids longer than the context is refused by its length before
anything reads its items (requests_common.TopLevel).

What a body may be follows FastAPI's own reading (JSON when the Content-Type says JSON or
nothing), and its errors come out as FastAPI's do, through the same 400 handler."""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request

from sgl_nb.server.prompt_limits import PromptLimits
from sgl_nb.server.requests_common import LIMITS_CONTEXT
from sgl_nb.server.streaming import in_thread

M = TypeVar("M", bound=BaseModel)
# The model for a body that may be one of several (vLLM's /tokenize: text or chat).
Chooser = Callable[[Any], type[BaseModel]]


async def parsed_body(request: Request, model: type[M] | Chooser, limits: PromptLimits,
                      limiter: anyio.CapacityLimiter, optional: bool = False) -> M | None:
    """The body as `model` (or the model `model(raw)` picks). optional: no body is None."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # nobody reads the answer: a 400, not a logged failure
        raise HTTPException(400, "the client went away before its body was complete") from None
    content_type = request.headers.get("content-type")
    return await in_thread(parse, raw, content_type, model, limits, optional,
                           limiter=limiter)


def parse(raw: bytes, content_type: str | None, model: type[M] | Chooser,
          limits: PromptLimits, optional: bool = False) -> M | None:
    if not raw:
        if optional:
            return None
        data: Any = None
    elif _is_json(content_type):
        data = _decoded(raw)
    else:
        data = raw  # not JSON: the model refuses it as "must be a JSON object"
    cls = model if isinstance(model, type) else model(data)
    try:
        return cls.model_validate(data, context={LIMITS_CONTEXT: limits})
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json"))


def _decoded(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{
            "type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
            "input": {}, "ctx": {"error": e.msg}}]) from None
    except UnicodeDecodeError as e:
        raise RequestValidationError([{
            "type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
            "input": {}, "ctx": {"error": f"not UTF-8 text: {e.reason}"}}]) from None
