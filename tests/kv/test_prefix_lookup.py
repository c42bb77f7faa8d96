"""PrefixLookup (pagedkv/kv/prefix_lookup.py) through a KVCacheManager at block_size 4:
the lookup's limits (never the whole prompt, max_cached_tokens, cache keys), its purity,
incremental publishing, and per-group hits of a hybrid manager (null blocks before the window)."""

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.kv import CacheKeys, KVCacheManager, check_invariants

BS = 4
TOKENS = list(range(100, 121))  # 21 tokens: 5 full blocks and one partial


def _ids(blocks):
    return [b.block_id for b in blocks]


def _published(m, rid, n, keys=None):
    m.allocate_slots(rid, n, 0)
    return m.cache_blocks(rid, TOKENS[:n], n, keys)


def test_disabled_cache_finds_and_publishes_nothing():
    m = KVCacheManager(8, BS, enable_prefix_caching=False)
    assert _published(m, "a", 10) == 0 and m.pool.cached == {}
    assert m.get_computed_blocks("b", TOKENS[:10]) == ([], 0)


def test_publish_is_incremental_and_only_full_written_blocks():
    m = KVCacheManager(8, BS, enable_prefix_caching=True)
    m.allocate_slots("a", 10, 0)
    assert m.get_block_ids("a") == [0, 1, 2]
    assert m.cache_blocks("a", TOKENS[:10], 7) == 1  # block 1 is not wholly written yet
    assert m.cache_blocks("a", TOKENS[:10], 7) == 0
    assert m.cache_blocks("a", TOKENS[:10], 10) == 1  # block 1 now; block 2 holds 2 of 4
    assert [b.is_cached for b in m.pool.blocks[:3]] == [True, True, False]
    assert m.cache_blocks("nobody", TOKENS, 21) == 0
    check_invariants(m)


def test_lookup_limits_and_purity():
    m = KVCacheManager(8, BS, enable_prefix_caching=True)
    assert _published(m, "a", 12) == 3
    before = [b.ref_cnt for b in m.pool.blocks]
    hits, n = m.get_computed_blocks("b", TOKENS[:13])
    assert (_ids(hits), n) == ([0, 1, 2], 12)
    assert [b.ref_cnt for b in m.pool.blocks] == before  # pure: no reference taken
    # never the whole prompt: 12 tokens leave the last block to compute
    assert _ids(m.get_computed_blocks("b", TOKENS[:12])[0]) == [0, 1]
    assert m.get_computed_blocks("b", TOKENS[:13], max_cached_tokens=7)[1] == 4
    assert m.get_computed_blocks("b", TOKENS[:13], max_cached_tokens=-3) == ([], 0)
    # a different first block misses everything after it (the hashes chain)
    assert m.get_computed_blocks("b", [7] + TOKENS[1:13]) == ([], 0)
    # other cache keys never share a block
    assert m.get_computed_blocks("b", TOKENS[:13], CacheKeys(cache_salt="x")) == ([], 0)


def test_cache_keys_publish_their_own_chain():
    m = KVCacheManager(8, BS, enable_prefix_caching=True)
    keys = CacheKeys(cache_salt="s")
    assert _published(m, "a", 9, keys) == 2
    assert m.get_computed_blocks("b", TOKENS[:9]) == ([], 0)
    hits, n = m.get_computed_blocks("b", TOKENS[:9], keys)
    assert (_ids(hits), n) == ([0, 1], 8)


def test_hybrid_hits_per_group_with_null_blocks_before_the_window():
    m = KVCacheManager(16, BS, layer_windows=[None, 8], enable_prefix_caching=True)
    assert _published(m, "a", 21) == 10  # 5 full blocks in each of the 2 groups
    assert m.get_group_block_ids("a") == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    assert len(m.pool.cached) == 10  # each group has its own hash chain
    m.free("a")
    (full, win), n = m.get_computed_blocks("b", TOKENS)
    assert n == 20
    # 20 tokens: window 8 needs blocks (20 - 7) // 4 = 3 .. 4 only
    assert _ids(full) == [1, 2, 3, 4, 5] and _ids(win) == [0, 0, 0, 10, 11]
    (full, win), n = m.get_computed_blocks("c", TOKENS[:13])
    assert n == 12
    assert _ids(full) == [1, 2, 3] and _ids(win) == [0, 8, 9]
    assert m.get_computed_blocks("d", TOKENS[:13], max_cached_tokens=3) == (([], []), 0)
    check_invariants(m)


def test_hybrid_hits_must_come_one_list_per_group():
    m = KVCacheManager(16, BS, layer_windows=[None, 8], enable_prefix_caching=True)
    with pytest.raises(InvalidRequestError, match="new_computed_blocks: expected 2 per-group lists, got 1"):
        m.allocate_slots("d", 4, 4, new_computed_blocks=([m.pool.blocks[1]],))
