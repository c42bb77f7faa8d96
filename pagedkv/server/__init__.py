"""The OpenAI-compatible HTTP server (``pagedkv serve``): FastAPI app, schemas, metrics, the
engine loop and the live ``/ui`` page of the KV cache."""

from pagedkv.server.app import APIError, build_app, load_api_keys
from pagedkv.server.engine_loop import EngineLoop, PromptSpec

__all__ = ["APIError", "EngineLoop", "PromptSpec", "build_app", "load_api_keys"]
