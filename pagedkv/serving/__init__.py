"""Serving (``pagedkv serve``): the OpenAI-compatible HTTP server over one engine (this
package's modules: the FastAPI app (``app``), its routes, OpenAI mapping (``protocol``),
streaming, auth and body limits as dependencies, metrics, the engine loop and the live
``/ui`` page of the KV cache) and data-parallel replicas behind one routing ingress
(:mod:`pagedkv.serving.replicas`). The server's modules import nothing of the replicas."""

from pagedkv.serving.api_keys import load_api_keys
from pagedkv.serving.app import build_app
from pagedkv.serving.engine_loop import EngineLoop, PromptSpec
from pagedkv.serving.errors import APIError

__all__ = ["APIError", "EngineLoop", "PromptSpec", "build_app", "load_api_keys"]
