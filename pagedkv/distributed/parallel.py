"""Megatron-style tensor-parallel sharding of a Llama-family model (pure: no processes).

A model with ``Hq`` query heads, ``Hkv`` KV heads and MLP width ``I`` is split over ``N``
ranks (``N`` = ``tensor_parallel_size``):

* ``qkv_proj`` is **column-parallel** by heads: rank ``r`` keeps the rows of query heads
  ``[r*Hq/N, (r+1)*Hq/N)`` and of its KV heads (below), so attention runs locally on whole
  heads. ``o_proj`` is **row-parallel**: rank ``r`` keeps the matching ``Hq/N * d`` input
  columns; each rank's ``o_proj`` output is a partial sum, added up by one ``all_reduce``.
* ``gate_up_proj`` is column-parallel (rank ``r`` keeps its slice of the gate rows and the
  same slice of the up rows), ``down_proj`` row-parallel (the matching input columns), then one
  ``all_reduce``. ``I`` need not divide by ``N``: the slices differ by at most one column.
* KV heads: when ``Hkv >= N`` each rank owns ``Hkv/N`` of them; when ``Hkv < N`` each head is
  **replicated** on ``N/Hkv`` ranks and each rank holds one (what ``KVCacheSpec(tp_size=N)``
  reports). The query heads of a rank always map onto the KV heads it holds.
* Multi-head latent attention (``pagedkv.model.mla``): the query projection and ``kv_b_proj``
  are split by heads, ``o_proj`` row-parallel as above; the latent's projections and norms are
  **replicated**, and every rank caches the whole latent (one vector per token and layer, as
  ``KVCacheSpec(kv_lora_rank=..., tp_size=N)`` counts: replication ``N``). Valid sizes divide ``Hq``.
* Mixture-of-experts layers (``pagedkv.model.moe``) are split **inside each expert**, not by
  expert: every rank holds all ``E`` experts, each with its slice of the expert width
  ``I_e`` (``moe_intermediate_size``; ``gate_up_proj`` column-parallel, ``down_proj``
  row-parallel, slices as uneven as the MLP's), the shared experts (one MLP of width
  ``num_shared_experts * I_e``) with ``num_shared_experts`` times that slice, and the router
  (and DeepSeek-V3's ``e_score_correction_bias``) **replicated**: every rank routes every token
  to the same experts (the same fp32 logits from the same replicated input), each computes its
  partial outputs of those experts, and the layer's one ``all_reduce`` after the MLP sums them,
  shared experts included. Reason: no all-to-all and no load imbalance (every rank does the
  same share of every routed expert), and the whole layer stays the one-device code on
  narrower experts. Valid sizes also need ``N <= I_e``.
* Embedding, final norm and LM head are **replicated**, not vocab-parallel. Reason: sampling
  happens once, on the driver (rank 0); with a replicated head only rank 0 computes logits, for
  the sampled rows only, and no collective is needed for them. A vocab-parallel head would cost
  an all-gather of ``[rows, vocab]`` fp32 logits every step and a masked-embedding all-reduce,
  to save ``vocab x H`` parameters per rank (113 MB fp32 for the bundled 135M model; ~1 GB bf16
  for a 128k-vocab 4k-wide model), which is small next to the sharded layers.

Valid sizes: ``N`` divides ``Hq`` and either ``N`` divides ``Hkv`` or ``Hkv`` divides ``N``.
The bundled SmolLM2 (9 heads, 3 KV heads) accepts 1, 3 and 9.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from pagedkv.errors import ConfigError
from pagedkv.model.config import ModelConfig
from pagedkv.model.gguf_shard import Cut, module_cut
from pagedkv.model.tp_plan import TPShard, check_tp_size, shard_config, shard_plan, valid_tp_sizes

__all__ = ["TPShard", "build_shard_model", "check_tp_size", "shard_config", "shard_plan", "shard_state_dict",
           "valid_tp_sizes"]


def shard_state_dict(
    config: ModelConfig, state: Mapping[str, torch.Tensor], shard: TPShard
) -> dict[str, torch.Tensor]:
    """Slice a full state dict (our fused names, see ``pagedkv.model.llama``) to ``shard``.

    Replicated tensors (embedding, norms, LM head) are returned as-is (no copy); sliced ones
    are new contiguous tensors. Raises ``ConfigError`` on a tensor of the wrong shape.
    """
    d, hq, hkv = config.head_dim, config.num_heads, config.num_kv_heads
    if config.is_mla:
        return _shard_mla(config, state, shard)
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        leaf = name.rsplit(".", 2)[-2] if name.startswith("layers.") else ""
        if leaf == "qkv_proj":  # rows (weight [rows, H]) or entries (bias [rows])
            _expect(name, w, 0, (hq + 2 * hkv) * d)
            out[name] = _cut(w, module_cut(config, shard, leaf))
        elif leaf == "o_proj":
            _expect(name, w, 1, hq * d)
            out[name] = _cut(w, module_cut(config, shard, leaf))
        else:
            out[name] = _shard_mlp(config, name, leaf, w, shard)
    return out


def _cut(w: torch.Tensor, cut: Cut) -> torch.Tensor:
    """``w``'s rows and columns of ``cut`` (``gguf_shard.module_cut``: the one plan of the
    ranges, which a GGUF's stored blocks are cut by too) as a new contiguous tensor."""
    if cut.rows is not None:
        w = torch.cat([w[a:b] for a, b in cut.rows])
    if cut.cols is not None:
        w = w[:, cut.cols[0]:cut.cols[1]]
    return w.contiguous()


def _shard_mlp(config: ModelConfig, name: str, leaf: str, w: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """``w`` (any tensor outside attention) for ``shard``: a dense MLP's or an expert's
    ``gate_up_proj`` rows (gate slice, then the same up slice) and ``down_proj`` columns; the
    shared experts' by ``num_shared_experts`` times the expert slice; anything else (router,
    correction bias, norms, embedding) as it is."""
    if leaf not in ("gate_up_proj", "down_proj"):
        return w
    # a dense layer's MLP, else layers.{i}.mlp.experts.{e}.* (one expert) or layers.{i}.mlp.shared.*
    experts = 0 if ".mlp." not in name else config.num_shared_experts if ".mlp.shared." in name else 1
    inter = experts * config.moe_intermediate_size if experts else config.intermediate_size
    _expect(name, w, 0 if leaf == "gate_up_proj" else 1, 2 * inter if leaf == "gate_up_proj" else inter)
    return _cut(w, module_cut(config, shard, leaf, experts))


def _shard_mla(config: ModelConfig, state: Mapping[str, torch.Tensor], shard: TPShard) -> dict[str, torch.Tensor]:
    """``shard_state_dict`` of a multi-head latent attention model (``pagedkv.model.mla``): the
    query projection (``mla.q_proj`` / ``mla.q_b_proj``) and ``mla.kv_b_proj`` rows and the
    ``o_proj`` columns of the rank's heads, the MLP as for every model; the latent's own
    projections and norms (``q_a_*``, ``kv_a_*``) are replicated, so every rank writes the whole
    latent into its own cache (``KVCacheSpec``: the latent is replicated on every rank)."""
    h0, h1 = shard.q_heads
    qk, v, nope, hq = config.head_dim, config.v_head_dim, config.qk_nope_head_dim, config.num_heads
    rows = {"q_proj": (qk, hq * qk), "q_b_proj": (qk, hq * qk), "kv_b_proj": (nope + v, hq * (nope + v))}
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        leaf = name.rsplit(".", 2)[-2] if name.startswith("layers.") else ""
        if ".mla." in name and leaf in rows:
            per, total = rows[leaf]
            _expect(name, w, 0, total)
            out[name] = w[h0 * per:h1 * per].contiguous()
        elif leaf == "o_proj":
            _expect(name, w, 1, hq * v)
            out[name] = w[:, h0 * v:h1 * v].contiguous()
        else:
            out[name] = _shard_mlp(config, name, leaf, w, shard)
    return out


def _expect(name: str, w: torch.Tensor, dim: int, size: int) -> None:
    if w.dim() <= dim or w.shape[dim] != size:
        raise ConfigError(f"weights: {name} has shape {tuple(w.shape)}; expected {size} along dim {dim}")


def build_shard_model(
    config: ModelConfig,
    state: Mapping[str, torch.Tensor],
    shard: TPShard,
    all_reduce: Callable[[torch.Tensor], None] | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
):
    """A ``LlamaForCausalLM`` holding ``shard``'s slice of ``state``, whose layers call
    ``all_reduce(t)`` (in place, sum over ranks) on each row-parallel output ``[T, H]``.
    ``all_reduce=None`` builds the bare shard (tests). Raises ``ConfigError``."""
    from pagedkv.model.loader import build_model

    net = build_model(shard_config(config, shard), shard_state_dict(config, state, shard), dtype, device)
    for layer in net.layers:
        layer.all_reduce = all_reduce
    return net
