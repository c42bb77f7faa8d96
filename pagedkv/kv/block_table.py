"""Per-request block tables and the slot mapping (seed §02).

```
logical_block  = pos // block_size
offset         = pos %  block_size
physical_block = table[logical_block]
slot           = physical_block * block_size + offset
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.kv.block_pool import KVCacheBlock
from pagedkv.utils import cdiv


def blocks_needed(num_tokens: Any, block_size: int, window: int | None = None, chunk: int | None = None) -> Any:
    """THE count of KV blocks (of one layer group) a request of ``num_tokens`` tokens holds.

    * ``window=None`` (full attention): ``ceil(num_tokens / block_size)``.
    * ``window=W`` (sliding, tokens): after its last step, a decode computing position
      ``num_tokens - 1`` alone, only the blocks of the last ``W`` positions are live:
      ``ceil(T / bs) - max(0, T - W) // bs``.
    * ``window=W, chunk=C`` (tokens per step, e.g. the prefill chunk): the most it holds at
      any step, ``min(ceil(T / bs), ceil((W - 1 + C) / bs) + 1)``.

    ``chunk`` is ignored for a full group. Returns 0 for ``num_tokens == 0``.
    ``num_tokens`` may be an int64 array (capacity simulations over many requests): the
    result is the array of the same counts, element by element. Raises ``ConfigError``
    naming the argument when ``num_tokens`` is negative (or not an integer / integer array)
    or ``block_size``, ``window`` or ``chunk`` is not a positive integer."""
    for name, v in (("block_size", block_size), ("window", window), ("chunk", chunk)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ConfigError(f"{name}: must be a positive integer, got {v!r}")
    if isinstance(num_tokens, np.ndarray):
        if num_tokens.dtype.kind not in "iu" or (num_tokens.size and num_tokens.min() < 0):
            raise ConfigError(f"num_tokens: must be non-negative integers, got a {num_tokens.dtype} array")
    elif isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise ConfigError(f"num_tokens: must be a non-negative integer, got {num_tokens!r}")
    full = cdiv(num_tokens, block_size)
    if window is None:
        return full
    if isinstance(num_tokens, np.ndarray):
        if chunk is None:
            return full - np.maximum(0, num_tokens - window) // block_size
        return np.minimum(full, cdiv(window - 1 + chunk, block_size) + 1)
    if chunk is None:
        return full - max(0, num_tokens - window) // block_size
    return min(full, cdiv(window - 1 + chunk, block_size) + 1)


def request_blocks_needed(num_tokens: int, block_size: int, windows: Sequence[int | None] = (None,),
                          chunk: int | None = None) -> int:
    """THE count of block ids one request of ``num_tokens`` tokens holds, summed over its
    layer groups (``windows``: per group its sliding window in tokens, ``None`` = full; the
    default is one full group): :func:`blocks_needed` per group, after its last (decode) step,
    or with ``chunk`` tokens per step the most it holds at any step. Used by the capacity
    planner (``KVCacheSpec.blocks_per_request``) and the admission check
    (``pagedkv.engine.sequence_group.request_blocks``). Raises ``ConfigError`` as
    :func:`blocks_needed` does."""
    return sum(blocks_needed(num_tokens, block_size, w, chunk) for w in windows)


@dataclass
class BatchSlots:
    """Flat-batch addressing of one step (numpy; the model runner moves it to the device).

    ``block_tables`` int32 ``[num_seqs, max_blocks]`` (rows padded with block 0),
    ``positions`` / ``slot_mapping`` int64 ``[num_tokens]`` (sequence by sequence, the new
    tokens in order), ``query_start_loc`` int32 ``[num_seqs + 1]``, ``seq_lens`` int32
    ``[num_seqs]`` (tokens, the new ones included)."""

    block_tables: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray


def build_slots(
    block_ids: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
) -> BatchSlots:
    """THE slot-mapping builder (seed §02), used by the model runner, the attention
    metadata and the conformance kit. Sequence ``i`` computes ``query_lens[i]`` new tokens at
    positions ``num_computed[i] ...``; ``block_ids[i]`` is its block table (physical ids in
    logical order). One vectorised gather, no per-token Python loop. Raises
    ``InvalidRequestError`` when a position has no block or a length is negative."""
    num_seqs = len(block_ids)
    starts = np.asarray(num_computed, dtype=np.int64).reshape(num_seqs)
    qlens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
    nblocks = np.fromiter((len(b) for b in block_ids), dtype=np.int64, count=num_seqs)
    seq_lens = starts + qlens
    if num_seqs and (starts.min() < 0 or qlens.min() < 0):
        raise InvalidRequestError("num_computed and query_lens must be >= 0")
    short = np.nonzero(nblocks * block_size < seq_lens)[0]
    if short.size:
        i = int(short[0])
        raise InvalidRequestError(
            f"sequence {i}: position {int(seq_lens[i]) - 1} needs logical block "
            f"{(int(seq_lens[i]) - 1) // block_size}, the table has {int(nblocks[i])} blocks"
        )
    table = np.zeros((num_seqs, max(int(nblocks.max(initial=0)), 1)), dtype=np.int64)
    if num_seqs:
        rows = np.repeat(np.arange(num_seqs), nblocks)
        cols = np.arange(rows.size) - np.repeat(np.cumsum(nblocks) - nblocks, nblocks)
        table[rows, cols] = np.fromiter(
            (b for ids in block_ids for b in ids), dtype=np.int64, count=rows.size
        )
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    seq_idx = np.repeat(np.arange(num_seqs), qlens)
    positions = np.arange(qsl[-1], dtype=np.int64) - qsl[:-1][seq_idx] + starts[seq_idx]
    slots = table[seq_idx, positions // block_size] * block_size + positions % block_size
    return BatchSlots(
        block_tables=table.astype(np.int32), positions=positions, slot_mapping=slots,
        query_start_loc=qsl.astype(np.int32), seq_lens=seq_lens.astype(np.int32),
    )


def slot_mapping(block_ids: Sequence[int] | np.ndarray, block_size: int, start: int, end: int) -> np.ndarray:
    """Slots (int64 ``[end - start]``) of token positions ``start .. end-1`` for one request
    whose logical blocks map to ``block_ids`` (:func:`build_slots` for a batch of one).
    Raises ``InvalidRequestError`` if a position has no block."""
    if start < 0 or end < start:
        raise InvalidRequestError(f"bad position range [{start}, {end})")
    return build_slots([list(block_ids)], [start], [end - start], block_size).slot_mapping


class BlockTable:
    """One request's logical -> physical block mapping. Grows append-only; copy-on-write
    may swap one entry for a private copy (``replace``). Keeps the id list alongside the
    block objects so ``ids`` is cheap to read every step.

    ``num_tokens`` is the number of token positions the request has slots for;
    ``num_hashed``/``last_hash`` track the prefix-cache hash chain (blocks hashed so far and
    the hash of the last one), so each block is hashed once. ``num_null``: how many leading
    entries are the null placeholder of a sliding-window group (``nullify``).
    """

    __slots__ = ("block_size", "blocks", "_ids", "num_tokens", "num_hashed", "last_hash", "num_null")

    def __init__(self, block_size: int, blocks: Sequence[KVCacheBlock] = (), num_tokens: int = 0) -> None:
        self.block_size = block_size
        self.blocks: list[KVCacheBlock] = list(blocks)
        self._ids: list[int] = [b.block_id for b in self.blocks]
        self.num_tokens = num_tokens
        self.num_hashed = 0
        self.last_hash: bytes | None = None
        self.num_null = 0

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def ids(self) -> list[int]:
        """Physical block ids in logical order (a copy)."""
        return list(self._ids)

    @property
    def num_slots(self) -> int:
        """Token slots the table's blocks provide (``len * block_size``)."""
        return len(self.blocks) * self.block_size

    def append(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.blocks.extend(blocks)
        self._ids.extend(b.block_id for b in blocks)

    def truncate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Keep the first ``num_blocks`` entries; returns the removed ones, in logical order."""
        gone = self.blocks[num_blocks:]
        del self.blocks[num_blocks:], self._ids[num_blocks:]
        return gone

    def replace(self, logical_block: int, block: KVCacheBlock) -> KVCacheBlock:
        """Swap entry ``logical_block`` for ``block`` (copy-on-write); returns the old one."""
        old = self.blocks[logical_block]
        self.blocks[logical_block] = block
        self._ids[logical_block] = block.block_id
        return old

    @property
    def live_blocks(self) -> list[KVCacheBlock]:
        """The real blocks (placeholders excluded), in logical order."""
        return self.blocks[self.num_null:]

    def nullify(self, end: int, null: KVCacheBlock) -> list[KVCacheBlock]:
        """Replace entries ``num_null .. end-1`` with the ``null`` placeholder (a sliding
        window moved past them); returns the replaced real blocks, in logical order."""
        start = self.num_null
        if end <= start:
            return []
        gone = self.blocks[start:end]
        self.blocks[start:end] = [null] * (end - start)
        self._ids[start:end] = [null.block_id] * (end - start)
        self.num_null = end
        return gone

    def physical(self, pos: int) -> tuple[int, int]:
        """``(physical_block, offset)`` of token position ``pos``."""
        return self._ids[pos // self.block_size], pos % self.block_size

    def slot(self, pos: int) -> int:
        """Slot of token position ``pos`` (``physical_block * block_size + offset``)."""
        return self._ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_mapping(self, start: int, end: int) -> np.ndarray:
        """Slots of positions ``start .. end-1`` (int64 array)."""
        return slot_mapping(self._ids, self.block_size, start, end)
