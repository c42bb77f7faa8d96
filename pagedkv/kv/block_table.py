"""Per-request block tables and the slot mapping (seed §02).

```
logical_block  = pos // block_size
offset         = pos %  block_size
physical_block = table[logical_block]
slot           = physical_block * block_size + offset
```
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pagedkv.errors import InvalidRequestError
from pagedkv.kv.block_pool import KVCacheBlock


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def slot_mapping(block_ids: Sequence[int] | np.ndarray, block_size: int, start: int, end: int) -> np.ndarray:
    """Slots (int64 ``[end - start]``) of token positions ``start .. end-1`` for a request
    whose logical blocks map to ``block_ids``. Vectorised (no per-token Python loop).
    Raises ``InvalidRequestError`` if a position has no block."""
    if start < 0 or end < start:
        raise InvalidRequestError(f"bad position range [{start}, {end})")
    if end > len(block_ids) * block_size:
        raise InvalidRequestError(
            f"position {end - 1} needs logical block {(end - 1) // block_size}, "
            f"the table has {len(block_ids)} blocks"
        )
    pos = np.arange(start, end, dtype=np.int64)
    ids = np.asarray(block_ids, dtype=np.int64)
    return ids[pos // block_size] * block_size + pos % block_size


class BlockTable:
    """One request's logical -> physical block mapping. Grows append-only; copy-on-write
    may swap one entry for a private copy (``replace``). Keeps the id list alongside the
    block objects so ``ids`` is cheap to read every step.

    ``num_tokens`` is the number of token positions the request has slots for;
    ``num_hashed``/``last_hash`` track the prefix-cache hash chain (blocks hashed so far and
    the hash of the last one), so each block is hashed once.
    """

    __slots__ = ("block_size", "blocks", "_ids", "num_tokens", "num_hashed", "last_hash")

    def __init__(self, block_size: int, blocks: Sequence[KVCacheBlock] = (), num_tokens: int = 0) -> None:
        self.block_size = block_size
        self.blocks: list[KVCacheBlock] = list(blocks)
        self._ids: list[int] = [b.block_id for b in self.blocks]
        self.num_tokens = num_tokens
        self.num_hashed = 0
        self.last_hash: bytes | None = None

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

    def replace(self, logical_block: int, block: KVCacheBlock) -> KVCacheBlock:
        """Swap entry ``logical_block`` for ``block`` (copy-on-write); returns the old one."""
        old = self.blocks[logical_block]
        self.blocks[logical_block] = block
        self._ids[logical_block] = block.block_id
        return old

    def physical(self, pos: int) -> tuple[int, int]:
        """``(physical_block, offset)`` of token position ``pos``."""
        return self._ids[pos // self.block_size], pos % self.block_size

    def slot(self, pos: int) -> int:
        """Slot of token position ``pos`` (``physical_block * block_size + offset``)."""
        return self._ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_mapping(self, start: int, end: int) -> np.ndarray:
        """Slots of positions ``start .. end-1`` (int64 array)."""
        return slot_mapping(self._ids, self.block_size, start, end)
