"""KVCacheManager: the memory system's one entry point for the engine (seed §02-§04).

It owns the block pool, one block table per request *per layer group*, copy-on-write for
forked requests, prefix-cache lookup/publish, and step fences. Unit of every count is
*tokens* unless the name says blocks; block ids are physical indices into the device cache.

Layer groups (``pagedkv.kv.groups``): layers of one attention kind (full, or a sliding
window of ``W`` tokens) share block tables; every group has its own table per request, all
drawing from one pool. A window group's blocks wholly before its window are replaced by the
null block (id 0) and freed when the request's next allocation starts past them. Without
``layer_windows`` there is one full group and everything is as before (block 0 is a block
like any other). The single-group accessors (``get_block_ids``, ``tables``, ...) read group
0; ``get_group_block_ids`` / ``group_tables`` read every group.

Step fences (seed §04, ``pagedkv.kv.fences``). ``begin_step(req_ids)`` records which requests
a step reads and writes; until ``end_step`` confirms the device is done with that step,
``free`` (finish, abort, preemption), copy-on-write and a sliding window only *hold* the
dropped references, so those blocks cannot be handed to another request whose writes could
land in them mid-step. A held reference counts in ``ref_cnt`` exactly like a table's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from pagedkv.errors import ConfigError, InvalidRequestError, NoFreeBlocksError
from pagedkv.kv.block_pool import BlockPool, KVCacheBlock
from pagedkv.kv.block_table import BlockTable, blocks_needed
from pagedkv.kv.fences import StepFences
from pagedkv.kv.groups import LayerGroups
from pagedkv.kv.invariants import check_invariants
from pagedkv.kv.prefix_cache import HashFn, sha256_block_hash
from pagedkv.kv.prefix_lookup import PrefixLookup
from pagedkv.kv.snapshot import manager_snapshot
from pagedkv.kv.tiers.index import TierHit


@dataclass
class KVCacheStats:
    """Counters since the manager was created (tokens unless named blocks).

    ``prefix_queries``/``prefix_hits``: prompt tokens looked up / served from the cache,
    counted once per recorded admission (when ``allocate_slots`` creates the request's table
    after a ``get_computed_blocks(record=True)``; the scheduler records a request's first
    admission only, so a preempted request's recompute is not counted and ``prefix_hits``
    equals the sum of the requests' ``num_cached_tokens``). ``cow_copies``: (src, dst) block copies returned.
    ``evictions``: cached free blocks whose hash was dropped for reuse. ``allocated_blocks``:
    blocks taken from the free queue. ``deferred_frees``: frees/CoW drops held by a fence.
    ``window_freed_blocks``: blocks a sliding window moved past (dropped from a table).
    """

    prefix_queries: int = 0
    prefix_hits: int = 0
    cow_copies: int = 0
    evictions: int = 0
    allocated_blocks: int = 0
    deferred_frees: int = 0
    window_freed_blocks: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate}


class KVCacheManager(PrefixLookup, StepFences):
    """Paged KV bookkeeping for ``num_blocks`` blocks of ``block_size`` tokens.

    ``enable_prefix_caching``: look up / publish full blocks by chained hash.
    ``enable_paging=False``: contiguous max reservation; a request's first allocation
    reserves ``ceil(max_model_len / block_size)`` blocks (``max_model_len`` then required).
    ``max_model_len``: tokens a request may reach (``None``: unchecked).
    ``shuffle_seed``: shuffle the free queue's initial order (physical ids, seed §03).
    ``hash_fn``: the block hash (default sha256; tests inject a colliding one).
    ``tiers``: a ``pagedkv.kv.tiers.KVTiers`` (host/disk tiers behind the pool and KV
    events): evicted cached blocks go there and lookups continue there (all-full models
    only). ``layer_windows``: one entry per layer, ``None`` = full attention, an int = a
    sliding window in tokens (``None``: one full group); with a window, block 0 is the
    reserved null block.

    Raises ``ConfigError`` on a bad value (the message names the field), or for KV tiers or
    ``enable_paging=False`` with a sliding window (not supported).
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
        layer_windows: Sequence[int | None] | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
            raise ConfigError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if not enable_paging and max_model_len is None:
            raise ConfigError("max_model_len is required when enable_paging=False (it sets the reservation)")
        self.groups = groups = LayerGroups.from_layer_windows(layer_windows)
        self._windowed = groups.is_hybrid
        self._single = groups.num_groups == 1
        if self._windowed and tiers is not None:
            raise ConfigError("kv tiers / KV events: not supported with sliding-window layers "
                              "(the tiers move whole blocks of every layer; a hybrid cache's "
                              "groups hold different layers)")
        if self._windowed and not enable_paging:
            raise ConfigError("enable_paging=False: not supported with sliding-window layers")
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.enable_paging = bool(enable_paging)
        self.max_model_len = max_model_len
        self.hash_fn = hash_fn
        self.pool = BlockPool(num_blocks, shuffle_seed, reserve_null=self._windowed)
        self.null_block = self.pool.null_block
        self.tiers = tiers
        self.pool.listener = tiers
        self.num_blocks = num_blocks
        self._reserve_blocks = blocks_needed(max_model_len, block_size) if max_model_len else 0
        self._gtables: list[dict[str, BlockTable]] = [{} for _ in groups.windows]
        self._tables = self._gtables[0]
        self._gtags = [None] + [f"group={g},window={w}" for g, w in enumerate(groups.windows)][1:]
        self._stats = KVCacheStats()
        self._pending_query: dict[str, tuple[int, int]] = {}
        self._init_fences()

    # ------------------------------------------------------------------ read-only state
    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-but-free blocks included; fence-held excluded)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ``ref_cnt > 0`` (held by a table or a step fence)."""
        return self.pool.num_usable - self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (the null block excluded) in use, in [0, 1]."""
        return self.num_used_blocks / self.pool.num_usable

    @property
    def num_groups(self) -> int:
        """Layer groups (1 for a model without sliding-window layers)."""
        return self.groups.num_groups

    @property
    def stats(self) -> KVCacheStats:
        s = self._stats
        s.evictions = self.pool.num_evictions
        s.allocated_blocks = self.pool.num_allocated
        s.deferred_frees = self.num_deferred_frees
        return s

    @property
    def tables(self) -> dict[str, BlockTable]:
        """Live block tables of group 0 by request id (do not mutate)."""
        return self._tables

    @property
    def group_tables(self) -> list[dict[str, BlockTable]]:
        """Per layer group, the live block tables by request id (do not mutate)."""
        return self._gtables

    def has_request(self, req_id: str) -> bool:
        return req_id in self._tables

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's group-0 block table: physical ids in logical order ([] if unknown)."""
        table = self._tables.get(req_id)
        return list(table._ids) if table is not None else []

    def get_group_block_ids(self, req_id: str) -> list[list[int]]:
        """Per layer group, the request's block table (null placeholders are id 0);
        ``[[]] * num_groups`` if unknown."""
        return [list(t[req_id]._ids) if req_id in t else [] for t in self._gtables]

    def held_blocks(self, req_id: str) -> list[int]:
        """Per layer group, the real blocks the request's table holds (placeholders not
        counted; shared blocks counted in every table holding them)."""
        return [len(t[req_id].blocks) - t[req_id].num_null if req_id in t else 0 for t in self._gtables]

    def get_block_table(self, req_id: str, group: int = 0) -> BlockTable:
        """The request's ``BlockTable`` of layer group ``group``. Raises
        ``InvalidRequestError`` if unknown."""
        table = self._gtables[group].get(req_id)
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
        hits: list[Sequence[KVCacheBlock]],
    ) -> list[tuple[BlockTable | None, int, list[int]]]:
        """Validate and size an allocation without changing anything. Returns per layer
        group (table, fresh blocks to append, logical indices needing copy-on-write);
        raises ``NoFreeBlocksError`` if the pool cannot cover every group together."""
        if num_new_tokens < 0 or num_computed_tokens < 0:
            raise InvalidRequestError(
                f"{req_id}: num_new_tokens ({num_new_tokens}) and num_computed_tokens "
                f"({num_computed_tokens}) must be >= 0"
            )
        bs = self.block_size
        total = num_computed_tokens + num_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise InvalidRequestError(f"{req_id}: {total} tokens exceed max_model_len {self.max_model_len}")
        plans = []
        need = revived = 0
        for tables, gh in zip(self._gtables, hits):
            table = tables.get(req_id)
            n_table = len(table.blocks) if table is not None else 0
            if gh:
                if n_table:
                    raise InvalidRequestError(f"{req_id}: new_computed_blocks given for a request that has blocks")
                if num_computed_tokens != len(gh) * bs:
                    raise InvalidRequestError(
                        f"{req_id}: num_computed_tokens {num_computed_tokens} != {len(gh)} hit blocks x {bs}")
                revived += self._check_hits(req_id, gh)
                n_have = len(gh)
            else:
                if num_computed_tokens > n_table * bs:
                    raise InvalidRequestError(
                        f"{req_id}: {num_computed_tokens} computed tokens but only {n_table * bs} slots")
                n_have = n_table
            n_need = blocks_needed(total, bs)
            if not self.enable_paging and n_need < self._reserve_blocks:
                n_need = self._reserve_blocks
            n_fresh = n_need - n_have if n_need > n_have else 0
            cow: list[int] = []
            if n_table and num_new_tokens:
                blocks = table.blocks
                for i in range(num_computed_tokens // bs, min(n_table, blocks_needed(total, bs))):
                    b = blocks[i]
                    if b.ref_cnt > 1 or b.block_hash is not None:
                        cow.append(i)
            need += n_fresh + len(cow)
            plans.append((table, n_fresh, cow))
        if need + revived > self.pool.num_free:
            raise NoFreeBlocksError(
                f"{req_id}: needs {need} new blocks (+{revived} cached revived), "
                f"{self.pool.num_free} free"
            )
        return plans

    def _check_hits(self, req_id: str, hits: Sequence[KVCacheBlock]) -> int:
        """Raise ``InvalidRequestError`` if a hit was evicted since the lookup; returns how
        many hits are free cached blocks (they leave the free queue)."""
        cached = self.pool.cached
        revived = 0
        for b in hits:
            if b is self.null_block:
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

    def num_blocks_needed(self, num_tokens_after: int, hits: Any = ()) -> int:
        """Blocks a new request takes from the free queue (all layer groups) to hold
        positions ``0 .. num_tokens_after - 1`` after admission with prefix hits ``hits``
        (as ``get_computed_blocks`` returned them): fresh blocks plus free cached hits."""
        bs = self.block_size
        n = blocks_needed(num_tokens_after, bs)
        if not self.enable_paging:
            n = max(n, self._reserve_blocks)
        need = 0
        for gh in self._group_hits(hits):
            need += n - len(gh) + sum(1 for b in gh if b.ref_cnt == 0 and b is not self.null_block)
        return need

    def can_allocate(
        self, req_id: str, num_new_tokens: int, num_computed_tokens: int,
        new_computed_blocks: Any = (),
    ) -> bool:
        """Whether ``allocate_slots`` with these arguments would succeed now (no change)."""
        try:
            self._plan(req_id, num_new_tokens, num_computed_tokens, self._group_hits(new_computed_blocks))
        except NoFreeBlocksError:
            return False
        return True

    def slide_windows(self, req_id: str, num_computed_tokens: int) -> list[list[int]]:
        """Replace the blocks of every window group lying wholly before the window of a step
        that computes from ``num_computed_tokens`` with the null block, and drop them
        (behind the step fence while an open step used the request). Returns per group the
        dropped block ids (``allocate_slots`` calls this; a no-op for full groups)."""
        out: list[list[int]] = [[] for _ in self._gtables]
        if not self._windowed:
            return out
        bs = self.block_size
        dropped: list[KVCacheBlock] = []
        for g, tables in enumerate(self._gtables):
            table = tables.get(req_id)
            if table is None or self.groups.windows[g] is None:
                continue
            lo = min(self.groups.first_live_block(g, num_computed_tokens, bs), len(table.blocks))
            gone = table.nullify(lo, self.null_block)
            out[g] = [b.block_id for b in gone]
            dropped += gone[::-1]
        if dropped:
            self._stats.window_freed_blocks += len(dropped)
            self._drop(req_id, dropped)
        return out

    def allocate_slots(
        self, req_id: str, num_new_tokens: int, num_computed_tokens: int,
        new_computed_blocks: Any = (),
    ) -> list[tuple[int, int]]:
        """Give ``req_id`` slots for positions ``num_computed_tokens .. +num_new_tokens-1``
        in every layer group.

        A new request first takes references on its prefix hits ``new_computed_blocks``
        (then ``num_computed_tokens`` must equal their tokens). A block gets appended
        exactly when a position enters a new logical block (or, without paging, the whole
        reservation at once). Before the first write into a block that is shared (forked)
        or published, the request gets a fresh block; the returned ``[(src, dst), ...]``
        are the block copies the runner must apply before this step's writes (a block none
        of whose slots were written yet is just replaced, no copy). Window groups first
        drop the blocks this step's window no longer covers (``slide_windows``; done even
        if the allocation then fails: those blocks are never read again).

        All or nothing otherwise: raises ``NoFreeBlocksError`` with no block taken; raises
        ``InvalidRequestError`` on inconsistent arguments or a stale prefix hit.
        """
        if self._windowed and num_computed_tokens > 0:
            self.slide_windows(req_id, num_computed_tokens)
        table = self._tables.get(req_id)
        if (table is not None and self._single and not new_computed_blocks
                and num_new_tokens > 0 and num_computed_tokens >= 0):
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
                    n_fresh = blocks_needed(total, bs) - n_table
                    if n_fresh > self.pool.num_free:
                        raise NoFreeBlocksError(
                            f"{req_id}: needs {n_fresh} new blocks, {self.pool.num_free} free")
                    table.append(self.pool.allocate(n_fresh))
                    table.num_tokens = total
                    return []
        hits = self._group_hits(new_computed_blocks)
        plans = self._plan(req_id, num_new_tokens, num_computed_tokens, hits)
        if req_id not in self._tables:
            q = self._pending_query.pop(req_id, None)
            if q is not None:
                self._stats.prefix_queries += q[0]
                self._stats.prefix_hits += q[1]
        copies: list[tuple[int, int]] = []
        total = num_computed_tokens + num_new_tokens
        tabs = []
        for tables, (table, _n, _c), gh in zip(self._gtables, plans, hits):
            if table is None:
                table = tables[req_id] = BlockTable(self.block_size)
            if gh:  # every group's hits leave the free queue before any group allocates
                self._place_hits(table, gh)  # (an allocation could evict another group's hit)
            tabs.append(table)
        for table, (_t, n_fresh, cow) in zip(tabs, plans):
            if cow:
                copies += self._copy_on_write(req_id, table, cow, num_computed_tokens)
            if n_fresh:
                table.append(self.pool.allocate(n_fresh))
            if total > table.num_tokens:
                table.num_tokens = total
        return copies

    def _place_hits(self, table: BlockTable, hits: Sequence[KVCacheBlock]) -> None:
        """A new table starts with its prefix hits (references taken; tier hits loaded)."""
        lead = 0
        while lead < len(hits) and hits[lead] is self.null_block:
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

    def _copy_on_write(self, req_id: str, table: BlockTable, cow: list[int],
                       num_computed_tokens: int) -> list[tuple[int, int]]:
        bs = self.block_size
        copies, dropped = [], []
        for i, dst in zip(cow, self.pool.allocate(len(cow))):
            src = table.replace(i, dst)
            dropped.append(src)
            if i * bs < num_computed_tokens:
                copies.append((src.block_id, dst.block_id))
        self._drop(req_id, dropped)
        self._stats.cow_copies += len(copies)
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` shares every block of ``parent_id`` in every layer group (``ref_cnt
        += 1`` each; placeholders stay placeholders); the first write into a shared, partly
        filled block is copied (see ``allocate_slots``). Raises ``InvalidRequestError`` if
        the parent is unknown or the child exists."""
        if parent_id not in self._tables:
            raise InvalidRequestError(f"fork: unknown parent request {parent_id!r}")
        if child_id in self._tables:
            raise InvalidRequestError(f"fork: request {child_id!r} already has blocks")
        for tables in self._gtables:
            parent = tables[parent_id]
            self.pool.touch(parent.live_blocks)
            child = BlockTable(self.block_size, parent.blocks, parent.num_tokens)
            child.num_hashed, child.last_hash = parent.num_hashed, parent.last_hash
            child.num_null = parent.num_null
            tables[child_id] = child

    # ------------------------------------------------------------------ free
    def free(self, req_id: str) -> None:
        """Release the request's blocks in every layer group (finish, abort or preemption),
        tail first, so its last blocks are the first evicted. While a step that used the
        request is open, the references are held until that step's ``end_step``.
        Idempotent: an unknown or already freed request is a no-op."""
        self._pending_query.pop(req_id, None)
        dropped: list[KVCacheBlock] = []
        for tables in self._gtables:
            table = tables.pop(req_id, None)
            if table is not None:
                dropped += table.live_blocks[::-1]
        self._drop(req_id, dropped)

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Shrink ``req_id``'s tables to ``num_tokens`` positions (rejected speculative
        tokens): the blocks past them are released behind the step fence. Raises
        ``InvalidRequestError`` for an unknown request or a length beyond its slots."""
        dropped: list[KVCacheBlock] = []
        for tables in self._gtables:
            table = tables.get(req_id)
            if table is None or not 0 <= num_tokens <= table.num_tokens:
                raise InvalidRequestError(f"trim: {req_id!r} has no {num_tokens} token slots")
            dropped += table.truncate(max(blocks_needed(num_tokens, self.block_size), table.num_null))[::-1]
            table.num_tokens = num_tokens
        self._drop(req_id, dropped)

    # ------------------------------------------------------------------ introspection
    def snapshot(self) -> dict[str, Any]:
        """Every block and table, JSON-able, for a live UI (see ``pagedkv.kv.snapshot``)."""
        return manager_snapshot(self)

    def check_invariants(self) -> None:
        """Run ``pagedkv.kv.invariants.check_invariants`` on this manager."""
        check_invariants(self)
