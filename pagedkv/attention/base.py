"""The block-table protocol shared by the engine and every attention backend.

One protocol, several layouts (seed §04, §06): the memory system (``pagedkv.kv``) decides
*which* physical block holds which tokens; a backend decides *how* a block is laid out in
memory and how attention reads it. Both agree on these tensors:

* ``slot_mapping``   int64 ``[num_tokens]``: for each new token of the flat batch, the slot
  ``physical_block * block_size + offset`` its K/V is written to; ``-1`` = do not write
  (padding).
* ``block_tables``   int32 ``[num_seqs, max_num_blocks]``: row i lists sequence i's physical
  block ids in logical order; entries past ``ceil(seq_lens[i] / block_size)`` are padding
  (any value, typically 0) and must never be read.
* ``seq_lens``       int32 ``[num_seqs]``: context length of each sequence *after* this step's
  tokens are written (cached tokens + new tokens), in tokens.
* ``query_start_loc`` int32 ``[num_seqs + 1]``: sequence i's new tokens are rows
  ``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch (so a decode sequence has 1
  row, a prefill chunk has many). The new tokens of sequence i sit at positions
  ``seq_lens[i] - q_len_i ... seq_lens[i] - 1``; attention is causal over those positions.

Per-layer options of ``forward`` (keyword arguments, the same for every sequence of a call):

* ``sliding_window`` (tokens, ``None`` = full attention): the query at position ``p`` sees keys
  at positions ``p - sliding_window < k <= p`` (``sliding_window`` keys including its own), as
  transformers' Mistral / Gemma-2 masks. A backend reads no K/V of positions below
  ``p - sliding_window + 1`` for the earliest query of a sequence: the block table entries of
  blocks wholly before that position may be a placeholder (null) block.
* ``logits_soft_cap`` (``None`` = off): scores ``s = scale * q.k`` become
  ``cap * tanh(s / cap)`` before the mask and the softmax (Gemma-2).
* ``sinks`` (``None`` = off; only where the backend declares ``attention_sinks``): a float
  tensor ``[num_heads]`` of logits, one per query head, that join each softmax's denominator
  and carry no value: ``p_k = exp(s_k) / (exp(sink_h) + sum_j exp(s_j))`` (gpt-oss; transformers'
  ``eager_attention_forward`` with ``module.sinks``).

Queries, keys and values of the flat batch are ``[num_tokens, num_heads, head_dim]`` (keys and
values with ``num_kv_heads``); GQA/MQA map query head h to KV head ``h // (num_heads //
num_kv_heads)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from pagedkv.errors import BackendError, InvalidRequestError
from pagedkv.kv.block_table import BatchSlots, build_slots


@dataclass
class AttentionMetadata:
    """Per-step inputs of attention; built once per step by the model runner and shared by
    all layers. Tensors live on the KV cache's device. Shapes and dtypes: see module doc."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_num_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int  # tokens
    max_seq_len: int  # tokens
    # Python-side copies (lists of ints) for backends that loop per sequence on the CPU.
    seq_lens_list: list[int] | None = None
    query_lens_list: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @staticmethod
    def build(
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build metadata from Python lists (used by tests and the conformance kit).

        ``block_tables[i]`` must hold at least ``ceil(seq_lens[i] / block_size)`` block ids.
        The slot of each new token is derived from its position (seed §02):
        ``block_tables[i][pos // block_size] * block_size + pos % block_size``.
        """
        for i, (sl, ql) in enumerate(zip(seq_lens, query_lens)):
            if ql > sl:
                raise InvalidRequestError(f"query_len {ql} > seq_len {sl} for sequence {i}")
        seq_lens, query_lens = list(seq_lens), list(query_lens)
        b = build_slots(block_tables, [s - q for s, q in zip(seq_lens, query_lens)], query_lens, block_size)
        return AttentionMetadata.from_slots(b, query_lens, device)

    @staticmethod
    def from_slots(b: BatchSlots, query_lens: Sequence[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata on ``device`` from :func:`pagedkv.kv.block_table.build_slots`'s output."""
        seq_lens = b.seq_lens.tolist()
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(b.slot_mapping).to(device),
            block_tables=torch.from_numpy(b.block_tables).to(device),
            seq_lens=torch.from_numpy(b.seq_lens).to(device),
            query_start_loc=torch.from_numpy(b.query_start_loc).to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            seq_lens_list=seq_lens,
            query_lens_list=list(query_lens),
        )


def check_window(sliding_window: int | None, logits_soft_cap: float | None) -> tuple[int, float]:
    """Validate ``forward``'s per-layer options; returns ``(window, cap)`` with 0 meaning
    "off" (a window of ``2**31 - 1`` tokens or more sees every position a sequence can have,
    so it is off: kernels take 32-bit windows). Raises ``BackendError`` for a non-positive or
    non-integral window, or a cap that is not a positive finite number."""
    window = 0
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
            raise BackendError(f"sliding_window must be a positive int (tokens) or None, got {sliding_window!r}")
        window = int(sliding_window) if sliding_window < 2**31 - 1 else 0
    cap = 0.0
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)) \
                or not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0:
            raise BackendError(f"logits_soft_cap must be a positive finite number or None, got {logits_soft_cap!r}")
        cap = float(logits_soft_cap)
    return window, cap


def window_start(pos: int, window: int) -> int:
    """First key position (tokens) the query at ``pos`` sees with ``window`` (0 = no window)."""
    return max(0, pos - window + 1) if window else 0


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend offers beyond :class:`AttentionBackend`, declared by the backend as its
    class attribute ``capabilities`` (the step strategy, ``pagedkv.model.step_strategy``, is
    chosen from it once at start). Each field true means the backend has that method:

    * ``write_and_forward``: K/V write and attention in one call (the fused eager layer)
    * ``native_step``: ``native_step_args`` and ``latent_step_args``, kernel arguments for
      ``decoder.c``'s whole step (the second for multi-head latent attention caches)
    * ``step_attention``: one prepared attention table for a compiled step's layers
    * ``step_table``: ``step_attention`` takes the C++ op's ``table=`` (``pagedkv.ops.step_op``)
    * ``attention_sinks``: ``forward`` / ``write_and_forward`` take the ``sinks`` option (module doc)
    """

    write_and_forward: bool = False
    native_step: bool = False
    step_attention: bool = False
    step_table: bool = False
    attention_sinks: bool = False

    def fast_path(self) -> str:
        """The backend's one fast path in words: ``"native step"``, ``"fused layer"`` or
        ``"none"`` (the eager reference path only)."""
        return "native step" if self.native_step else "fused layer" if self.write_and_forward else "none"


#: the record of a backend that declares none: the eager reference path only
EAGER_ONLY = BackendCapabilities()


def backend_capabilities(backend: Any) -> BackendCapabilities:
    """``backend.capabilities`` when it is a :class:`BackendCapabilities`, else
    :data:`EAGER_ONLY` (a backend registered from outside that declares nothing runs the
    protocol's ``write_kv`` and ``forward`` only). Never raises."""
    caps = getattr(backend, "capabilities", None)
    return caps if isinstance(caps, BackendCapabilities) else EAGER_ONLY


@runtime_checkable
class AttentionBackend(Protocol):
    """What every backend implements. A backend owns its KV layout; callers never index the
    cache tensors themselves (use ``gather_kv`` for inspection in tests).

    One cache object per layer. ``copy_blocks`` applies copy-on-write copies decided by the
    memory system before the step's writes (codes and scales alike for a quantised cache).
    Optional, not part of the protocol, and used only where the backend declares them in its
    ``capabilities`` (a :class:`BackendCapabilities`; read with :func:`backend_capabilities`,
    never probed for): ``write_and_forward(query, key, value, kv_cache, metadata, scale,
    sliding_window=None, logits_soft_cap=None)``, ``write_kv`` then ``forward`` in one call
    (same results and errors); ``native_step_args(query, key, value, kv_caches, metadata)``,
    the attention kernel's prepared arguments for ``pagedkv.model.native_step``, and
    ``latent_step_args(kv_caches, metadata, num_tokens)``, those of an MLA latent cache;
    ``step_attention(kv_caches, metadata, options)`` -> ``attend(i, q, k, v)`` or ``None``:
    every layer's ``write_and_forward`` for one step whose layers share ``metadata``
    (``pagedkv.model.compiled``; ``None``: call layer by layer), with ``table=`` (a
    ``pagedkv.ops.step_op.StepTable``) where ``step_table`` is declared.
    """

    name: str

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
        device: torch.device | str = "cpu",
        quant_group_size: int | None = None,
    ) -> Any:
        """Allocate one layer's K and V cache (zeros) in this backend's layout. ``dtype``: a
        floating torch dtype, or a quantised ``kv_cache_dtype`` (``"int8"``, ``"fp8_e4m3"``,
        ``"fp8_e5m2"``: one-byte codes plus an bf16 scale per ``quant_group_size`` elements of
        each head vector, see ``pagedkv.attention.quant``)."""
        ...

    def write_kv(self, kv_cache: Any, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` to their slots;
        rows whose slot is -1 are skipped. A quantised cache quantises here."""
        ...

    def forward(
        self, query: torch.Tensor, kv_cache: Any, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None = None, logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over each
        sequence's paged context; returns ``[num_tokens, num_heads, head_dim]`` in the
        query's dtype. A quantised cache is dequantised inside the read (a tile at a time).
        ``sliding_window`` (tokens) and ``logits_soft_cap``: see the module doc (validated by
        :func:`check_window`, ``BackendError``)."""
        ...

    def copy_blocks(self, kv_cache: Any, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole physical blocks ``src -> dst`` (copy-on-write)."""
        ...

    def export_blocks(self, kv_cache: Any, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """The raw storage of whole blocks ``block_ids`` (int64 ``[n]``): one new tensor
        ``[n, ...]`` per storage tensor (K, V and whatever else the layout keeps per block),
        on the cache's device. For the KV tiers (``pagedkv.kv.tiers``)."""
        ...

    def import_blocks(self, kv_cache: Any, block_ids: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """Overwrite whole blocks ``block_ids`` with what ``export_blocks`` returned (bit for
        bit; ``parts`` may be on another device). Raises ``BackendError`` on a mismatch."""
        ...

    def gather_kv(self, kv_cache: Any, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read K and V at ``slots`` (int64 ``[n]``) -> two ``[n, num_kv_heads, head_dim]``
        tensors (float32 dequantised values for a quantised cache). For tests and debugging.
        Backends with quantised caches also have ``gather_kv_raw(kv_cache, slots) -> (K codes,
        V codes, K scales, V scales)``, which the conformance kit's oracle dequantises itself."""
        ...
