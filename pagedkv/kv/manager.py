"""KVCacheManager: the memory system's one entry point for the engine (seed §02-§04).

It owns the block pool, one block table per request, copy-on-write for forked requests,
prefix-cache lookup/publish, and step fences. Unit of every count is *tokens* unless the
name says blocks; block ids are physical indices into the device cache.

Step fences (seed §04). ``begin_step(req_ids)`` records which requests a step reads and
writes; until ``end_step`` confirms the device is done with that step, ``free`` (finish,
abort, preemption) and copy-on-write only *hold* the dropped references, so those blocks
cannot be handed to another request whose writes could land in them mid-step. A held
reference counts in ``ref_cnt`` exactly like a table's, so the invariants stay simple.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from pagedkv.errors import ConfigError, InvalidRequestError, NoFreeBlocksError
from pagedkv.kv.block_pool import BlockPool, KVCacheBlock
from pagedkv.kv.block_table import BlockTable
from pagedkv.kv.invariants import check_invariants
from pagedkv.kv.prefix_cache import NO_KEYS, CacheKeys, HashFn, iter_block_hashes, sha256_block_hash
from pagedkv.kv.snapshot import manager_snapshot
from pagedkv.kv.tiers.index import TierHit
from pagedkv.utils import cdiv


@dataclass
class KVCacheStats:
    """Counters since the manager was created (tokens unless named blocks).

    ``prefix_queries``/``prefix_hits``: prompt tokens looked up / served from the cache,
    counted once per admission (when ``allocate_slots`` creates the request's table after a
    ``get_computed_blocks``). ``cow_copies``: (src, dst) block copies returned.
    ``evictions``: cached free blocks whose hash was dropped for reuse. ``allocated_blocks``:
    blocks taken from the free queue. ``deferred_frees``: frees/CoW drops held by a fence.
    """

    prefix_queries: int = 0
    prefix_hits: int = 0
    cow_copies: int = 0
    evictions: int = 0
    allocated_blocks: int = 0
    deferred_frees: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate}


class _Hold:
    """References kept alive by a step fence until every step in ``waiting`` has ended."""

    __slots__ = ("key", "req_id", "blocks", "waiting")

    def __init__(self, key: int, req_id: str, blocks: list[KVCacheBlock], waiting: set[int]) -> None:
        self.key = key
        self.req_id = req_id
        self.blocks = blocks
        self.waiting = waiting


class KVCacheManager:
    """Paged KV bookkeeping for ``num_blocks`` blocks of ``block_size`` tokens.

    ``enable_prefix_caching``: look up / publish full blocks by chained hash.
    ``enable_paging=False``: contiguous max reservation; a request's first allocation
    reserves ``ceil(max_model_len / block_size)`` blocks (``max_model_len`` then required).
    ``max_model_len``: tokens a request may reach (``None``: unchecked).
    ``shuffle_seed``: shuffle the free queue's initial order (physical ids, seed §03).
    ``hash_fn``: the block hash (default sha256; tests inject a colliding one).
    ``tiers``: a ``pagedkv.kv.tiers.KVTiers`` (host/disk tiers behind the pool and KV
    events): evicted cached blocks go there and lookups continue there.

    Raises ``ConfigError`` on a bad value (the message names the field).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        enable_paging: bool = True,
        max_model_len: int | None = None,
        shuffle_seed: int | None = None,
        hash_fn: HashFn = sha256_block_hash,
        tiers: Any = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
            raise ConfigError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if not enable_paging and max_model_len is None:
            raise ConfigError("max_model_len is required when enable_paging=False (it sets the reservation)")
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.enable_paging = bool(enable_paging)
        self.max_model_len = max_model_len
        self.hash_fn = hash_fn
        self.pool = BlockPool(num_blocks, shuffle_seed)
        self.tiers = tiers
        self.pool.listener = tiers
        self.num_blocks = num_blocks
        self._reserve_blocks = cdiv(max_model_len, block_size) if max_model_len else 0
        self._tables: dict[str, BlockTable] = {}
        self._stats = KVCacheStats()
        self._pending_query: dict[str, tuple[int, int]] = {}
        # step fences
        self._step_ids = itertools.count(1)
        self._last_step = 0
        self._open_steps: dict[int, set[str]] = {}
        self._step_holds: dict[int, list[_Hold]] = {}
        self._holds: dict[int, _Hold] = {}
        self._hold_ids = itertools.count()

    # ------------------------------------------------------------------ read-only state
    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-but-free blocks included; fence-held excluded)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ``ref_cnt > 0`` (held by a table or a step fence)."""
        return self.num_blocks - self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def stats(self) -> KVCacheStats:
        s = self._stats
        s.evictions = self.pool.num_evictions
        s.allocated_blocks = self.pool.num_allocated
        return s

    @property
    def tables(self) -> dict[str, BlockTable]:
        """Live block tables by request id (do not mutate)."""
        return self._tables

    @property
    def holds(self) -> list[tuple[str, list[KVCacheBlock], set[int]]]:
        """Fence holds: ``(req_id, blocks, steps still open)`` (do not mutate)."""
        return [(h.req_id, h.blocks, h.waiting) for h in self._holds.values()]

    @property
    def open_steps(self) -> dict[int, set[str]]:
        return self._open_steps

    def has_request(self, req_id: str) -> bool:
        return req_id in self._tables

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table: physical ids in logical order ([] if unknown)."""
        table = self._tables.get(req_id)
        return list(table._ids) if table is not None else []

    def get_block_table(self, req_id: str) -> BlockTable:
        """The request's ``BlockTable``. Raises ``InvalidRequestError`` if unknown."""
        table = self._tables.get(req_id)
        if table is None:
            raise InvalidRequestError(f"unknown request {req_id!r}")
        return table

    def num_tokens(self, req_id: str) -> int:
        """Token positions the request has slots for (0 if unknown)."""
        table = self._tables.get(req_id)
        return table.num_tokens if table is not None else 0

    def slot_mapping(self, req_id: str, start: int, end: int):
        """Slots (int64 numpy ``[end-start]``) of positions ``start..end-1`` of a request."""
        return self.get_block_table(req_id).slot_mapping(start, end)

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(
        self, req_id: str, token_ids: Sequence[int], cache_keys: CacheKeys | None = None
    ) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``token_ids`` in whole blocks, never the whole prompt
        (at least the last token is left to compute). Pure: no ``ref_cnt`` changes; pass
        the blocks to ``allocate_slots(new_computed_blocks=...)`` before anything else
        allocates. Returns ``(blocks, num_cached_tokens)``; ``([], 0)`` when disabled. With
        tiers, a block found in a tier is a ``TierHit`` (loaded into a fresh pool block at
        admission)."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        n = len(token_ids)
        max_blocks = max(0, (n - 1) // bs)
        hits: list[KVCacheBlock] = []
        if max_blocks:
            lookup = self.pool.lookup
            tiers = self.tiers if self.tiers is not None and self.tiers.indexes else None
            for h, parent, tb, extra in iter_block_hashes(
                token_ids, bs, cache_keys or NO_KEYS, hash_fn=self.hash_fn, end_block=max_blocks
            ):
                block = lookup(h, parent, tb, extra)
                if block is None and tiers is not None:  # pool -> host -> disk
                    block = tiers.lookup(h, parent, tb, extra)
                if block is None:
                    break
                hits.append(block)
        self._pending_query[req_id] = (n, len(hits) * bs)
        return hits, len(hits) * bs

    def cache_blocks(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_keys: CacheKeys | None = None,
    ) -> int:
        """Publish the request's full blocks whose every slot is written (the first
        ``num_computed_tokens // block_size`` blocks; ``token_ids`` are the request's tokens
        from position 0). Incremental: each block is hashed once. Returns how many blocks
        were newly published (0 when disabled or the request is unknown)."""
        if not self.enable_prefix_caching:
            return 0
        table = self._tables.get(req_id)
        if table is None or num_computed_tokens // self.block_size <= table.num_hashed:
            return 0
        bs = self.block_size
        n_full = min(num_computed_tokens, len(token_ids), table.num_tokens) // bs
        done = table.num_hashed
        if n_full <= done:
            return 0
        published = 0
        i = done
        for h, parent, tb, extra in iter_block_hashes(
            token_ids, bs, cache_keys or NO_KEYS, table.last_hash, done, self.hash_fn, n_full
        ):
            block = table.blocks[i]
            if block.block_hash is None and self.pool.publish(block, h, parent, tb, extra):
                published += 1
            table.last_hash = h
            i += 1
        table.num_hashed = n_full
        return published

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (K/V stay; nothing is freed), in the tiers too.
        Returns how many pool blocks were cached."""
        return self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ tiers
    def take_transfer(self) -> Any:
        """The K/V moves between pool and tiers decided since the last call (a
        ``KVTransfer`` the runner executes before the step's forward), or ``None``."""
        return self.tiers.take_transfer() if self.tiers is not None else None

    def persist(self) -> Any:
        """Before a shutdown: copy every cached block (pool and host) to the disk tier.
        Returns the ``KVTransfer`` to execute (``None`` without tiers)."""
        return self.tiers.persist(self.pool) if self.tiers is not None else None

    def tier_stats(self) -> dict[str, Any]:
        """Per tier blocks / hits / stores and bytes moved (``{}`` without tiers)."""
        return self.tiers.stats() if self.tiers is not None and self.tiers.indexes else {}

    # ------------------------------------------------------------------ allocation
    def _plan(
        self, req_id: str, num_new_tokens: int, num_computed_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> tuple[BlockTable | None, int, list[int]]:
        """Validate and size an allocation without changing anything. Returns (table,
        fresh blocks to append, logical indices needing copy-on-write); raises
        ``NoFreeBlocksError`` if the pool cannot cover it."""
        if num_new_tokens < 0 or num_computed_tokens < 0:
            raise InvalidRequestError(
                f"{req_id}: num_new_tokens ({num_new_tokens}) and num_computed_tokens "
                f"({num_computed_tokens}) must be >= 0"
            )
        bs = self.block_size
        total = num_computed_tokens + num_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise InvalidRequestError(f"{req_id}: {total} tokens exceed max_model_len {self.max_model_len}")
        table = self._tables.get(req_id)
        n_table = len(table.blocks) if table is not None else 0
        revived = 0
        if new_computed_blocks:
            if n_table:
                raise InvalidRequestError(f"{req_id}: new_computed_blocks given for a request that has blocks")
            if num_computed_tokens != len(new_computed_blocks) * bs:
                raise InvalidRequestError(
                    f"{req_id}: num_computed_tokens {num_computed_tokens} != "
                    f"{len(new_computed_blocks)} hit blocks x {bs}"
                )
            cached = self.pool.cached
            for b in new_computed_blocks:
                if (not self.tiers.holds(b) if isinstance(b, TierHit)
                        else b.block_hash is None or cached.get(b.block_hash) is not b):
                    raise InvalidRequestError(
                        f"{req_id}: prefix hit on block {b.block_id} is stale (evicted since "
                        "get_computed_blocks); look it up again"
                    )
                if b.ref_cnt == 0:
                    revived += 1
            n_have = len(new_computed_blocks)
        else:
            if num_computed_tokens > n_table * bs:
                raise InvalidRequestError(
                    f"{req_id}: {num_computed_tokens} computed tokens but only {n_table * bs} slots"
                )
            n_have = n_table
        n_need = cdiv(total, bs)
        if not self.enable_paging and n_need < self._reserve_blocks:
            n_need = self._reserve_blocks
        n_fresh = n_need - n_have if n_need > n_have else 0
        cow: list[int] = []
        if n_table and num_new_tokens:
            blocks = table.blocks
            for i in range(num_computed_tokens // bs, min(n_table, cdiv(total, bs))):
                b = blocks[i]
                if b.ref_cnt > 1 or b.block_hash is not None:
                    cow.append(i)
        need = n_fresh + len(cow)
        if need + revived > self.pool.num_free:
            raise NoFreeBlocksError(
                f"{req_id}: needs {need} new blocks (+{revived} cached revived), "
                f"{self.pool.num_free} free"
            )
        return table, n_fresh, cow

    def can_allocate(
        self, req_id: str, num_new_tokens: int, num_computed_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> bool:
        """Whether ``allocate_slots`` with these arguments would succeed now (no change)."""
        try:
            self._plan(req_id, num_new_tokens, num_computed_tokens, new_computed_blocks)
        except NoFreeBlocksError:
            return False
        return True

    def allocate_slots(
        self, req_id: str, num_new_tokens: int, num_computed_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[tuple[int, int]]:
        """Give ``req_id`` slots for positions ``num_computed_tokens .. +num_new_tokens-1``.

        A new request first takes references on its prefix hits ``new_computed_blocks``
        (then ``num_computed_tokens`` must equal their tokens). A block gets appended
        exactly when a position enters a new logical block (or, without paging, the whole
        reservation at once). Before the first write into a block that is shared (forked)
        or published, the request gets a fresh block; the returned ``[(src, dst), ...]``
        are the block copies the runner must apply before this step's writes (a block none
        of whose slots were written yet is just replaced, no copy).

        All or nothing: raises ``NoFreeBlocksError`` with the state unchanged; raises
        ``InvalidRequestError`` on inconsistent arguments or a stale prefix hit.
        """
        table = self._tables.get(req_id)
        if table is not None and not new_computed_blocks and num_new_tokens > 0 and num_computed_tokens >= 0:
            # Fast path (decode): the new tokens land in one existing, private, unpublished block.
            bs = self.block_size
            total = num_computed_tokens + num_new_tokens
            first = num_computed_tokens // bs
            n_table = len(table.blocks)
            if self.max_model_len is None or total <= self.max_model_len:
                if first == (total - 1) // bs and first < n_table:
                    b = table.blocks[first]
                    if b.ref_cnt == 1 and b.block_hash is None:
                        if total > table.num_tokens:
                            table.num_tokens = total
                        return []
                elif num_computed_tokens == n_table * bs and self.enable_paging:
                    # The writes start in a new logical block: nothing existing is written,
                    # so no copy-on-write; just append the blocks they need.
                    n_fresh = cdiv(total, bs) - n_table
                    if n_fresh > self.pool.num_free:
                        raise NoFreeBlocksError(
                            f"{req_id}: needs {n_fresh} new blocks, {self.pool.num_free} free")
                    table.append(self.pool.allocate(n_fresh))
                    table.num_tokens = total
                    return []
        table, n_fresh, cow = self._plan(req_id, num_new_tokens, num_computed_tokens, new_computed_blocks)
        pool = self.pool
        if table is None:
            table = self._tables[req_id] = BlockTable(self.block_size)
            q = self._pending_query.pop(req_id, None)
            if q is not None:
                self._stats.prefix_queries += q[0]
                self._stats.prefix_hits += q[1]
        if new_computed_blocks:
            if self.tiers is not None:  # tier hits get fresh blocks and a load
                new_computed_blocks = self.tiers.place_hits(pool, new_computed_blocks)
            else:
                pool.touch(new_computed_blocks)
            table.append(new_computed_blocks)
            table.num_hashed = len(new_computed_blocks)
            table.last_hash = new_computed_blocks[-1].block_hash
        copies: list[tuple[int, int]] = []
        if cow:
            bs = self.block_size
            dropped = []
            for i, dst in zip(cow, pool.allocate(len(cow))):
                src = table.replace(i, dst)
                dropped.append(src)
                if i * bs < num_computed_tokens:
                    copies.append((src.block_id, dst.block_id))
            self._drop(req_id, dropped)
            self._stats.cow_copies += len(copies)
        if n_fresh:
            table.append(pool.allocate(n_fresh))
        total = num_computed_tokens + num_new_tokens
        if total > table.num_tokens:
            table.num_tokens = total
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` shares every block of ``parent_id`` (``ref_cnt += 1`` each); the first
        write into a shared, partly filled block is copied (see ``allocate_slots``).
        Raises ``InvalidRequestError`` if the parent is unknown or the child exists."""
        parent = self._tables.get(parent_id)
        if parent is None:
            raise InvalidRequestError(f"fork: unknown parent request {parent_id!r}")
        if child_id in self._tables:
            raise InvalidRequestError(f"fork: request {child_id!r} already has blocks")
        self.pool.touch(parent.blocks)
        child = BlockTable(self.block_size, parent.blocks, parent.num_tokens)
        child.num_hashed, child.last_hash = parent.num_hashed, parent.last_hash
        self._tables[child_id] = child

    # ------------------------------------------------------------------ free + fences
    def free(self, req_id: str) -> None:
        """Release the request's blocks (finish, abort or preemption), tail first, so its
        last blocks are the first evicted. While a step that used the request is open, the
        references are held until that step's ``end_step``. Idempotent: an unknown or
        already freed request is a no-op."""
        self._pending_query.pop(req_id, None)
        table = self._tables.pop(req_id, None)
        if table is None:
            return
        self._drop(req_id, table.blocks[::-1])

    def _drop(self, req_id: str, blocks: list[KVCacheBlock]) -> None:
        # Open steps are few (1-2 in flight), so scanning them is cheaper than keeping a
        # per-request index up to date on every begin/end_step.
        steps = {sid for sid, rids in self._open_steps.items() if req_id in rids}
        if not steps:
            self.pool.release(blocks)
            return
        hold = _Hold(next(self._hold_ids), req_id, blocks, steps)
        self._holds[hold.key] = hold
        for s in steps:
            self._step_holds.setdefault(s, []).append(hold)
        self._stats.deferred_frees += 1

    def begin_step(self, req_ids: Iterable[str]) -> int:
        """Open a step fence over the requests whose blocks the step reads or writes.
        Returns its step id (increasing ints)."""
        sid = next(self._step_ids)
        self._last_step = sid
        self._open_steps[sid] = set(req_ids)
        return sid

    def end_step(self, step_id: int) -> None:
        """Confirm the device finished ``step_id``: references held for it are released.
        Ending a step twice is a no-op; an id never returned by ``begin_step`` raises
        ``InvalidRequestError``."""
        if self._open_steps.pop(step_id, None) is None:
            if isinstance(step_id, int) and 0 < step_id <= self._last_step:
                return
            raise InvalidRequestError(f"end_step: unknown step id {step_id!r}")
        for hold in self._step_holds.pop(step_id, ()):
            hold.waiting.discard(step_id)
            if not hold.waiting:
                del self._holds[hold.key]
                self.pool.release(hold.blocks)
        if self.tiers is not None:
            self.tiers.end_step()  # this step's KV events, one batch

    # ------------------------------------------------------------------ introspection
    def snapshot(self) -> dict[str, Any]:
        """Every block and table, JSON-able, for a live UI (see ``pagedkv.kv.snapshot``)."""
        return manager_snapshot(self)

    def check_invariants(self) -> None:
        """Run ``pagedkv.kv.invariants.check_invariants`` on this manager."""
        check_invariants(self)
