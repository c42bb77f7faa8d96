"""KVCacheManager: the memory system's one entry point for the engine (seed §02-§04).

It owns the block pool, one block table per request *per layer group*, copy-on-write for
forked requests, prefix-cache lookup/publish, and step fences. Unit of every count is
*tokens* unless the name says blocks; block ids are physical indices into the device cache.

Composition: the manager is a coordinator over collaborators it holds, each given what it
needs: the ``BlockPool``, one KV group manager per layer group (``pagedkv.kv.group_full`` /
``group_window``, chosen by ``pagedkv.kv.groups.GROUP_TYPES``), the ``PrefixLookup`` and the
``StepFences``. Layer groups (``pagedkv.kv.groups``): layers of one attention kind (full, or
a sliding window of ``W`` tokens) share block tables; every group has its own table per
request, all drawing from one pool. A window group's blocks wholly before its window are replaced by the
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
from typing import Any, Iterable, Sequence

from pagedkv.errors import ConfigError, InvalidRequestError, NoFreeBlocksError
from pagedkv.kv.block_pool import BlockPool, KVCacheBlock
from pagedkv.kv.block_table import BlockTable, blocks_needed
from pagedkv.kv.fences import StepFences
from pagedkv.kv.group_full import FullAttentionGroup
from pagedkv.kv.group_window import SlidingWindowGroup
from pagedkv.kv.groups import LayerGroups
from pagedkv.kv.invariants import check_invariants
from pagedkv.kv.prefix_cache import CacheKeys, HashFn, sha256_block_hash
from pagedkv.kv.prefix_lookup import PrefixLookup
from pagedkv.kv.snapshot import manager_snapshot

#: The KV group manager class of each layer-group kind (``LayerGroups.kind``). A new kind of
#: KV group is one module with a ``FullAttentionGroup`` subclass plus its entry here.
GROUP_TYPES: dict[str, type[FullAttentionGroup]] = {
    FullAttentionGroup.kind: FullAttentionGroup,
    SlidingWindowGroup.kind: SlidingWindowGroup,
}


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


class KVCacheManager:
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
        # a contiguous reservation: the least a table holds (0 when paged)
        self._reserve_blocks = 0 if enable_paging else blocks_needed(max_model_len, block_size)
        #: one KV group manager per layer group (its class from ``GROUP_TYPES``)
        self.kv_groups: list[FullAttentionGroup] = [
            GROUP_TYPES[groups.kind(g)](g, w, block_size, self.pool, tiers) for g, w in enumerate(groups.windows)]
        self._tables = self.kv_groups[0].tables
        self.prefix = PrefixLookup(groups, self.kv_groups, block_size, hash_fn, tiers)
        self.fences = StepFences(self.pool, tiers)
        self._stats = KVCacheStats()
        self._pending_query: dict[str, tuple[int, int]] = {}

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
        s.deferred_frees = self.fences.num_deferred_frees
        return s

    @property
    def tables(self) -> dict[str, BlockTable]:
        """Live block tables of group 0 by request id (do not mutate)."""
        return self._tables

    @property
    def group_tables(self) -> list[dict[str, BlockTable]]:
        """Per layer group, the live block tables by request id (do not mutate)."""
        return [g.tables for g in self.kv_groups]

    @property
    def num_deferred_frees(self) -> int:
        """Drops held by a step fence so far."""
        return self.fences.num_deferred_frees

    @property
    def holds(self) -> list[tuple[str, list[KVCacheBlock], set[int]]]:
        """Fence holds: ``(req_id, blocks, steps still open)`` (do not mutate)."""
        return self.fences.holds

    @property
    def open_steps(self) -> dict[int, set[str]]:
        """Open steps: step id -> the request ids it uses (do not mutate)."""
        return self.fences.open_steps

    def begin_step(self, req_ids: Iterable[str]) -> int:
        """Open a step fence over the requests whose blocks the step reads or writes
        (``StepFences.begin_step``). Returns its step id (increasing ints)."""
        return self.fences.begin_step(req_ids)

    def end_step(self, step_id: int) -> None:
        """Confirm the device finished ``step_id``: references held for it are released
        (``StepFences.end_step``; an unknown id raises ``InvalidRequestError``)."""
        self.fences.end_step(step_id)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._tables

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's group-0 block table: physical ids in logical order ([] if unknown)."""
        table = self._tables.get(req_id)
        return table.ids if table is not None else []

    def get_group_block_ids(self, req_id: str) -> list[list[int]]:
        """Per layer group, the request's block table (null placeholders are id 0);
        ``[[]] * num_groups`` if unknown."""
        return [t[req_id].ids if req_id in t else [] for t in self.group_tables]

    def held_blocks(self, req_id: str) -> list[int]:
        """Per layer group, the real blocks the request's table holds (placeholders not
        counted; shared blocks counted in every table holding them)."""
        return [len(t[req_id].blocks) - t[req_id].num_null if req_id in t else 0 for t in self.group_tables]

    def get_block_table(self, req_id: str, group: int = 0) -> BlockTable:
        """The request's ``BlockTable`` of layer group ``group``. Raises
        ``InvalidRequestError`` if unknown."""
        table = self.kv_groups[group].tables.get(req_id)
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

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(
        self, req_id: str, token_ids: Sequence[int], cache_keys: CacheKeys | None = None,
        max_cached_tokens: int | None = None, record: bool = True,
    ) -> tuple[Any, int]:
        """Longest cached prefix of ``token_ids`` in whole blocks, never the whole prompt
        (at least the last token is left to compute), nor more than ``max_cached_tokens``.
        Pure: no ``ref_cnt`` changes; pass the hits to ``allocate_slots(new_computed_blocks=
        ...)`` before anything else allocates. Returns ``(hits, num_cached_tokens)``; ``([],
        0)`` when disabled. With one layer group ``hits`` is a list of blocks; with several,
        a tuple of such lists, one per group. A full group needs every block of the prefix
        cached; a window group only the blocks covering the last ``W`` tokens before the hit
        point (its earlier entries are the null block): the hit is the longest prefix valid
        in every group (``PrefixLookup.find``). With tiers, a block found in a tier is a
        ``TierHit`` (loaded into a fresh pool block at admission). ``record``: count this
        lookup in the ``prefix_queries`` / ``prefix_hits`` stats when ``allocate_slots``
        admits the request (the scheduler passes False for a preempted request's recompute:
        vLLM counts a request's first computation only)."""
        if not self.enable_prefix_caching:
            return [], 0
        hits, num_cached = self.prefix.find(token_ids, cache_keys, max_cached_tokens)
        if record:
            self._pending_query[req_id] = (len(token_ids), num_cached)
        else:
            self._pending_query.pop(req_id, None)
        return (hits[0] if len(hits) == 1 else tuple(hits)), num_cached

    def cache_blocks(
        self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int,
        cache_keys: CacheKeys | None = None,
    ) -> int:
        """Publish the request's full blocks whose every slot is written (the first
        ``num_computed_tokens // block_size`` blocks; ``token_ids`` are the request's tokens
        from position 0), in every layer group (placeholders are skipped). Incremental: each
        block is hashed once. Returns how many blocks were newly published (0 when disabled
        or the request is unknown)."""
        if not self.enable_prefix_caching:
            return 0
        return self.prefix.publish(req_id, token_ids, num_computed_tokens, cache_keys)

    def _group_hits(self, hits: Any) -> list[Sequence[KVCacheBlock]]:
        """``get_computed_blocks``' hits as one list per group (``[]`` each when none)."""
        n = len(self.kv_groups)
        if not hits:
            return [()] * n
        if n == 1:
            return [hits]
        if len(hits) != n:
            raise InvalidRequestError(f"new_computed_blocks: expected {n} per-group lists, got {len(hits)}")
        return list(hits)

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
        total = num_computed_tokens + num_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise InvalidRequestError(f"{req_id}: {total} tokens exceed max_model_len {self.max_model_len}")
        plans = []
        need = revived = 0
        for group, gh in zip(self.kv_groups, hits):
            table, n_fresh, cow, n_revived = group.plan(
                req_id, num_new_tokens, num_computed_tokens, gh, self._reserve_blocks)
            revived += n_revived
            need += n_fresh + len(cow)
            plans.append((table, n_fresh, cow))
        if need + revived > self.pool.num_free:
            raise NoFreeBlocksError(
                f"{req_id}: needs {need} new blocks (+{revived} cached revived), "
                f"{self.pool.num_free} free"
            )
        return plans

    def num_blocks_needed(self, num_tokens_after: int, hits: Any = ()) -> int:
        """Blocks a new request takes from the free queue (all layer groups) to hold
        positions ``0 .. num_tokens_after - 1`` after admission with prefix hits ``hits``
        (as ``get_computed_blocks`` returned them): fresh blocks plus free cached hits."""
        n = max(blocks_needed(num_tokens_after, self.block_size), self._reserve_blocks)
        need = 0
        null = self.null_block
        for gh in self._group_hits(hits):
            need += n - len(gh) + sum(1 for b in gh if b.ref_cnt == 0 and b is not null)
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
        out: list[list[int]] = [[] for _ in self.kv_groups]
        if not self._windowed:
            return out
        dropped: list[KVCacheBlock] = []
        for g, group in enumerate(self.kv_groups):
            gone = group.slide(req_id, num_computed_tokens)
            out[g] = [b.block_id for b in gone]
            dropped += gone[::-1]
        if dropped:
            self._stats.window_freed_blocks += len(dropped)
            self.fences.drop(req_id, dropped)
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
        if (self._single and not new_computed_blocks and num_new_tokens > 0 and num_computed_tokens >= 0
                and (self.max_model_len is None or num_computed_tokens + num_new_tokens <= self.max_model_len)
                and self.kv_groups[0].append_in_place(req_id, num_new_tokens, num_computed_tokens, self.enable_paging)):
            return []  # the decode fast path
        hits = self._group_hits(new_computed_blocks)
        plans = self._plan(req_id, num_new_tokens, num_computed_tokens, hits)
        if req_id not in self._tables:
            q = self._pending_query.pop(req_id, None)
            if q is not None:
                self._stats.prefix_queries += q[0]
                self._stats.prefix_hits += q[1]
        # every group's hits leave the free queue before any group allocates
        # (an allocation could evict another group's hit)
        tabs = [group.open_table(req_id, gh) for group, gh in zip(self.kv_groups, hits)]
        copies: list[tuple[int, int]] = []
        total = num_computed_tokens + num_new_tokens
        for group, table, (_t, n_fresh, cow) in zip(self.kv_groups, tabs, plans):
            if cow:
                c, dropped = group.copy_on_write(table, cow, num_computed_tokens)
                self.fences.drop(req_id, dropped)
                self._stats.cow_copies += len(c)
                copies += c
            group.extend(table, n_fresh, total)
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
        for group in self.kv_groups:
            group.fork(parent_id, child_id)

    # ------------------------------------------------------------------ free
    def free(self, req_id: str) -> None:
        """Release the request's blocks in every layer group (finish, abort or preemption),
        tail first, so its last blocks are the first evicted. While a step that used the
        request is open, the references are held until that step's ``end_step``.
        Idempotent: an unknown or already freed request is a no-op."""
        self._pending_query.pop(req_id, None)
        dropped: list[KVCacheBlock] = []
        for group in self.kv_groups:
            dropped += group.pop(req_id)
        self.fences.drop(req_id, dropped)

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Shrink ``req_id``'s tables to ``num_tokens`` positions (rejected speculative
        tokens): the blocks past them are released behind the step fence. Raises
        ``InvalidRequestError`` for an unknown request or a length beyond its slots."""
        dropped: list[KVCacheBlock] = []
        for group in self.kv_groups:
            dropped += group.trim(req_id, num_tokens)
        self.fences.drop(req_id, dropped)

    # ------------------------------------------------------------------ introspection
    def snapshot(self) -> dict[str, Any]:
        """Every block and table, JSON-able, for a live UI (see ``pagedkv.kv.snapshot``)."""
        return manager_snapshot(self)

    def check_invariants(self) -> None:
        """Run ``pagedkv.kv.invariants.check_invariants`` on this manager."""
        check_invariants(self)
