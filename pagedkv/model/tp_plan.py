"""The tensor-parallel plan of a model, pure and process-free: which sizes split it
(``valid_tp_sizes``, ``check_tp_size``) and which heads and MLP columns each rank owns
(``TPShard``, ``shard_plan``). It lives beside the model so a loader can build one rank's shard
straight from a file (``pagedkv.model.gguf_shard``); the sharding itself is described in
``pagedkv.distributed.parallel`` and docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagedkv.errors import ConfigError
from pagedkv.model.config import ModelConfig

__all__ = ["TPShard", "check_tp_size", "shard_config", "shard_plan", "valid_tp_sizes"]


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Every ``tensor_parallel_size`` this model can be split over (ascending, 1 included):
    ``N`` divides the query heads, divides or is a multiple of the KV heads, and leaves every
    rank at least one column of the MLP and (mixture of experts) of each expert."""
    hq, hkv = config.num_heads, config.num_kv_heads
    widths = [config.intermediate_size] + ([config.moe_intermediate_size] if config.num_experts else [])
    return [n for n in range(1, hq + 1) if hq % n == 0 and (hkv % n == 0 or n % hkv == 0)
            and all(n <= w for w in widths)]


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Raise ``ConfigError`` (naming ``tensor_parallel_size`` and the valid sizes) unless the
    model can be split over ``tp_size`` ranks."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
    unsplit = [name for name, on in (("attention sinks", config.attention_sinks), ("an o_proj bias", config.o_proj_bias),
                                     ("expert biases", config.moe_bias)) if on]
    if tp_size > 1 and unsplit:  # gpt-oss: the shard plan does not slice these yet
        raise ConfigError(f"tensor_parallel_size {tp_size}: {config.model_id or 'this model'} has "
                          f"{', '.join(unsplit)}, which tensor parallelism does not split yet; use 1")
    valid = valid_tp_sizes(config)
    if tp_size not in valid:
        experts = (f", {config.num_experts} experts of width {config.moe_intermediate_size}"
                   if config.num_experts else "")
        raise ConfigError(
            f"tensor_parallel_size {tp_size} does not fit {config.model_id or 'this model'} "
            f"({config.num_heads} attention heads, {config.num_kv_heads} KV heads{experts}): each rank needs "
            f"whole query heads, a whole share of the KV heads and a column of every MLP; valid sizes: "
            f"{', '.join(map(str, valid))}"
        )


@dataclass(frozen=True)
class TPShard:
    """What rank ``rank`` of ``tp_size`` holds. Ranges are half-open ``(start, stop)``:
    ``q_heads`` query heads, ``kv_heads`` KV heads (one head, shared with other ranks, when
    replicated), ``mlp`` intermediate columns of the dense MLPs, ``moe`` columns of each
    expert (``(0, 0)`` without experts; the shared experts' slice is ``num_shared_experts``
    times it)."""

    rank: int
    tp_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]
    moe: tuple[int, int] = (0, 0)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.mlp[1] - self.mlp[0]


def shard_plan(config: ModelConfig, rank: int, tp_size: int) -> TPShard:
    """The slice of ``config``'s heads and MLP that ``rank`` owns. Raises ``ConfigError``."""
    check_tp_size(config, tp_size)
    if not 0 <= rank < tp_size:
        raise ConfigError(f"rank {rank} outside [0, {tp_size})")
    hq, hkv = config.num_heads, config.num_kv_heads
    q_per = hq // tp_size
    q = (rank * q_per, (rank + 1) * q_per)
    if hkv >= tp_size:
        kv_per = hkv // tp_size
        kv = (rank * kv_per, (rank + 1) * kv_per)
    else:  # replicated: ranks r*hkv//N share head r // (N/hkv)
        h = rank // (tp_size // hkv)
        kv = (h, h + 1)
    # GQA: query head i reads KV head i // (hq/hkv); every local query head must read a local KV head
    group = hq // hkv
    assert kv[0] <= q[0] // group and (q[1] - 1) // group < kv[1], (q, kv)
    moe = _split(config.moe_intermediate_size, rank, tp_size) if config.num_experts else (0, 0)
    return TPShard(rank, tp_size, q, kv, _split(config.intermediate_size, rank, tp_size), moe)


def _split(width: int, rank: int, tp_size: int) -> tuple[int, int]:
    """``rank``'s half-open slice of ``width`` columns (``tensor_split``: sizes differ by <= 1)."""
    bounds = [len(c) for c in torch.arange(width).tensor_split(tp_size)]
    start = sum(bounds[:rank])
    return start, start + bounds[rank]


def shard_config(config: ModelConfig, shard: TPShard) -> ModelConfig:
    """The per-rank ``ModelConfig``: local head counts, MLP and expert widths, everything else equal."""
    moe = {"moe_intermediate_size": shard.moe[1] - shard.moe[0]} if config.num_experts else {}
    return dataclasses.replace(
        config, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
        intermediate_size=shard.intermediate_size, **moe,
    )
