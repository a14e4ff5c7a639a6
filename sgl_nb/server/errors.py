"""Errors in OpenAI's shape, `{"error": {"message", "type", "code"}}`, for everything the
server refuses: bad input is a 400 naming the field or the problem, never a 500; a model
this server does not serve is a 404 in vLLM's words."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from sgl_nb.server.refusals import ModelNotFound
from sgl_nb.server.requests_common import model_names

log = logging.getLogger("sgl_nb.serve")


class Json(Response):
    """JSON as the stdlib writes it: ASCII escapes (a lone surrogate cannot break the
    encoding) and -Infinity for a logprob of a token that cannot come."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return json.dumps(content).encode()


def error_response(status: int, message: str, headers: dict | None = None,
                   kind: str | None = None, param: str | None = None) -> Json:
    kind = kind or {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    error = {"message": message, "type": kind, "code": status}
    if param is not None:
        error["param"] = param
    return Json({"error": error}, status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(ValueError, _bad_value)  # BadRequest, and the engine's checks
    app.add_exception_handler(ModelNotFound, _no_such_model)
    # The engine failed (EngineError, shut down): a 500 that keeps the connection. A
    # handler for Exception itself sends its answer and then re-raises, and uvicorn
    # closes the connection under the client; it is left for what nothing else catches.
    app.add_exception_handler(RuntimeError, _failed)
    app.add_exception_handler(Exception, _failed)


async def _invalid(request: Request, exc: RequestValidationError) -> Json:
    return error_response(400, describe(exc.errors()))


async def _http(request: Request, exc: HTTPException) -> Json:
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    return error_response(exc.status_code, message, getattr(exc, "headers", None))


async def _bad_value(request: Request, exc: ValueError) -> Json:
    return error_response(400, str(exc) or type(exc).__name__)


async def _no_such_model(request: Request, exc: ModelNotFound) -> Json:
    # vLLM's shape: {"error": {"message", "type": "NotFoundError", "param": "model", "code"}}
    return error_response(404, str(exc), kind="NotFoundError", param="model")


async def _failed(request: Request, exc: Exception) -> Json:
    log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"{type(exc).__name__}: {exc}")


# ---- pydantic's errors as one sentence --------------------------------------------------

_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def describe(errors: list[dict]) -> str:
    """'temperature: Input should be greater than or equal to 0; unknown field "foo"'. The
    input itself is never echoed (it may not even be encodable). A union's alternatives on
    one field come out as one sentence: 'stop: Input should be a valid string or ...'."""
    by_path: dict[str, list[str]] = {}
    for err in errors:
        path, text = _one(err)
        if text not in by_path.setdefault(path, []):
            by_path[path].append(text)
    return "; ".join(_sentence(path, texts) for path, texts in by_path.items())


def _sentence(path: str, texts: list[str]) -> str:
    """Texts that name their own field stand alone; the others get `path: ` in front."""
    own = [t for t in texts if path == "body" or t.startswith("unknown field")]
    rest = [t for t in texts if t not in own]
    return "; ".join(own + ([f"{path}: {' or '.join(rest)}"] if rest else []))


def _one(err: dict) -> tuple[str, str]:
    loc = list(err.get("loc") or ())
    if loc and loc[0] == "body":
        loc = loc[1:]
    kind = err.get("type", "")
    if kind == "json_invalid":
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        detail = (err.get("ctx") or {}).get("error", "")
        return "body", f"the body is not valid JSON{where}" + (f" ({detail})" if detail else "")
    path = _path(loc)
    if not path:
        if kind in ("missing", "model_attributes_type", "dict_type", "model_type"):
            return "body", ("the request body must be a JSON object (sent with Content-Type: "
                            "application/json)")
        path = "body"
    if kind == "extra_forbidden":
        return path, f"unknown field {ascii(path)} (not part of this API; check its spelling)"
    if kind == "missing":
        return path, "required"
    msg = str(err.get("msg", "invalid")).replace(
        "a valid dictionary or object to extract fields from", "a JSON object")
    return path, msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _path(loc: list) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(part):
            out += ("." if out else "") + ascii(part)[1:-1]
    return out


def _is_tag(part: str) -> bool:
    """Which member of a union pydantic tried: a type, not a field of the request."""
    return (part in _TAGS or "[" in part or part.startswith(("constrained-", "function-"))
            or part in model_names())
