"""HTTP errors of the server: every failure reaches the client as an OpenAI error object
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.

Statuses: 400 malformed JSON, invalid Unicode, an unsupported parameter or a request the
model cannot serve, 401 missing or unknown API key, 404 unknown model or route, 405 wrong
method, 408 a client too slow to send its request (:mod:`pagedkv.serving.http_protocol`), 413 body
over the limit, 422 a field of the wrong type or out of range, 503 shutting down. A 500 is
a bug in the server: it is logged with a request id, which the response carries in its
message and in ``X-Request-Id``.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.serving.engine_loop import EngineStepError, EngineStoppedError
from pagedkv.serving.metrics import ServerMetrics

logger = logging.getLogger("pagedkv.serving")


class APIError(Exception):
    """An error returned to the client as an OpenAI error object with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[Union[str, int]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI error object (also sent as the last SSE event of a failed stream)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool"}  # pydantic's names of a union's members


def _field_path(loc: Any) -> str:
    """``messages.0.content`` from a pydantic error location, without the union-member tags
    (``str``, ``list[int]``, ``function-after[...]``) pydantic adds."""
    return ".".join(str(p) for p in loc
                    if isinstance(p, int) or (_FIELD.match(str(p)) and p not in _TYPE_TAGS))


def validation_error(exc: ValidationError) -> APIError:
    """422 naming the first bad field (``param``) and up to five problems (``message``)."""
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = _field_path(first.get("loc", ()))
    msg = "; ".join(f"{_field_path(e.get('loc', ()))}: {e.get('msg')}" for e in errs[:5])
    return APIError(422, msg or "invalid request", param=loc or None, code="invalid_value")


def engine_error(exc: Union[EngineStepError, EngineStoppedError], request_id: str = "") -> APIError:
    """A failed engine step (500 ``engine_error`` / ``sampling_error``, logged with
    ``request_id``) or a stopped loop (503 ``shutting_down``)."""
    if isinstance(exc, EngineStepError):
        logger.error("request %s failed: %s", request_id, exc)
        return APIError(500, f"{exc} (request id {request_id})", "server_error", code=exc.code)
    return APIError(503, str(exc), "server_error", code="shutting_down")


def aborted_error() -> APIError:
    """503 for a request the engine aborted while the server shuts down."""
    return APIError(503, "the request was aborted (server shutting down)", "server_error", code="aborted")


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Turn ``APIError``, unhandled exceptions, 404 and 405 into OpenAI error objects.
    ``APIError`` and internal errors count in ``pagedkv_http_errors``."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.http_errors.labels(metrics.model_name, str(exc.status)).inc()
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        rid = f"req-{uuid.uuid4().hex}"
        logger.error("internal error, request id %s, %s %s", rid, request.method, request.url.path,
                     exc_info=exc)
        metrics.http_errors.labels(metrics.model_name, "500").inc()
        resp = error_response(APIError(500, f"internal error: {type(exc).__name__} (request id {rid})",
                                       "server_error", code="internal_error"))
        resp.headers["X-Request-Id"] = rid
        return resp

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(APIError(404, f"no route {request.url.path}", "not_found_error"))
        if exc.status_code == 405:
            return error_response(APIError(405, f"method {request.method} not allowed on {request.url.path}"))
        return error_response(APIError(exc.status_code, str(exc.detail), code=None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        loc = ".".join(str(p) for p in errs[0].get("loc", ())[1:]) if errs else ""
        return error_response(APIError(422, "; ".join(str(e.get("msg")) for e in errs[:5]) or "invalid request",
                                       param=loc or None, code="invalid_value"))
