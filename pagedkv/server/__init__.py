"""The OpenAI-compatible HTTP server (``pagedkv serve``): the FastAPI app (``app``), its
routes, OpenAI mapping (``protocol``), streaming, auth and body limits as dependencies,
metrics, the engine loop and the live ``/ui`` page of the KV cache."""

from pagedkv.server.api_keys import load_api_keys
from pagedkv.server.app import build_app
from pagedkv.server.engine_loop import EngineLoop, PromptSpec
from pagedkv.server.errors import APIError

__all__ = ["APIError", "EngineLoop", "PromptSpec", "build_app", "load_api_keys"]
