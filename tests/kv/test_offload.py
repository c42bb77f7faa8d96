"""KVTiers (pagedkv/kv/tiers/offload.py) with hand-made evicted blocks and no bytes: one copy
per hash, LRU push-down host -> disk -> dropped, lookups confirmed exactly, counters, failures
reported by the data plane, clear, and the per-tier token split of a hit list."""

from types import SimpleNamespace

from pagedkv.kv.tiers.index import TierHit, TierIndex
from pagedkv.kv.tiers.offload import KVTiers, cached_tokens_by_tier


def _blk(i, parent=None):
    return SimpleNamespace(block_id=i, block_hash=bytes([i]) * 32, parent_hash=parent, token_bytes=bytes([i]) * 8,
                           extra_bytes=b"", ref_cnt=0)


class Events:
    def __init__(self):
        self.log = []

    def stored(self, medium, entry):
        self.log.append(("stored", medium, entry.block_hash[0]))

    def removed(self, medium, h):
        self.log.append(("removed", medium, h[0]))

    def cleared(self):
        self.log.append(("cleared",))

    def flush(self):
        self.log.append(("flush",))


def _tiers(events=None, stores=None):
    return KVTiers([TierIndex("host", 2), TierIndex("disk", 2)], 4, events, stores)


def _ops(t):
    tr = t.take_transfer()
    return tr.store_block_ids, [(type(o).__name__, o.level, _hash_of(o)) for o in tr.ops]


def _hash_of(op):
    """The first byte of the op's block hash (None for a Clear)."""
    h = op.entry.block_hash if hasattr(op, "entry") else getattr(op, "block_hash", None)
    return h[0] if h is not None else None


def test_evictions_push_least_recently_used_entries_down_and_off():
    t = _tiers()
    for i in (1, 2, 3, 4, 5):
        t.on_evict(_blk(i))
    ids, ops = _ops(t)
    assert ids == [1, 2, 3, 4, 5]  # the pool blocks whose K/V the runner exports, Put.src indexes them
    assert ops == [("Put", 0, 1), ("Put", 0, 2),
                   ("Move", 1, 1), ("Put", 0, 3),
                   ("Move", 1, 2), ("Put", 0, 4),
                   ("Drop", 1, 1), ("Move", 1, 3), ("Put", 0, 5)]
    assert [e.block_hash[0] for e in t.indexes[0]] == [4, 5]
    assert [e.block_hash[0] for e in t.indexes[1]] == [2, 3]
    assert t.take_transfer() is None
    s = t.stats()["tiers"]
    assert s["host"] == {"blocks": 2, "capacity_blocks": 2, "stored_blocks": 5, "removed_blocks": 3,
                         "hit_blocks": 0, "hit_tokens": 0, "failed_blocks": 0}
    assert (s["disk"]["stored_blocks"], s["disk"]["removed_blocks"]) == (3, 1)


def test_one_copy_per_hash():
    t = _tiers()
    t.on_evict(_blk(1))
    t.on_evict(_blk(2))
    t.take_transfer()
    t.on_evict(_blk(1))  # evicted again after a hit: the host entry just becomes most recent
    assert t.take_transfer() is None
    assert [e.block_hash[0] for e in t.indexes[0]] == [2, 1]


def test_lookup_confirms_the_exact_block():
    t = _tiers()
    b = _blk(7, parent=b"p" * 32)
    t.on_evict(b)
    hit = t.lookup(b.block_hash, b.parent_hash, b.token_bytes, b"")
    assert isinstance(hit, TierHit) and (hit.level, hit.tier) == (0, "host") and t.holds(hit)
    assert t.lookup(b.block_hash, None, b.token_bytes, b"") is None  # a collision is a miss
    assert t.lookup(b.block_hash, b.parent_hash, b.token_bytes, b"tenant") is None
    assert t.lookup(b"\x09" * 32, None, b"", b"") is None
    t.indexes[0].pop(b.block_hash)
    assert not t.holds(hit)


def test_failures_from_the_data_plane_are_forgotten():
    stores = SimpleNamespace(take_failures=lambda: [(0, b"\x01" * 32)], transfer_stats=lambda: {"blocks": {}})
    ev = Events()
    t = _tiers(ev, stores)
    t.on_evict(_blk(1))
    t.on_evict(_blk(2))
    ids, ops = _ops(t)  # failures are synced first: hash 1 leaves the host tier
    assert [e.block_hash[0] for e in t.indexes[0]] == [2]
    assert t.stats()["tiers"]["host"]["failed_blocks"] == 1
    assert t.stats()["transfer"] == {"blocks": {}}
    assert ev.log == [("removed", "pool", 1), ("stored", "host", 1), ("removed", "pool", 2),
                      ("stored", "host", 2), ("removed", "host", 1)]


def test_clear_and_events_per_step():
    ev = Events()
    t = _tiers(ev)
    t.on_publish(_blk(3))
    t.on_evict(_blk(3))
    t.on_clear()
    t.end_step()
    ids, ops = _ops(t)
    assert (ids, ops) == ([3], [("Put", 0, 3), ("Clear", 0, None), ("Clear", 1, None)])
    assert len(t.indexes[0]) == 0
    assert t.stats()["tiers"]["host"]["removed_blocks"] == 1
    assert ev.log == [("stored", "pool", 3), ("removed", "pool", 3), ("stored", "host", 3), ("cleared",), ("flush",)]


def test_cached_tokens_by_tier():
    hits = [_blk(1), _blk(2), SimpleNamespace(tier="host"), SimpleNamespace(tier="disk"), SimpleNamespace(tier="host")]
    assert cached_tokens_by_tier(hits, 16) == {"pool": 32, "host": 32, "disk": 16}
    assert cached_tokens_by_tier([], 16) == {}


def test_place_hits_gives_tier_hits_fresh_published_pool_blocks():
    from pagedkv.kv.block_pool import BlockPool

    pool = BlockPool(4)
    t = _tiers()
    pool.listener = t
    t.on_evict(_blk(9))  # hash 9 lives in the host tier
    t.take_transfer()
    (own,) = pool.allocate(1)  # block 0, a pool hit for the prefix's first block
    pool.publish(own, b"\x00" * 32, None, b"t0", b"")
    hit = t.lookup(bytes([9]) * 32, None, bytes([9]) * 8, b"")
    out = t.place_hits(pool, [own, hit])
    assert [b.block_id for b in out] == [0, 1] and [b.ref_cnt for b in out] == [2, 1]
    assert out[1].block_hash == bytes([9]) * 32 and pool.cached[bytes([9]) * 32] is out[1]
    tr = t.take_transfer()
    (load,) = tr.ops
    assert (load.level, load.block_id, load.position, load.context_block_ids) == (0, 1, 4, [0, 1])
    assert load.entry is hit.entry and tr.store_block_ids == []
    host = t.stats()["tiers"]["host"]
    assert (host["hit_blocks"], host["hit_tokens"], host["blocks"]) == (1, 4, 1)  # the tier keeps its copy
    # pool hits only: a reference each, nothing to load
    assert t.place_hits(pool, [own]) == [own] and own.ref_cnt == 3 and t.take_transfer() is None
