"""BlockPool and FreeBlockQueue alone: reference counts, the LRU free queue, the prefix-cache
map (publish / lookup / evict / reset) and the shared-block count, with exact block ids."""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError, NoFreeBlocksError
from pagedkv.kv import BlockPool
from pagedkv.kv.block_pool import FreeBlockQueue


def test_free_queue_is_o1_lru():
    pool = BlockPool(4)
    q = pool.free_queue
    assert isinstance(q, FreeBlockQueue) and q.ids() == [0, 1, 2, 3]
    q.remove(pool.blocks[2])
    assert q.popleft().block_id == 0
    q.append(pool.blocks[2])
    assert q.ids() == [1, 3, 2]
    with pytest.raises(AssertionError):
        q.append(pool.blocks[2])


def test_allocate_takes_the_front_and_is_all_or_nothing():
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2] and [b.ref_cnt for b in a] == [1, 1, 1]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free == 2 and pool.free_queue.ids() == [3, 4] and pool.num_allocated == 3


def test_release_appends_in_the_given_order():
    pool = BlockPool(4)
    a = pool.allocate(3)
    pool.release(a[::-1])  # a table is released tail first: its tail is evicted first
    assert pool.free_queue.ids() == [3, 2, 1, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0]
    with pytest.raises(AssertionError, match="negative"):
        pool.release(a[:1])


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    assert pool.publish(b, b"h0", None, b"tok", b"x")
    pool.release([b])
    assert pool.free_queue.ids() == [1, 2, 0] and b.is_cached  # free, still cached
    pool.touch([b])  # a prefix hit on it
    assert b.ref_cnt == 1 and pool.free_queue.ids() == [1, 2]


def test_publish_and_lookup_confirm_the_exact_bytes():
    pool = BlockPool(4)
    b0, b1 = pool.allocate(2)
    assert pool.publish(b0, b"h0", None, b"t0", b"k") is True
    assert pool.publish(b0, b"h9", None, b"t0", b"k") is False  # already carries a hash
    assert pool.publish(b1, b"h0", None, b"t0", b"k") is False  # hash held by b0
    assert b1.block_hash is None and pool.cached == {b"h0": b0}
    assert pool.lookup(b"h0", None, b"t0", b"k") is b0
    assert pool.lookup(b"h0", None, b"t1", b"k") is None  # a collision: other tokens
    assert pool.lookup(b"h0", b"p", b"t0", b"k") is None  # other parent
    assert pool.lookup(b"h0", None, b"t0", b"salt") is None  # other extra keys
    assert pool.lookup(b"h1", None, b"t0", b"k") is None


def test_allocating_a_free_cached_block_evicts_its_hash():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.publish(b, b"h0", None, b"t0", b"k")
    pool.release([b])
    assert [x.block_id for x in pool.allocate(2)] == [1, 0]
    assert b.block_hash is None and b.token_bytes is None and pool.cached == {}
    assert pool.num_evictions == 1


def test_reset_prefix_cache_unpublishes_every_block():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks[:2]):
        pool.publish(b, b"h%d" % i, None, b"t", b"k")
    assert pool.reset_prefix_cache() == 2
    assert pool.cached == {} and [b.block_hash for b in blocks] == [None, None, None]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]  # the tables keep their blocks


def test_reserved_null_block_is_never_handed_out():
    pool = BlockPool(3, reserve_null=True)
    assert pool.null_block is pool.blocks[0] and pool.num_usable == 2
    assert pool.free_queue.ids() == [1, 2]
    with pytest.raises(ConfigError, match=">= 2"):
        BlockPool(1, reserve_null=True)
    with pytest.raises(ConfigError, match=">= 1"):
        BlockPool(0)


def test_shuffle_seed_permutes_the_free_queue_reproducibly():
    ids = BlockPool(8, shuffle_seed=1).free_queue.ids()
    assert sorted(ids) == list(range(8)) and ids != list(range(8))
    assert BlockPool(8, shuffle_seed=1).free_queue.ids() == ids


def test_the_pool_counts_shared_blocks_as_references_change():
    """``BlockPool.num_shared`` (blocks with ref_cnt > 1, read every step for the stats) follows
    touch / release: 1 -> 2 counts, 2 -> 1 uncounts, 2 -> 3 and 0 -> 1 change nothing."""
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert pool.num_shared == 0
    pool.touch(a[:2])  # a fork: two blocks held twice
    assert pool.num_shared == 2
    pool.touch(a[:1])  # a third holder of block a[0]: still one shared block
    assert [b.ref_cnt for b in a] == [3, 2, 1] and pool.num_shared == 2
    pool.release(a[:2])
    assert [b.ref_cnt for b in a] == [2, 1, 1] and pool.num_shared == 1
    pool.release(a)
    assert [b.ref_cnt for b in a] == [1, 0, 0] and pool.num_shared == 0 and pool.num_free == 5
    pool.release(a[:1])
    assert pool.num_shared == 0 and pool.num_free == 6
