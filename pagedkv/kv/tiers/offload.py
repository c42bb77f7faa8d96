"""KVTiers: the bookkeeping of the tiers behind the block pool (the decisions; no bytes).

The block pool calls it when a cached block is published or evicted; the KV manager asks
it to continue a prefix lookup past the pool, to place tier hits into fresh pool blocks,
and for the step's ``KVTransfer`` (what the runner must copy). Policy:

* a cached block (``ref_cnt`` 0, published hash) evicted from the pool is stored in the
  first tier, unless a tier already holds its hash (then that entry just becomes most
  recently used): one copy per hash across the tiers;
* a full tier pushes its least recently used entry down one tier (``Move``); the last tier
  drops it (``Drop``). Entries being loaded this step are pinned and never chosen;
* a lookup walks pool -> host -> disk per block by the same chained hash, confirming a hit
  by the token and extra-key bytes (a collision is a miss, tenants never share an entry);
* a tier hit gets a fresh pool block, published at once under its hash; its ``Load`` runs
  before the step's forward, so no step reads it half-loaded. The tier keeps its copy.

Events (``KVEventRecorder``) follow every change, per medium (``pool``, ``host``,
``disk``), and are flushed as one batch per step (``end_step``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from pagedkv.kv.tiers.index import TierEntry, TierHit, TierIndex
from pagedkv.kv.tiers.plan import Clear, Drop, KVTransfer, Load, Move, Put

POOL = "pool"


@dataclass
class TierCounters:
    """Counters of one tier since start (blocks; ``hit_tokens`` in tokens)."""

    stored_blocks: int = 0  # entries added (from the pool or pushed down from a faster tier)
    removed_blocks: int = 0  # entries that left (pushed down, dropped, failed, cleared)
    hit_blocks: int = 0  # prefix hits admitted (loaded into the pool)
    hit_tokens: int = 0
    failed_blocks: int = 0  # payloads that could not be written or failed verification


def _entry(block: Any) -> TierEntry:
    return TierEntry(block.block_hash, block.parent_hash, block.token_bytes, block.extra_bytes)


def cached_tokens_by_tier(hits: Iterable[Any], block_size: int) -> dict[str, int]:
    """Tokens of a prefix-hit list per tier: ``{"pool": n, "host": m, ...}`` (pool blocks
    have no ``tier``)."""
    c = Counter(getattr(b, "tier", POOL) for b in hits)
    return {t: n * block_size for t, n in c.items()}


class KVTiers:
    """Tier indexes (fastest first), the step's pending transfer and the event recorder.
    ``stores`` (the data plane, ``TierStores``) is read only for its failure reports and
    transfer counters. With no tiers it still records pool events."""

    def __init__(self, indexes: Sequence[TierIndex], block_size: int, events: Any = None,
                 stores: Any = None) -> None:
        self.indexes = list(indexes)
        self.block_size = block_size
        self.events = events
        self.stores = stores
        self.counters = {t.name: TierCounters() for t in self.indexes}
        self._store_ids: list[int] = []
        self._ops: list = []
        self._loading: set[int] = set()  # pool blocks with a Load pending this step

    # ---- the pool's listener -----------------------------------------------------------
    def on_publish(self, block: Any) -> None:
        if self.events is not None:
            self.events.stored(POOL, _entry(block))

    def on_evict(self, block: Any) -> None:
        """A cached pool block is being handed to a new owner: keep its K/V in a tier."""
        if self.events is not None:
            self.events.removed(POOL, block.block_hash)
        if not self.indexes or block.block_id in self._loading:
            return  # its K/V are not in the pool yet (a load is pending); its tier keeps them
        for tier in self.indexes:
            if block.block_hash in tier:
                tier.touch(block.block_hash)
                return
        self._store(block, 0)

    def on_clear(self) -> None:
        """``reset_prefix_cache``: the pool and every tier forget everything."""
        for level, tier in enumerate(self.indexes):
            n = len(tier.clear())
            self.counters[tier.name].removed_blocks += n
            self._ops.append(Clear(level))
        if self.events is not None:
            self.events.cleared()

    # ---- decisions ----------------------------------------------------------------------
    def _store(self, block: Any, level: int) -> None:
        self._store_ids.append(block.block_id)
        entry = _entry(block)
        self._insert(level, entry, Put(level, entry, len(self._store_ids) - 1))

    def _insert(self, level: int, entry: TierEntry, op: Put | Move) -> None:
        """Add ``entry`` to tier ``level`` (``op`` brings its payload), first pushing LRU
        victims down a tier or off the last one."""
        tier = self.indexes[level]
        while tier.full:
            victim = tier.victim()
            if victim is None:  # every entry is pinned: this one is not kept
                if isinstance(op, Move):
                    self._ops.append(Drop(op.src_level, entry.block_hash))
                return
            tier.pop(victim.block_hash)
            self._left(level, victim.block_hash)
            if level + 1 < len(self.indexes):
                nxt = self.indexes[level + 1]
                if victim.block_hash in nxt:  # already there: the copy here just goes
                    nxt.touch(victim.block_hash)
                    self._ops.append(Drop(level, victim.block_hash))
                else:
                    self._insert(level + 1, victim, Move(level, level + 1, victim))
            else:
                self._ops.append(Drop(level, victim.block_hash))
        tier.add(entry)
        self._ops.append(op)
        self.counters[tier.name].stored_blocks += 1
        if self.events is not None:
            self.events.stored(tier.name, entry)

    def _left(self, level: int, block_hash: bytes) -> None:
        name = self.indexes[level].name
        self.counters[name].removed_blocks += 1
        if self.events is not None:
            self.events.removed(name, block_hash)

    def lookup(self, block_hash: bytes, parent_hash: bytes | None, token_bytes: bytes,
               extra_bytes: bytes) -> TierHit | None:
        """The first tier holding this exact block (hash, parent, tokens, extra keys)."""
        for level, tier in enumerate(self.indexes):
            e = tier.get(block_hash)
            if e is not None:
                return TierHit(e, level, tier.name) if e.matches(parent_hash, token_bytes, extra_bytes) else None
        return None

    def holds(self, hit: TierHit) -> bool:
        """Whether ``hit`` is still in its tier (not pushed down or dropped since lookup)."""
        return self.indexes[hit.level].get(hit.block_hash) is hit.entry

    def place_hits(self, pool: Any, hits: Sequence[Any]) -> list[Any]:
        """Pool blocks for a prefix-hit list, in order: pool hits get a reference
        (``pool.touch``); each ``TierHit`` gets a fresh block, published under its hash,
        with a ``Load`` recorded. The caller checked that enough blocks are free."""
        tier_hits = [h for h in hits if isinstance(h, TierHit)]
        pool.touch([h for h in hits if not isinstance(h, TierHit)])
        if not tier_hits:
            return list(hits)
        for h in tier_hits:
            self.indexes[h.level].pin(h.block_hash)
        fresh = iter(pool.allocate(len(tier_hits)))  # may evict (and store) other blocks
        out: list[Any] = []
        for i, h in enumerate(hits):
            if isinstance(h, TierHit):
                e, block = h.entry, next(fresh)
                pool.publish(block, e.block_hash, e.parent_hash, e.token_bytes, e.extra_bytes)
                out.append(block)
                self._ops.append(Load(h.level, e, block.block_id, i * self.block_size, [b.block_id for b in out]))
                self._loading.add(block.block_id)
                self.indexes[h.level].touch(e.block_hash)
                c = self.counters[h.tier]
                c.hit_blocks += 1
                c.hit_tokens += self.block_size
            else:
                out.append(h)
        for tier in self.indexes:
            tier.unpin_all()
        return out

    def persist(self, pool: Any) -> KVTransfer | None:
        """Before a shutdown: every host entry, then every cached pool block not yet in a
        tier, goes to the last tier if it is persistent (disk), most recent last. Returns
        the transfer the runner must execute (``None`` without a disk tier)."""
        last = len(self.indexes) - 1
        if last >= 0 and self.indexes[last].name == "disk":
            self._persist_to(last, pool)
        transfer = self.take_transfer()
        self.end_step()  # its events, one batch
        return transfer

    def _persist_to(self, last: int, pool: Any) -> None:
        for level in range(last):
            for e in list(self.indexes[level]):
                self.indexes[level].pop(e.block_hash)
                self._left(level, e.block_hash)
                self._insert(last, e, Move(level, last, e))
        in_use = [b for b in pool.cached.values() if b.ref_cnt > 0]
        for block in list(pool.free_queue) + in_use:
            if block.block_hash is not None and not any(block.block_hash in t for t in self.indexes):
                self._store(block, last)

    # ---- per step -----------------------------------------------------------------------
    def take_transfer(self) -> KVTransfer | None:
        """The moves decided since the last call (``None`` if none), for the runner; first
        forgets entries the data plane reported as failed."""
        self._sync_failures()
        if not self._ops:
            return None
        t = KVTransfer(self._store_ids, self._ops)
        self._store_ids, self._ops, self._loading = [], [], set()
        return t

    def _sync_failures(self) -> None:
        if self.stores is None:
            return
        for level, block_hash in self.stores.take_failures():
            tier = self.indexes[level]
            self.counters[tier.name].failed_blocks += 1
            if tier.pop(block_hash) is not None:
                self._left(level, block_hash)

    def end_step(self) -> None:
        if self.events is not None:
            self.events.flush()

    def stats(self) -> dict[str, Any]:
        """``{"tiers": {name: {blocks, capacity_blocks, **TierCounters}}, "transfer":
        {direction: {"bytes", "seconds", "blocks"}}}`` (directions like ``pool->host``)."""
        tiers = {t.name: {"blocks": len(t), "capacity_blocks": t.capacity_blocks, **asdict(self.counters[t.name])}
                 for t in self.indexes}
        transfer = self.stores.transfer_stats() if self.stores is not None else {}
        return {"tiers": tiers, "transfer": transfer}
