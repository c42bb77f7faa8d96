"""Bookkeeping of one tier: which block hashes it holds, in LRU order (no K/V here).

A ``TierEntry`` carries exactly what a pool block carries when published (its hash, the
parent hash and the token / extra-key bytes it was hashed from), so a lookup in a tier
confirms a hit by comparison like the pool does: a hash collision is a miss, never wrong
K/V, and two tenants (or salts) never share an entry.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator


@dataclass(eq=False)
class TierEntry:
    """One cached block's identity: ``block_hash`` (32 bytes), ``parent_hash`` (``None`` for
    a first block), ``token_bytes`` (its token ids, int64 little-endian) and
    ``extra_bytes`` (its typed extra keys: model, revision, adapter, salt, tenant, mm)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_bytes: bytes
    extra_bytes: bytes

    def matches(self, parent_hash: bytes | None, token_bytes: bytes, extra_bytes: bytes) -> bool:
        return (self.token_bytes == token_bytes and self.parent_hash == parent_hash
                and self.extra_bytes == extra_bytes)


class TierHit:
    """A prefix block found in tier ``level`` (not in the pool). It stands in the hit list
    of ``KVCacheManager.get_computed_blocks`` next to pool blocks; ``allocate_slots`` gives
    it a fresh pool block and records its load. ``ref_cnt`` is 0: admitting it takes one
    free block, exactly like reviving a cached free block."""

    __slots__ = ("entry", "level", "tier")
    ref_cnt = 0
    block_id = None

    def __init__(self, entry: TierEntry, level: int, tier: str) -> None:
        self.entry = entry
        self.level = level
        self.tier = tier

    @property
    def block_hash(self) -> bytes:
        return self.entry.block_hash

    def __repr__(self) -> str:
        return f"TierHit({self.tier}, {self.entry.block_hash.hex()[:8]})"


class TierIndex:
    """The hashes tier ``name`` holds, least recently used first, at most
    ``capacity_blocks``. ``pin`` keeps an entry from being chosen as the eviction victim
    while a load of it is being planned."""

    def __init__(self, name: str, capacity_blocks: int) -> None:
        self.name = name
        self.capacity_blocks = capacity_blocks
        self._entries: OrderedDict[bytes, TierEntry] = OrderedDict()
        self._pinned: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def __iter__(self) -> Iterator[TierEntry]:
        return iter(self._entries.values())

    @property
    def full(self) -> bool:
        return len(self._entries) >= self.capacity_blocks

    def get(self, block_hash: bytes) -> TierEntry | None:
        return self._entries.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        """Mark most recently used."""
        self._entries.move_to_end(block_hash)

    def add(self, entry: TierEntry) -> None:
        self._entries[entry.block_hash] = entry

    def pop(self, block_hash: bytes) -> TierEntry | None:
        self._pinned.discard(block_hash)
        return self._entries.pop(block_hash, None)

    def clear(self) -> list[TierEntry]:
        out = list(self._entries.values())
        self._entries.clear()
        self._pinned.clear()
        return out

    def victim(self) -> TierEntry | None:
        """The least recently used entry that is not pinned (``None`` if all are)."""
        for h, e in self._entries.items():
            if h not in self._pinned:
                return e
        return None

    def pin(self, block_hash: bytes) -> None:
        self._pinned.add(block_hash)

    def unpin_all(self) -> None:
        self._pinned.clear()
