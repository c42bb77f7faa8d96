"""pagedkv: a small, readable LLM inference engine built around a paged KV cache.

    from pagedkv import LLM, SamplingParams
"""

from pagedkv import cpu_isa as _cpu_isa
from pagedkv.errors import (  # noqa: F401
    ConfigError,
    InvalidRequestError,
    NoFreeBlocksError,
    PagedKVError,
)

# $PAGEDKV_CPU_ISA caps torch's and oneDNN's kernels too: their variables must be set before
# torch is imported, so first (nothing above imports torch)
_cpu_isa.apply_env()

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing pagedkv.kv must not import torch models
    if name == "LLM":
        from pagedkv.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedkv.engine.engine import LLMEngine

        return LLMEngine
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        from pagedkv.engine import request

        return getattr(request, name)
    if name == "StructuredSpec":
        from pagedkv.engine.structured import StructuredSpec

        return StructuredSpec
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredSpec", "RequestOutput", "PagedKVError",
           "ConfigError", "InvalidRequestError", "NoFreeBlocksError"]
