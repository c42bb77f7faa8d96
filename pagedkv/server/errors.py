"""HTTP errors of the server: every failure reaches the client as an OpenAI error object
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.

Statuses: 400 malformed JSON or a request the model cannot serve, 401 missing or unknown
API key, 404 unknown model or route, 405 wrong method, 413 body over the limit, 422 a
field of the wrong type or out of range, 500 engine or internal error, 503 shutting down.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pagedkv.server.engine_loop import EngineStepError, EngineStoppedError
from pagedkv.server.metrics import ServerMetrics

logger = logging.getLogger("pagedkv.server")


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


def validation_error(exc: ValidationError) -> APIError:
    """422 naming the first bad field (``param``) and up to five problems (``message``)."""
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(p) for p in first.get("loc", ()))
    msg = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errs[:5]
    )
    return APIError(422, msg or "invalid request", param=loc or None, code="invalid_value")


def engine_error(exc: Union[EngineStepError, EngineStoppedError]) -> APIError:
    """A failed engine step (500 ``engine_error``) or a stopped loop (503 ``shutting_down``)."""
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), "server_error", code="engine_error")
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
        logger.exception("unhandled error on %s", request.url.path)
        metrics.http_errors.labels(metrics.model_name, "500").inc()
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(404, f"no route {request.url.path}", "not_found_error"))

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(405, f"method {request.method} not allowed on {request.url.path}"))
