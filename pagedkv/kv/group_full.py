"""The KV group manager of full-attention layers (seed §02-§03), and the contract every KV
group type follows.

A *KV group* (``pagedkv.kv.groups``: layers of one attention kind) keeps one ``BlockTable``
per request; every group draws its block ids from the one ``BlockPool`` the coordinator
(``KVCacheManager``) shares with it. The group sizes, validates and applies its part of an
allocation, copy-on-write, fork, free and trim, and looks up / publishes its own prefix-hash
chain. It never releases a reference itself: what it drops is returned to the coordinator,
which passes it to the step fences. A new group type subclasses this class in one file and
is named in ``pagedkv.kv.groups.GROUP_TYPES``; it overrides what differs (for a sliding
window: ``first_live_block``, ``blocks_held``, ``slide``, ``needs_whole_prefix``).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any, Sequence

from pagedkv.errors import InvalidRequestError, NoFreeBlocksError
from pagedkv.kv.block_pool import BlockPool, KVCacheBlock
from pagedkv.kv.block_table import BlockTable, blocks_needed
from pagedkv.kv.copy_on_write import copy_on_write, cow_indices
from pagedkv.kv.prefix_cache import NO_KEYS, CacheKeys, HashFn, iter_block_hashes
from pagedkv.kv.tiers.index import TierHit


@lru_cache(maxsize=1024)
def _tagged_keys(keys: CacheKeys, tag: str) -> CacheKeys:
    return replace(keys, kv_group=tag)


class FullAttentionGroup:
    """Block tables of group ``index`` (full attention: every block of a request stays live).

    ``window``: the group's sliding window in tokens (``None`` here); ``block_size`` tokens
    per block; ``pool``: the shared ``BlockPool`` (its ``null_block`` is the placeholder of a
    window group's dropped blocks); ``tiers``: the ``KVTiers`` prefix hits may come from, or
    ``None``. ``tables``: the live block tables by request id (read by the coordinator; only
    this group changes them)."""

    #: the registry name (``pagedkv.kv.groups.GROUP_TYPES``)
    kind = "full"
    #: a prefix hit needs every block before the hit point cached (False: only those in the window)
    needs_whole_prefix = True

    def __init__(self, index: int, window: int | None, block_size: int, pool: BlockPool, tiers: Any = None) -> None:
        self.index = index
        self.window = window
        self.block_size = block_size
        self.pool = pool
        self.tiers = tiers
        #: hash-chain tag: group 0 keeps the plain chain, group g > 0 its own
        self.tag = None if index == 0 else f"group={index},window={window}"
        self.tables: dict[str, BlockTable] = {}

    # ------------------------------------------------------------------ sizing
    def first_live_block(self, num_computed: int) -> int:
        """First logical block a step computing from position ``num_computed`` reads (0)."""
        return 0

    def blocks_held(self, num_tokens: int, chunk: int | None = None) -> int:
        """Blocks a request of ``num_tokens`` tokens holds in this group (``blocks_needed``
        with the group's window; ``chunk``: tokens per step, the most held at any step)."""
        return blocks_needed(num_tokens, self.block_size, self.window, chunk)

    # ------------------------------------------------------------------ allocation
    def check_hits(self, req_id: str, hits: Sequence[KVCacheBlock]) -> int:
        """Raise ``InvalidRequestError`` if a hit was evicted since the lookup; returns how
        many hits are free cached blocks (they leave the free queue)."""
        cached, null = self.pool.cached, self.pool.null_block
        revived = 0
        for b in hits:
            if b is null:
                continue
            if (not self.tiers.holds(b) if isinstance(b, TierHit)
                    else b.block_hash is None or cached.get(b.block_hash) is not b):
                raise InvalidRequestError(
                    f"{req_id}: prefix hit on block {b.block_id} is stale (evicted since "
                    "get_computed_blocks); look it up again"
                )
            if b.ref_cnt == 0:
                revived += 1
        return revived

    def plan(self, req_id: str, num_new_tokens: int, num_computed_tokens: int,
             hits: Sequence[KVCacheBlock], reserve_blocks: int) -> tuple[BlockTable | None, int, list[int], int]:
        """Validate and size this group's part of an allocation without changing anything:
        ``(table or None, fresh blocks to append, logical indices needing copy-on-write,
        free cached hits revived)``. ``reserve_blocks``: the least a table holds (a
        contiguous reservation; 0 when paged). Raises ``InvalidRequestError``."""
        bs = self.block_size
        total = num_computed_tokens + num_new_tokens
        table = self.tables.get(req_id)
        n_table = len(table.blocks) if table is not None else 0
        revived = 0
        if hits:
            if n_table:
                raise InvalidRequestError(f"{req_id}: new_computed_blocks given for a request that has blocks")
            if num_computed_tokens != len(hits) * bs:
                raise InvalidRequestError(
                    f"{req_id}: num_computed_tokens {num_computed_tokens} != {len(hits)} hit blocks x {bs}")
            revived = self.check_hits(req_id, hits)
            n_have = len(hits)
        else:
            if num_computed_tokens > n_table * bs:
                raise InvalidRequestError(
                    f"{req_id}: {num_computed_tokens} computed tokens but only {n_table * bs} slots")
            n_have = n_table
        n_need = max(blocks_needed(total, bs), reserve_blocks)  # logical entries (placeholders too)
        n_fresh = n_need - n_have if n_need > n_have else 0
        cow = cow_indices(table, num_computed_tokens, total) if n_table and num_new_tokens else []
        return table, n_fresh, cow, revived

    def append_in_place(self, req_id: str, num_new_tokens: int, num_computed_tokens: int, paged: bool) -> bool:
        """The decode fast path of a request with a table: True when positions
        ``num_computed_tokens .. +num_new_tokens-1`` were given slots without a plan, because
        they land in one existing private, unpublished block, or (``paged``) start a new
        logical block (nothing existing is written: no copy-on-write, just append). False:
        nothing changed, take the general path. Raises ``NoFreeBlocksError`` (nothing taken)."""
        table = self.tables.get(req_id)
        if table is None:
            return False
        bs = self.block_size
        total = num_computed_tokens + num_new_tokens
        first = num_computed_tokens // bs
        n_table = len(table.blocks)
        if first == (total - 1) // bs and first < n_table:
            b = table.blocks[first]
            if b.ref_cnt != 1 or b.block_hash is not None:
                return False
            if total > table.num_tokens:
                table.num_tokens = total
            return True
        if num_computed_tokens != n_table * bs or not paged:
            return False
        n_fresh = blocks_needed(total, bs) - n_table
        if n_fresh > self.pool.num_free:
            raise NoFreeBlocksError(f"{req_id}: needs {n_fresh} new blocks, {self.pool.num_free} free")
        table.append(self.pool.allocate(n_fresh))
        table.num_tokens = total
        return True

    def open_table(self, req_id: str, hits: Sequence[KVCacheBlock]) -> BlockTable:
        """The request's table, created (starting with its prefix hits: references taken,
        tier hits loaded into fresh blocks) when it has none."""
        table = self.tables.get(req_id)
        if table is not None:
            return table
        table = self.tables[req_id] = BlockTable(self.block_size)
        if not hits:
            return table
        null = self.pool.null_block
        lead = 0
        while lead < len(hits) and hits[lead] is null:
            lead += 1
        live = hits[lead:]
        if self.tiers is not None:  # tier hits get fresh blocks and a load
            live = self.tiers.place_hits(self.pool, live)
        else:
            self.pool.touch(live)
        table.append(list(hits[:lead]) + list(live))
        table.num_null = lead
        table.num_hashed = len(hits)
        table.last_hash = live[-1].block_hash
        return table

    def copy_on_write(self, table: BlockTable, cow: list[int],
                      num_computed_tokens: int) -> tuple[list[tuple[int, int]], list[KVCacheBlock]]:
        """Private copies of entries ``cow`` of ``table`` (``pagedkv.kv.copy_on_write``):
        ``(copies, dropped)``; the caller drops the replaced blocks."""
        return copy_on_write(self.pool, table, cow, num_computed_tokens)

    def extend(self, table: BlockTable, n_fresh: int, total: int) -> None:
        """Append ``n_fresh`` blocks to ``table`` and cover ``total`` tokens."""
        if n_fresh:
            table.append(self.pool.allocate(n_fresh))
        if total > table.num_tokens:
            table.num_tokens = total

    def slide(self, req_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Blocks before the window of a step computing from ``num_computed_tokens``,
        replaced by the null block; returns them in logical order (none for full attention)."""
        return []

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` shares every entry of ``parent_id``'s table (references taken)."""
        parent = self.tables[parent_id]
        self.pool.touch(parent.live_blocks)
        child = BlockTable(self.block_size, parent.blocks, parent.num_tokens)
        child.num_hashed, child.last_hash = parent.num_hashed, parent.last_hash
        child.num_null = parent.num_null
        self.tables[child_id] = child

    def pop(self, req_id: str) -> list[KVCacheBlock]:
        """Remove the request's table; returns its real blocks tail first ([] if none)."""
        table = self.tables.pop(req_id, None)
        return table.live_blocks[::-1] if table is not None else []

    def trim(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Shrink the request's table to ``num_tokens`` positions; returns the removed real
        blocks tail first. Raises ``InvalidRequestError`` for an unknown request or a
        length beyond its slots."""
        table = self.tables.get(req_id)
        if table is None or not 0 <= num_tokens <= table.num_tokens:
            raise InvalidRequestError(f"trim: {req_id!r} has no {num_tokens} token slots")
        gone = table.truncate(max(blocks_needed(num_tokens, self.block_size), table.num_null))[::-1]
        table.num_tokens = num_tokens
        return gone

    # ------------------------------------------------------------------ prefix cache
    def keys(self, cache_keys: CacheKeys | None) -> CacheKeys:
        """The request's cache keys, tagged with this group's chain (group 0: untagged)."""
        cache_keys = cache_keys or NO_KEYS
        return cache_keys if self.tag is None else _tagged_keys(cache_keys, self.tag)

    def lookup(self, token_ids: Sequence[int], cache_keys: CacheKeys | None, limit: int,
               hash_fn: HashFn, tiers: Any) -> list[KVCacheBlock | None]:
        """Cached blocks ``0 .. limit-1`` of ``token_ids`` in this group's chain (pool, then
        ``tiers`` if given); ``None`` for a miss, and a group that ``needs_whole_prefix``
        stops at its first miss."""
        blocks: list[KVCacheBlock | None] = []
        if not limit:
            return blocks
        lookup = self.pool.lookup
        for h, parent, tb, extra in iter_block_hashes(
            token_ids, self.block_size, self.keys(cache_keys), hash_fn=hash_fn, end_block=limit
        ):
            block = lookup(h, parent, tb, extra)
            if block is None and tiers is not None:  # pool -> host -> disk
                block = tiers.lookup(h, parent, tb, extra)
            if block is None and self.needs_whole_prefix:
                break
            blocks.append(block)
        return blocks

    def publish(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                cache_keys: CacheKeys | None, hash_fn: HashFn) -> int:
        """Publish the request's blocks wholly written (the first ``num_computed_tokens //
        block_size``), each hashed once; placeholders are skipped. Returns how many blocks
        were newly published."""
        bs = self.block_size
        table = self.tables.get(req_id)
        if table is None or num_computed_tokens // bs <= table.num_hashed:
            return 0
        n_full = min(num_computed_tokens, len(token_ids), table.num_tokens) // bs
        done = table.num_hashed
        if n_full <= done:
            return 0
        published = 0
        i = done
        for h, parent, tb, extra in iter_block_hashes(
            token_ids, bs, self.keys(cache_keys), table.last_hash, done, hash_fn, n_full
        ):
            block = table.blocks[i]
            if (i >= table.num_null and block.block_hash is None
                    and self.pool.publish(block, h, parent, tb, extra)):
                published += 1
            table.last_hash = h
            i += 1
        table.num_hashed = n_full
        return published
