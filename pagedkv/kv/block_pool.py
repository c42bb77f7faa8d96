"""The physical block pool (seed §02, §04): every block object created up front, reference
counts, an O(1) LRU free queue, all-or-nothing allocation and prefix-cache eviction.

A block is *free* when its ``ref_cnt`` is 0; it then sits in the free queue. A free block may
still carry a ``block_hash`` (its K/V are a valid cached prefix): a prefix hit takes it back
out of the middle of the queue; popping it from the front for a new owner evicts the hash.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any, Iterable, Iterator

from pagedkv.errors import ConfigError, NoFreeBlocksError


class KVCacheBlock:
    """One physical block: ``block_id`` (its index in the device cache), ``ref_cnt`` (number
    of block tables holding it, step-fence holds included), ``block_hash`` (bytes when
    published to the prefix cache, else ``None``) and, when published, what the hash covers
    (``parent_hash``, ``token_bytes``, ``extra_bytes``) so a hit can be confirmed exactly."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_bytes", "extra_bytes")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.parent_hash: bytes | None = None
        self.token_bytes: bytes | None = None
        self.extra_bytes: bytes | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Free blocks in eviction order (front = evicted first). O(1) ``popleft``, ``append``
    and ``remove`` (from the middle, for a prefix hit on a free cached block). Backed by an
    ``OrderedDict`` keyed by block id, so an id can never be queued twice."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._q: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._q

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self._q.values())

    def popleft(self) -> KVCacheBlock:
        return self._q.popitem(last=False)[1]

    def append(self, block: KVCacheBlock) -> None:
        if block.block_id in self._q:
            raise AssertionError(f"block {block.block_id} is already free")
        self._q[block.block_id] = block

    def remove(self, block: KVCacheBlock) -> None:
        del self._q[block.block_id]

    def ids(self) -> list[int]:
        return list(self._q)


class BlockPool:
    """``num_blocks`` blocks, a free queue and the prefix-cache map ``hash -> block``.

    ``shuffle_seed`` (int) randomises the free queue's initial order, so physical ids are
    handed out shuffled (seed §03); ``None`` hands out 0, 1, 2, ...
    ``reserve_null``: block 0 is the *null block* (``null_block``), never queued nor handed
    out: the placeholder a sliding-window table keeps for a freed block (its storage stays
    zero, so a kernel's read of it stays in range). The pool never touches nor releases it;
    the manager keeps it out of every touch / release.
    Raises ``ConfigError`` if ``num_blocks < 1`` (``< 2`` with ``reserve_null``).
    """

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None, reserve_null: bool = False) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1 + reserve_null:
            raise ConfigError(f"num_blocks must be an integer >= {1 + reserve_null}, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = self.blocks[0] if reserve_null else None
        order = self.blocks[1:] if reserve_null else list(self.blocks)
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(order)
        self.free_queue = FreeBlockQueue(order)
        self.cached: dict[bytes, KVCacheBlock] = {}
        # told of every publish, eviction (before the hash goes) and reset: the tiers and
        # KV events (``pagedkv.kv.tiers.KVTiers``); None: nobody listens
        self.listener: Any = None
        self.num_evictions = 0
        self.num_allocated = 0
        # blocks with ref_cnt > 1, kept as references change (a per-step count over every
        # block cost 0.17 ms of a 20 ms batch-1 decode step at ~1,500 blocks)
        self.num_shared = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be handed out (``num_blocks``, less the null block)."""
        return self.num_blocks - (self.null_block is not None)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the free queue (ref_cnt 0 -> 1), evicting any
        cached hash they carry. All or nothing: raises ``NoFreeBlocksError`` taking none."""
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"need {n} free blocks, have {len(self.free_queue)}")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        self.num_allocated += n
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit or a fork); a free cached
        block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            elif block.ref_cnt == 1:
                self.num_shared += 1
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order; a block reaching 0 is
        appended to the free queue (so pass a table reversed: its tail is evicted first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
            elif block.ref_cnt == 1:
                self.num_shared -= 1
            elif block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} ref_cnt went negative")

    # ---- prefix cache map -------------------------------------------------------------
    def publish(self, block: KVCacheBlock, block_hash: bytes, parent_hash: bytes | None,
                token_bytes: bytes, extra_bytes: bytes) -> bool:
        """Register a full, written block under ``block_hash``. Returns False (and leaves the
        block unpublished) if it already carries a hash or another block holds this hash."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_bytes = token_bytes
        block.extra_bytes = extra_bytes
        self.cached[block_hash] = block
        if self.listener is not None:
            self.listener.on_publish(block)
        return True

    def lookup(self, block_hash: bytes, parent_hash: bytes | None, token_bytes: bytes,
               extra_bytes: bytes) -> KVCacheBlock | None:
        """The cached block for ``block_hash`` if it really holds these tokens after this
        parent with these extra keys (a hash collision is a miss, never wrong K/V)."""
        block = self.cached.get(block_hash)
        if (block is None or block.token_bytes != token_bytes
                or block.parent_hash != parent_hash or block.extra_bytes != extra_bytes):
            return None
        return block

    def _evict(self, block: KVCacheBlock) -> None:
        if self.listener is not None:
            self.listener.on_evict(block)
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = block.parent_hash = block.token_bytes = block.extra_bytes = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> int:
        """Unpublish every cached block (their K/V stay where they are). Returns how many."""
        n = len(self.cached)
        if self.listener is not None:
            self.listener.on_clear()
        for block in self.cached.values():
            block.block_hash = block.parent_hash = block.token_bytes = block.extra_bytes = None
        self.cached.clear()
        return n
