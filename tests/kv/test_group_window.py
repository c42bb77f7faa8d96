"""SlidingWindowGroup (pagedkv/kv/group_window.py) on its own: window 4 tokens, block size 4,
a pool whose block 0 is the null block (ids handed out 1, 2, 3, ...)."""

from __future__ import annotations

from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.group_window import SlidingWindowGroup
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.prefix_cache import sha256_block_hash


def _window_group() -> tuple[BlockPool, SlidingWindowGroup]:
    pool = BlockPool(8, reserve_null=True)
    return pool, SlidingWindowGroup(1, 4, 4, pool)


def test_window_sizing():
    _, g = _window_group()
    assert (g.kind, g.needs_whole_prefix, g.tag) == ("sliding_window", False, "group=1,window=4")
    # a step from position p reads p - 3 .. p
    assert [g.first_live_block(p) for p in (0, 4, 7, 8, 11, 12)] == [0, 0, 1, 1, 2, 2]
    assert g.blocks_held(12) == 1 and g.blocks_held(13) == 2 and g.blocks_held(40, chunk=8) == 4


def test_slide_replaces_blocks_before_the_window_with_the_null_block():
    pool, g = _window_group()
    table, n_fresh, _, _ = g.plan("a", 12, 0, (), 0)
    g.extend(g.open_table("a", ()), n_fresh, 12)
    assert g.tables["a"].ids == [1, 2, 3]
    assert [b.block_id for b in g.slide("a", 11)] == [1, 2]  # logical order; not released
    assert g.tables["a"].ids == [0, 0, 3] and g.tables["a"].num_null == 2
    assert g.slide("a", 11) == [] and g.slide("nobody", 11) == []
    assert [b.ref_cnt for b in pool.blocks[:4]] == [0, 1, 1, 1]
    assert [b.block_id for b in g.pop("a")] == [3]  # placeholders are not the request's blocks


def test_lookup_does_not_stop_at_a_miss():
    pool, g = _window_group()
    assert g.lookup(list(range(12)), None, 2, sha256_block_hash, None) == [None, None]


def test_a_hybrid_manager_holds_one_group_manager_per_layer_group():
    m = KVCacheManager(16, 4, layer_windows=[None, 4, None, 4])
    assert [type(g).__name__ for g in m.kv_groups] == ["FullAttentionGroup", "SlidingWindowGroup"]
    assert all(g.pool is m.pool for g in m.kv_groups) and m.fences.pool is m.pool
    m.allocate_slots("a", 12, 0)
    assert m.get_group_block_ids("a") == [[1, 2, 3], [4, 5, 6]]
    m.allocate_slots("a", 1, 12)  # the window group drops blocks 4, 5 (positions 0..7) to the queue's tail
    assert m.get_group_block_ids("a") == [[1, 2, 3, 7], [0, 0, 6, 8]]
    assert m.pool.free_queue.ids() == [9, 10, 11, 12, 13, 14, 15, 5, 4]
