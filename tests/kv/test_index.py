"""TierIndex / TierEntry / TierHit (pagedkv/kv/tiers/index.py): exact-match confirmation,
LRU order, capacity, pinning of eviction victims."""

from pagedkv.kv.tiers.index import TierEntry, TierHit, TierIndex


def _e(i, parent=None, toks=b"t", extra=b""):
    return TierEntry(bytes([i]) * 32, parent, toks, extra)


def test_entry_matches_only_the_same_parent_tokens_and_extra_keys():
    e = _e(1, parent=b"p" * 32, toks=b"\x01\x00", extra=b"salt")
    assert e.matches(b"p" * 32, b"\x01\x00", b"salt")
    assert not e.matches(None, b"\x01\x00", b"salt")  # a colliding hash with another parent
    assert not e.matches(b"p" * 32, b"\x02\x00", b"salt")
    assert not e.matches(b"p" * 32, b"\x01\x00", b"tenant")
    assert e != _e(1, parent=b"p" * 32, toks=b"\x01\x00", extra=b"salt")  # identity, not value


def test_tier_hit_stands_in_for_a_pool_block():
    e = _e(7)
    h = TierHit(e, 1, "disk")
    assert (h.ref_cnt, h.block_id, h.block_hash, h.level, h.tier) == (0, None, e.block_hash, 1, "disk")
    assert repr(h) == "TierHit(disk, 07070707)"


def test_lru_order_touch_and_capacity():
    ix = TierIndex("host", 3)
    a, b, c = _e(1), _e(2), _e(3)
    for e in (a, b):
        ix.add(e)
    assert len(ix) == 2 and not ix.full and a.block_hash in ix and ix.get(c.block_hash) is None
    ix.add(c)
    assert ix.full and list(ix) == [a, b, c] and ix.victim() is a
    ix.touch(a.block_hash)
    assert list(ix) == [b, c, a] and ix.victim() is b
    assert ix.pop(b.block_hash) is b and ix.pop(b.block_hash) is None
    assert list(ix) == [c, a] and not ix.full and ix.get(a.block_hash) is a


def test_pinned_entries_are_never_the_victim():
    ix = TierIndex("disk", 4)
    a, b = _e(1), _e(2)
    ix.add(a)
    ix.add(b)
    ix.pin(a.block_hash)
    assert ix.victim() is b
    ix.pin(b.block_hash)
    assert ix.victim() is None
    ix.pop(a.block_hash)  # popping unpins: a re-added entry is a victim again
    ix.add(a)
    assert ix.victim() is a
    ix.unpin_all()
    assert ix.victim() is b


def test_clear_returns_every_entry_and_unpins():
    ix = TierIndex("host", 2)
    a, b = _e(1), _e(2)
    ix.add(a)
    ix.add(b)
    ix.pin(a.block_hash)
    assert ix.clear() == [a, b] and len(ix) == 0 and ix.victim() is None
    ix.add(a)
    assert ix.victim() is a
