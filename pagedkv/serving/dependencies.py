"""FastAPI dependencies (``Depends``) of the routes: the server state, the caller's tenant
from its API key, and the request body under the size limit.

A route lists them in this order, and FastAPI resolves them in that order before the
handler runs, so a call fails on its key (401) before its body is read, and on the body's
size (413), JSON, nesting, Unicode or an unsupported parameter (400, see
:mod:`pagedkv.serving.validation`) or schema (422) before the handler sees it::

    async def completions(request: Request, st: State, tenant: Tenant,
                          body: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]):
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Optional

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pagedkv.serving.api_keys import ApiKeys
from pagedkv.serving.engine_loop import EngineLoop
from pagedkv.serving.errors import APIError, validation_error
from pagedkv.serving.metrics import ServerMetrics
from pagedkv.serving.validation import check_unsupported, parse_json_body


INLINE_PARSE_BYTES = 64 * 1024  # bodies up to this size are parsed on the event loop


@dataclass
class ServerState:
    """What every route reads (``app.state.pagedkv``). ``model_names``: names clients may
    pass as ``model`` (the first is reported). ``api_keys``: None = no auth, no tenants.
    ``max_body_bytes``: request body limit (bytes). ``max_n``: largest ``n``.
    ``shutdown_timeout_s``: how long shutdown lets in-flight requests finish (seconds).
    ``open_routes``: with API keys, the routes that still answer without one."""

    engine: Any
    loop: EngineLoop
    metrics: ServerMetrics
    model_names: list[str]
    api_keys: Optional[ApiKeys]
    max_body_bytes: int
    max_n: int
    shutdown_timeout_s: float
    open_routes: frozenset[str] = frozenset()  # paths served without a key (``--open-route``)
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


async def require_key(request: Request, st: State) -> None:
    """With API keys, a valid key (401 otherwise) unless the route was opened
    (``ServerState.open_routes``). For browsers, ``GET /ui`` also takes ``?key=``."""
    if st.api_keys is None or request.url.path in st.open_routes:
        return
    key = request.query_params.get("key") if request.url.path == "/ui" else None
    if key and st.api_keys.tenant(key) is not None:
        return
    await get_tenant(request, st)


KeyRequired = Depends(require_key)


async def read_body(request: Request, st: State) -> bytes:
    """The raw body, at most ``max_body_bytes``. Raises 413 on a larger ``Content-Length``
    or, without one, as soon as the bytes read pass the limit."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > st.max_body_bytes:
        raise APIError(413, f"request body is {cl} bytes; the limit is {st.max_body_bytes}",
                       "invalid_request_error", code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > st.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {st.max_body_bytes} bytes",
                               "invalid_request_error", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone (or cut as too slow) before its body was read
        raise APIError(499, "the client closed the connection before its body was read",
                       code="client_closed") from None
    return b"".join(chunks)


def json_body(schema: type[BaseModel]) -> Callable[..., Any]:
    """A dependency that parses the (size-limited) body as a JSON object of ``schema``.
    Raises 400 on malformed JSON, a non-object, a body past the parser's limits or an
    OpenAI parameter in ``schema.UNSUPPORTED`` that is set; 422 on a field the schema
    rejects or a number out of range."""

    async def parse(raw: Annotated[bytes, Depends(read_body)]) -> Any:
        # a large body is parsed off the event loop (up to ~0.2 s for 1 MiB of small items)
        data = parse_json_body(raw) if len(raw) <= INLINE_PARSE_BYTES else await asyncio.to_thread(parse_json_body, raw)
        check_unsupported(data, getattr(schema, "UNSUPPORTED", {}))
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None

    return parse
