"""Paged KV caches for driving a model's ``forward`` directly, without an engine (tests, the
perplexity benchmark). The engine allocates its caches in ``pagedkv.worker.runner.ModelRunner``
(one per layer slot of its layer groups); this is the same per-layer allocation for one group."""

from __future__ import annotations

from typing import Any

import torch


def allocate_kv_caches(
    model: Any,
    backend: Any,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> list[Any]:
    """One ``backend.allocate_kv_cache(num_blocks, block_size, config.cache_kv_heads,
    config.cache_head_dim, dtype, device)`` per layer of ``model`` (a
    ``pagedkv.model.llama.LlamaForCausalLM``): zeros, in the model's dtype and device unless
    given. Multi-head latent attention (``config.is_mla``) takes
    ``pagedkv.model.mla.allocate_latent_cache`` (one latent per token, K only). Returns the list
    the model's ``forward`` takes as ``kv_caches``; the backend raises on a bad size or dtype."""
    c = model.config
    alloc = backend.allocate_kv_cache
    if c.is_mla:
        from pagedkv.model.mla import allocate_latent_cache

        def alloc(*args: Any) -> Any:
            return allocate_latent_cache(backend, *args)
    return [alloc(num_blocks, block_size, c.cache_kv_heads, c.cache_head_dim, dtype or model.dtype, device or model.device)
            for _ in range(c.num_layers)]
