"""FastAPI dependencies (``Depends``) of the routes: the server state, the caller's tenant
from its API key, and the request body under the size limit.

A route lists them in this order, and FastAPI resolves them in that order before the
handler runs, so a call fails on its key (401) before its body is read, and on the body's
size (413), JSON (400) or schema (422) before the handler sees it::

    async def completions(request: Request, st: State, tenant: Tenant,
                          body: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]):
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Optional

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from pagedkv.server.api_keys import ApiKeys
from pagedkv.server.engine_loop import EngineLoop
from pagedkv.server.errors import APIError, validation_error
from pagedkv.server.metrics import ServerMetrics


@dataclass
class ServerState:
    """What every route reads (``app.state.pagedkv``). ``model_names``: names clients may
    pass as ``model`` (the first is reported). ``api_keys``: None = no auth, no tenants.
    ``max_body_bytes``: request body limit (bytes). ``max_n``: largest ``n``.
    ``shutdown_timeout_s``: how long shutdown lets in-flight requests finish (seconds)."""

    engine: Any
    loop: EngineLoop
    metrics: ServerMetrics
    model_names: list[str]
    api_keys: Optional[ApiKeys]
    max_body_bytes: int
    max_n: int
    shutdown_timeout_s: float
    created: int = field(default_factory=lambda: int(time.time()))  # epoch seconds


async def get_state(request: Request) -> ServerState:
    return request.app.state.pagedkv


State = Annotated[ServerState, Depends(get_state)]


async def get_tenant(request: Request, st: State) -> Optional[str]:
    """The caller's tenant, from ``Authorization: Bearer <key>`` or ``X-API-Key`` (None
    when the server has no API keys). Raises 401 on a missing or unknown key."""
    if st.api_keys is None:
        return None
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not key:
        key = request.headers.get("x-api-key", "")
    if not key:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                       "authentication_error", code="invalid_api_key")
    tenant = st.api_keys.tenant(key)
    if tenant is None:
        raise APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")
    return tenant


Tenant = Annotated[Optional[str], Depends(get_tenant)]


async def read_body(request: Request, st: State) -> bytes:
    """The raw body, at most ``max_body_bytes``. Raises 413 on a larger ``Content-Length``
    or, without one, as soon as the bytes read pass the limit."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > st.max_body_bytes:
        raise APIError(413, f"request body is {cl} bytes; the limit is {st.max_body_bytes}",
                       "invalid_request_error", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > st.max_body_bytes:
            raise APIError(413, f"request body exceeds the limit of {st.max_body_bytes} bytes",
                           "invalid_request_error", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def json_body(schema: type[BaseModel]) -> Callable[..., Any]:
    """A dependency that parses the (size-limited) body as a JSON object of ``schema``.
    Raises 400 on malformed JSON or a non-object, 422 on a field the schema rejects."""

    async def parse(raw: Annotated[bytes, Depends(read_body)]) -> Any:
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the JSON body must be an object", code="invalid_json")
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None

    return parse
