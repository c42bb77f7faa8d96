"""Paged attention: one block-table protocol (``base``), several backends and layouts."""

from pagedkv.attention.base import AttentionBackend, AttentionMetadata
from pagedkv.attention.layouts import PagedKVCache
from pagedkv.attention.registry import DEFAULT_BACKEND, backend_info, get_backend, list_backends

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "PagedKVCache",
    "DEFAULT_BACKEND",
    "backend_info",
    "get_backend",
    "list_backends",
]
