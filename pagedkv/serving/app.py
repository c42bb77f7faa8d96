"""The OpenAI-compatible HTTP server: ``build_app(engine, ...)`` returns a FastAPI app.

Endpoints (:mod:`pagedkv.serving.routes`)
    GET  /v1/models               the served model
    POST /v1/completions          text completion (``stream``, ``n``, ``logprobs``, ...)
    POST /v1/chat/completions     chat completion over the model's chat template
    POST /tokenize                token ids of a prompt or a conversation (vLLM's shape)
    POST /detokenize              the text of token ids (vLLM's shape)
    GET  /version                 ``{"version": pagedkv.__version__}``
    GET  /health                  200 while the engine loop runs, else 503
    GET  /metrics                 Prometheus exposition (see ``pagedkv.serving.metrics``)
    GET  /ui                      live page of the KV cache (+ the seed §03 calculator)
    GET  /ui/state                JSON snapshot the page polls (blocks, tables, stats; with
                                  tenants, other tenants' requests are shown as "other")
    GET  /openapi.json            the OpenAPI document of the requests (``pagedkv.serving.openapi``)

One :class:`pagedkv.serving.engine_loop.EngineLoop` runs the engine for every request.
Streaming responses are Server-Sent Events (:mod:`pagedkv.serving.streaming`); a client
that disconnects has its requests aborted (blocks are freed at the next step fence).
Requests map to engine requests and outputs to OpenAI objects in
:mod:`pagedkv.serving.protocol`; errors are OpenAI error objects
(:mod:`pagedkv.serving.errors`).

Tenants: with ``api_keys`` (key -> tenant) every route but ``/health`` needs
``Authorization: Bearer <key>`` (or ``X-API-Key``; the ``/ui`` page also takes ``?key=``),
unless ``open_routes`` names it (``/metrics``, ``/ui``, ``/openapi.json`` may be opened;
``/v1/*`` and ``/ui/state`` never are). The tenant is a typed key of the prefix-cache
identity so two tenants never share a cached block (a request's ``cache_salt`` adds to it).
The key check, the body-size limit and the JSON boundary (depth, integer size, Unicode:
:mod:`pagedkv.serving.validation`) are FastAPI dependencies
(:mod:`pagedkv.serving.dependencies`). Slow clients are cut by the HTTP protocol's header
and body timeouts (:mod:`pagedkv.serving.http_protocol`).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI

from pagedkv.serving.api_keys import ApiKeys
from pagedkv.serving.dependencies import ServerState
from pagedkv.serving.engine_loop import EngineLoop
from pagedkv.serving.errors import install_error_handlers
from pagedkv.serving.metrics import ServerMetrics
from pagedkv.serving.openapi import build_openapi
from pagedkv.serving.routes import router

logger = logging.getLogger("pagedkv.serving")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
DEFAULT_MAX_N = 16
OPENABLE_ROUTES = ("/metrics", "/ui", "/openapi.json")  # routes --open-route may serve without a key


def build_app(
    engine: Any,
    *,
    served_model_name: Optional[Union[str, list[str]]] = None,
    api_keys: Optional[dict[str, str]] = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_n: int = DEFAULT_MAX_N,
    shutdown_timeout_s: float = 10.0,
    open_routes: tuple[str, ...] = (),
) -> FastAPI:
    """The server app over an ``LLMEngine``. ``served_model_name``: the name(s) clients
    pass as ``model`` (default: the engine's ``model_id``; the first is reported).
    ``api_keys``: key -> tenant (``None``: no auth, no tenants). ``max_body_bytes``: request
    body limit (bytes). ``max_n``: largest ``n`` (capped by the engine's own limit).
    ``shutdown_timeout_s``: how long shutdown lets in-flight requests finish (seconds).
    ``open_routes``: with ``api_keys``, routes of ``OPENABLE_ROUTES`` served without a key
    (``ValueError`` for any other). The engine loop starts with the app (lifespan) and is
    reachable as ``app.state.pagedkv.loop``."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if not names:
        names = [engine.model_id]
    metrics = ServerMetrics(engine, names[0])
    loop = EngineLoop(engine, on_output=metrics.observe_output)
    max_n = min(max_n, getattr(getattr(engine, "config", None), "max_n", max_n))
    keys = ApiKeys(api_keys) if api_keys is not None else None
    bad = [r for r in open_routes if r not in OPENABLE_ROUTES]
    if bad:
        raise ValueError(f"open_routes: {bad} cannot be opened; choose from {list(OPENABLE_ROUTES)}")
    st = ServerState(engine, loop, metrics, names, keys, max_body_bytes, max_n, shutdown_timeout_s,
                     open_routes=frozenset(open_routes))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # chat templates render through transformers' tokenizer, which a warm start's fast
        # tokenizer builds on first use (~1 s): built here, not in the first request
        await asyncio.to_thread(getattr, getattr(engine, "tokenizer", None), "hf", None)
        loop.start()
        try:
            yield
        finally:
            res = await asyncio.to_thread(loop.shutdown, st.shutdown_timeout_s)
            logger.info("engine loop stopped: %s", res)

    app = FastAPI(title="pagedkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pagedkv = st
    install_error_handlers(app, metrics)
    app.include_router(router)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app.routes, model_names=names,
                                               vocab_size=engine.model_config.vocab_size,
                                               secured=keys is not None, open_paths=open_routes)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
