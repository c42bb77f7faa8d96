"""Per-request block tables (seed §02) and THE count of the blocks a request holds
(``blocks_needed``, ``request_blocks_needed``). The slot mapping a table gives its positions
is built by ``pagedkv.kv.slot_mapping`` (re-exported here).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.kv.block_pool import KVCacheBlock
from pagedkv.kv.slot_mapping import BatchSlots, build_slots, slot_mapping  # noqa: F401 - re-exported
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
