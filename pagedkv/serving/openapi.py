"""The OpenAPI document of the server (``GET /openapi.json``), describing the real requests.

The routes read their JSON bodies through a dependency (:func:`pagedkv.serving.dependencies.
json_body`), so FastAPI alone would publish no request body at all. :func:`request_body` is
the ``openapi_extra`` of such a route (a ``$ref`` to its pydantic model) and
:func:`build_openapi` adds the models to ``components.schemas``, narrows what only this
server knows (the served model names, the token-id range of the vocabulary), documents every
4xx/5xx as the OpenAI error object, and, with API keys, the bearer scheme on every route
that needs one. Schema-driven fuzzing (``tests/test_server_fuzz.py``) generates requests
from this document.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagedkv.serving.schemas import ChatCompletionRequest, CompletionRequest, ErrorResponse

REF = "#/components/schemas/{model}"
BODY_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose body ``model`` is parsed by a dependency."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def _error_response(what: str) -> dict[str, Any]:
    return {"description": what, "content": {
        "application/json": {"schema": {"$ref": REF.format(model=ErrorResponse.__name__)}}}}


def _walk_schemas(node: Any) -> Iterable[dict[str, Any]]:
    """Every JSON-schema object below ``node`` (iterative; the document is small)."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            yield cur
            stack.extend(cur.values())
        elif isinstance(cur, list):
            stack.extend(cur)


def build_openapi(routes: Any, *, model_names: list[str], vocab_size: int, secured: bool,
                  open_paths: Iterable[str] = ()) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes``. ``model_names``: the names a body's ``model``
    may take; ``vocab_size``: token ids in prompts are in ``[0, vocab_size)``; ``secured``:
    API keys are on (every path but ``/health`` and ``open_paths`` declares the bearer
    scheme)."""
    doc = get_openapi(title="pagedkv", version="0.1.0", routes=routes,
                      description="OpenAI-compatible server over a paged KV cache.")
    _, defs = models_json_schema([(m, "validation") for m in (*BODY_MODELS, ErrorResponse)],
                                 ref_template=REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(copy.deepcopy(defs["$defs"]))
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    for m in BODY_MODELS:
        props = schemas[m.__name__]["properties"]
        props["model"] = {"type": "string", "enum": list(model_names), "title": "Model"}
    for node in _walk_schemas(schemas):
        if node.get("title") == "TokenId" or node.get("x-token-id"):
            node["maximum"] = vocab_size - 1
    if secured:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    for path, ops in doc["paths"].items():
        for op in ops.values():
            responses = op["responses"]
            responses.pop("422", None)
            if "requestBody" in op:  # ``"stream": true`` answers with Server-Sent Events
                responses["200"]["content"]["text/event-stream"] = {}
            responses["4XX"] = _error_response("invalid request (OpenAI error object)")
            responses["5XX"] = _error_response("server error or shutting down (OpenAI error object)")
            if secured and path != "/health" and path not in open_paths:
                op["security"] = [{"apiKey": []}]
    return doc
