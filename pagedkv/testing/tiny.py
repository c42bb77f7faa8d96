"""A tiny random-weight decoder with the bundled model's vocabulary, tokenizer and chat
template: real token ids and real HTTP answers at a fraction of the cost (tests, replicas)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import LoadedModel, load_model


def tiny_random_model(loaded: Optional[LoadedModel] = None, seed: int = 0) -> LoadedModel:
    """2 layers, hidden 64, 4 query / 2 KV heads of 16; weights N(0, 0.05) from ``seed``,
    norms 1; float32. ``loaded``: the bundled model (loaded here when None) whose config,
    tokenizer and path it keeps. Model id ``tiny-random``."""
    loaded = loaded if loaded is not None else load_model(None, dtype=torch.float32)
    cfg = dataclasses.replace(loaded.config, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                              model_id="tiny-random", revision=f"seed{seed}")
    model = LlamaForCausalLM(cfg)  # parameters allocated, not initialised; RoPE tables built
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.05)
    return LoadedModel(model=model.eval(), config=cfg, tokenizer=loaded.tokenizer, path=loaded.path)
