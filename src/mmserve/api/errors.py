"""Every failure the server answers with, as OpenAI-style error JSON and the right status code."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from mmserve.errors import (
    EngineDeadError,
    InternalRequestError,
    InvalidRequestError,
    RequestFailedError,
    ServerShuttingDownError,
)

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


_MAX_PATH_PART_CHARS = 64
# Labels pydantic puts in an error's location for the branch of a union that failed.
_UNION_BRANCH_LABELS = frozenset(
    {"str", "int", "bool", "float", "list", "dict", "constrained-int", "constrained-float"}
)


class APIError(Exception):
    """An HTTP-level refusal that is not one of the engine's typed errors (auth, size, model)."""

    def __init__(
        self, status_code: int, message: str, *, code: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param


def error_body(
    message: str, *, status_code: int, code: str | None, param: str | None = None
) -> dict[str, Any]:
    error_type = _TYPE_BY_STATUS.get(status_code, "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    message: str, *, status_code: int, code: str | None, param: str | None = None
) -> JSONResponse:
    body = error_body(message, status_code=status_code, code=code, param=param)
    return JSONResponse(body, status_code=status_code)


async def send_error(
    send: Send,
    message: str,
    *,
    status_code: int,
    code: str,
    param: str | None = None,
    close: bool = True,
) -> None:
    """An OpenAI-style error straight onto the ASGI channel (for middleware, before any route).

    `close` ends the connection after the answer: a refused request may still have body bytes
    on the wire that the server does not want to read.
    """
    body = error_body(message, status_code=status_code, code=code, param=param)
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status_code, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def as_api_error(exc: Exception) -> APIError:
    """Map any exception from request handling to what the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(exc.status_code, exc.message, code=exc.code, param=exc.param)
    if isinstance(exc, RequestFailedError):
        # The engine failed this one request (e.g. its content broke the placeholder contract);
        # the server is fine, so this is not a 5xx.
        return APIError(400, str(exc), code="request_failed")
    if isinstance(exc, InternalRequestError):
        # The engine logged this failure with the request id and its traceback already.
        return APIError(500, str(exc), code="internal_error")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, ServerShuttingDownError):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors())
    logger.error("unexpected error while handling a request", exc_info=exc)
    return APIError(500, "internal server error; the server log has the details", code=None)


def validation_error(errors: Any) -> APIError:
    """Turn pydantic's error list into one message that names the offending field."""
    errors = list(errors)
    # A union field (content: str | list[part]) fails once per branch; when a deeper error
    # exists, the "not a string" branch error only adds noise.
    deep = [e for e in errors if e.get("type") not in ("string_type", "list_type")]
    parts = []
    first_param = None
    for err in (deep or errors)[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        # Drop pydantic's union-branch labels (`str`, `list[...]`, `function-after[...]`).
        loc = [p for p in loc if "[" not in p and p not in _UNION_BRANCH_LABELS]
        param = dotted_path(loc) or None
        first_param = first_param or param
        msg = str(err.get("msg", "invalid value"))
        # Some of pydantic's messages quote the input (a union tag, say), which may be huge.
        msg = msg if len(msg) <= 300 else msg[:297] + "..."
        parts.append(f"{param or 'body'}: {msg}")
    message = "invalid request body: " + "; ".join(parts)
    return APIError(400, message, code="invalid_request_body", param=first_param)


def dotted_path(parts: Any) -> str:
    """`messages.0.content` for an error's param, each part cut short (keys come from clients)."""
    out = []
    for part in parts:
        text = str(part).encode("utf-8", "backslashreplace").decode("utf-8")
        out.append(text if len(text) <= _MAX_PATH_PART_CHARS else text[:61] + "...")
    return ".".join(out)


def install_error_handlers(app: FastAPI) -> None:
    """Route FastAPI/Starlette's own errors (404, 405, 422) through the OpenAI error shape."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        err = as_api_error(exc)
        return error_response(
            err.message, status_code=err.status_code, code=err.code, param=err.param
        )

    async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(str(exc.detail), status_code=exc.status_code, code=None)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        err = validation_error(exc.errors())
        return error_response(err.message, status_code=400, code=err.code, param=err.param)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(InvalidRequestError, on_api_error)
    app.add_exception_handler(RequestFailedError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(Exception, on_api_error)
