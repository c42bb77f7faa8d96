"""One tensor-parallel rank's shard of a GGUF file's stored blocks (``weights="gguf"`` with
``tensor_parallel_size`` > 1): each rank reads the file and keeps its slice of every matrix as
stored, so no rank ever holds the model in another precision or any other rank's slice.

The split is the one ``pagedkv.distributed.parallel`` makes of float weights (Megatron-style,
docs/distributed.md), made on the stored rows:

* a column-parallel matrix (``qkv_proj`` by heads, ``gate_up_proj`` and each expert's
  ``gate_up_proj`` by MLP columns) keeps whole stored rows: a row of blocks is one output;
* a row-parallel matrix (``o_proj``, ``down_proj``, each expert's ``down_proj``) keeps a range
  of every row's blocks, so the range must start and end on a block boundary: 32 values for
  Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/MXFP4, 256 for the K-quants. ``tp_problem`` says beforehand whether every
  rank's ranges do (an expert width of 384 split in two is 192 columns: whole Q4_0 blocks, not
  whole Q4_K super-blocks);
* the LM head, the embedding, norms and the router are replicated.

A row-parallel matrix with a bias (``ConfigError``) and multi-head latent attention files
(``tp_problem``) are not split here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import GGUFHeader, GGUFTensorInfo
from pagedkv.model.config import ModelConfig
from pagedkv.model.gguf_read import block_size, qtype_name, stored_bytes, tensor_rows
from pagedkv.model.tp_plan import TPShard, check_tp_size, shard_plan
from pagedkv.ops import qmm

__all__ = ["Cut", "check_stored_shape", "host_weight_bytes", "module_cut", "packed_cut", "tp_problem"]

#: GGML types whose values are plain floats (norms, biases, a router: no kernel multiplies them)
FLOAT_TYPES = ("F32", "F16", "BF16")
#: GGUF parts of the row-parallel matrices (their input columns are split)
ROW_PARALLEL = ("attn_output", "ffn_down", "ffn_down_exps")


@dataclass(frozen=True)
class Cut:
    """A rank's part of one weight matrix ``[rows, cols]`` (the module's rows, e.g. a fused
    ``qkv_proj``'s q, k and v rows in turn): ``rows`` the output rows kept, half-open ranges in
    order (``None``: all), ``cols`` the input columns kept (``None``: all)."""

    rows: Optional[tuple[tuple[int, int], ...]]
    cols: Optional[tuple[int, int]]

    def local(self, start: int, n: int) -> list[tuple[int, int]]:
        """The kept rows of a stored part holding the module's rows ``start .. start + n - 1``,
        as ranges relative to the part (empty: none of them)."""
        if self.rows is None:
            return [(0, n)]
        return [(max(a, start) - start, min(b, start + n) - start) for a, b in self.rows
                if max(a, start) < min(b, start + n)]

    def width(self, k: int) -> int:
        """The input size the rank's matrix has (``k`` the whole matrix's)."""
        return k if self.cols is None else self.cols[1] - self.cols[0]

    def take_cols(self, info: GGUFTensorInfo, raw: np.ndarray) -> np.ndarray:
        """The kept columns of stored rows ``raw`` (uint8 ``[n, row bytes]`` of ``info``'s
        type) as a new contiguous array; ``ConfigError`` unless they are whole blocks."""
        if self.cols is None:
            return raw
        per, size = block_size(info)
        c0, c1 = self.cols
        if c0 % per or c1 % per:
            raise ConfigError(f"weights: {info.name} is stored in {qtype_name(info)} blocks of {per} values; "
                              f"a rank's columns {c0}..{c1} do not start and end on a block")
        return np.ascontiguousarray(raw[:, c0 // per * size:c1 // per * size])


def module_cut(config: ModelConfig, shard: Optional[TPShard], module: str, experts: int = 0) -> Optional[Cut]:
    """``shard``'s ``Cut`` of a layer's ``module`` (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
    ``down_proj``), ``None`` for a replicated matrix or no shard. ``experts``: 0 for the dense
    MLP, else an MLP ``experts`` expert widths wide (1: a routed expert; ``num_shared_experts``:
    the shared experts), its slice that many times the rank's expert slice. The one plan of
    the ranges: ``pagedkv.distributed.parallel.shard_state_dict`` slices float weights by it."""
    if shard is None:
        return None
    d, hq, hkv = config.head_dim, config.num_heads, config.num_kv_heads
    q0, q1 = (h * d for h in shard.q_heads)
    if module == "qkv_proj":
        k0, k1 = (hq * d + h * d for h in shard.kv_heads)
        v0, v1 = ((hq + hkv) * d + h * d for h in shard.kv_heads)
        return Cut(((q0, q1), (k0, k1), (v0, v1)), None)
    if module == "o_proj":
        return Cut(None, (q0, q1))
    inter, (m0, m1) = ((experts * config.moe_intermediate_size, (experts * shard.moe[0], experts * shard.moe[1]))
                       if experts else (config.intermediate_size, shard.mlp))
    if module == "gate_up_proj":
        return Cut(((m0, m1), (inter + m0, inter + m1)), None)
    if module == "down_proj":
        return Cut(None, (m0, m1))
    return None


def check_stored_shape(config: ModelConfig, part: str, info: GGUFTensorInfo, fused_gate_up: bool = False) -> None:
    """``ConfigError`` naming ``info`` unless a layer matrix's stored shape (numpy order: rows,
    columns; stacked experts first) is the one ``config`` gives its ``part`` (``attn_q``,
    ``ffn_down``, ``ffn_up_exps``, ...; ``fused_gate_up``: Phi-3's ``ffn_up`` holds gate and up
    rows). Every rank's cuts, and one device's fused splits, take the header's sizes on trust:
    a tensor of another size would be sliced without an error. Other parts are not checked."""
    c = config
    d, h, i, e = c.head_dim, c.hidden_size, c.intermediate_size, c.moe_intermediate_size
    want = {"attn_q": (c.num_heads * d, h), "attn_k": (c.num_kv_heads * d, h), "attn_v": (c.num_kv_heads * d, h),
            "attn_qkv": ((c.num_heads + 2 * c.num_kv_heads) * d, h), "attn_output": (h, c.num_heads * d),
            "ffn_gate": (i, h), "ffn_up": ((2 if fused_gate_up else 1) * i, h), "ffn_down": (h, i),
            "ffn_gate_exps": (c.num_experts, e, h), "ffn_up_exps": (c.num_experts, e, h),
            "ffn_down_exps": (c.num_experts, h, e)}.get(part)
    if want is not None and tuple(info.shape) != want:
        raise ConfigError(f"weights: {info.name} has shape {tuple(info.shape)}; the model's config ({c.num_heads} "
                          f"heads, {c.num_kv_heads} KV heads of {d}, hidden {h}, MLP {i}"
                          f"{f', {c.num_experts} experts of {e}' if c.num_experts else ''}) gives {want}")


def tp_problem(header: GGUFHeader, config: ModelConfig, tp_size: int) -> Optional[str]:
    """``None`` when every rank of ``tp_size`` can keep its slices of the file's stored blocks;
    else why not (a sentence). Raises ``ConfigError`` for a size the model cannot be split over
    (``check_tp_size``)."""
    check_tp_size(config, tp_size)
    if tp_size == 1:
        return None
    if config.is_mla:
        return "tensor parallelism does not split a multi-head latent attention file's stored blocks yet"
    for info in header.tensors:
        part = info.name.split(".")[2] if info.name.startswith("blk.") and info.name.count(".") >= 3 else ""
        if part not in ROW_PARALLEL or not info.name.endswith(".weight"):
            continue
        per = qmm.GGUF_BLOCKS[qtype_name(info)][1] if qtype_name(info) in qmm.GGUF_BLOCKS else block_size(info)[0]
        module = "o_proj" if part == "attn_output" else "down_proj"
        for rank in range(tp_size):
            c0, c1 = module_cut(config, shard_plan(config, rank, tp_size), module, int(part == "ffn_down_exps")).cols
            if c0 % per or c1 % per:
                return (f"{info.name} is stored in {qtype_name(info)} blocks of {per} values, and rank {rank} of "
                        f"{tp_size} would keep its columns {c0}..{c1}, not whole blocks")
    return None


def host_weight_bytes(header: GGUFHeader, config: ModelConfig, tp_size: int, held: int,
                      kernel_matrix: Optional[Callable[[GGUFTensorInfo, str], bool]] = None) -> int:
    """Bytes of weights all ``tp_size`` ranks on one host hold together, given ``held`` (one
    process's, ``gguf_native.weight_bytes``): the split matrices once (F16 ones too, those
    ``kernel_matrix(tensor, head name)`` says the kernels multiply: ``gguf_native.kernel_matrix``),
    and the replicated ones (the LM head, other float tensors) ``tp_size`` times."""
    by_name = {t.name: t for t in header.tensors}
    head = by_name.get("token_embd.weight" if config.tie_word_embeddings else "output.weight")
    split_f16 = {t.name for t in header.tensors if kernel_matrix is not None and qtype_name(t) in qmm.GGUF_TYPES
                 and kernel_matrix(t, "output.weight")}
    replicated = (0 if head is None else stored_bytes(head)) + sum(
        int(np.prod(t.shape, dtype=np.int64)) * 4 for t in header.tensors
        if qtype_name(t) in FLOAT_TYPES and t.name not in split_f16)
    return held + (tp_size - 1) * replicated


def packed_cut(pieces: list[tuple[GGUFTensorInfo, int, Callable[[np.ndarray], None]]],
               biases: list[Optional[torch.Tensor]], k: int, cut: Cut,
               what: str) -> tuple[qmm.Packed, tuple[str, ...], int]:
    """``(packed weights, GGML type names, output rows)`` of a rank's cut of a matrix stored
    in ``pieces`` ``(tensor (its type), rows of this piece, fill(out uint8 [rows, row bytes]))``
    stacked along the output rows in order, with their ``biases`` (``None`` or float ``[rows]``
    each). Each piece is read whole, then its kept rows and columns copied out (one piece's
    bytes at a time beside the kept ones). Raises ``ConfigError`` for columns that are not whole
    blocks, a split bias of a row-parallel matrix, or a type the kernels do not take."""
    if cut.cols is not None and any(b is not None for b in biases):
        raise ConfigError(f"weights: {what}: tensor parallelism does not split a row-parallel matrix with a bias")
    kept: list[tuple[str, np.ndarray]] = []
    kept_bias: list[torch.Tensor] = []
    start = 0
    for (info, rows, fill), bias in zip(pieces, biases):
        ranges = cut.local(start, rows)
        start += rows
        if not ranges:
            continue
        raw = np.empty((rows, tensor_rows(info)[1]), dtype=np.uint8)
        fill(raw)
        sel = raw if ranges == [(0, rows)] else np.concatenate([raw[a:b] for a, b in ranges])
        kept.append((qtype_name(info), np.ascontiguousarray(cut.take_cols(info, sel))))
        del raw, sel
        if bias is not None:
            kept_bias.extend(bias[a:b] for a, b in ranges)
    types = tuple(t for t, _ in kept)
    n = sum(len(buf) for _, buf in kept)
    kk = cut.width(k)
    try:
        if len(set(types)) == 1:
            buf = np.concatenate([b for _, b in kept] + [np.zeros((-n % 8, kept[0][1].shape[1]), np.uint8)])
            bias = torch.cat(kept_bias + [torch.zeros(len(buf) - n)]).float().contiguous() if kept_bias else None
            return qmm.pack_gguf(types[0], buf, kk, bias), types, n
        if kept_bias:
            raise ConfigError(f"weights: {what}: a bias on parts of different types is not split")
        return qmm.concat_packed([qmm.pack_gguf(t, b, kk) for t, b in kept]), types, n
    except ValueError as e:
        raise ConfigError(f"weights: {what}: {e}") from None
