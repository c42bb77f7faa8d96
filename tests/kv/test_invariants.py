"""check_invariants (pagedkv/kv/invariants.py): a clean manager passes, and each planted
corruption (leaked block, wrong ref_cnt, double free, stale cache entry, short table, misused
null block...) is reported by its own rule."""

import pytest

from pagedkv.errors import InvariantViolation
from pagedkv.kv import KVCacheManager, check_invariants
from pagedkv.kv.block_pool import KVCacheBlock

BS = 4


def _mgr():
    """8 blocks: "a" holds blocks 0, 1 (6 tokens), "b" forks it (both ref_cnt 2), "c" holds 2."""
    m = KVCacheManager(8, BS, enable_prefix_caching=True)
    m.allocate_slots("a", 6, 0)
    m.fork("a", "b")
    m.allocate_slots("c", 3, 0)
    return m


def _violation(m):
    with pytest.raises(InvariantViolation) as e:
        check_invariants(m)
    return str(e.value)


def test_a_clean_manager_passes_and_returns_the_blocks_checked():
    m = _mgr()
    assert [b.ref_cnt for b in m.pool.blocks] == [2, 2, 1, 0, 0, 0, 0, 0]
    assert check_invariants(m) == 8
    m.free("b")
    m.free("a")
    assert check_invariants(m) == 8


def test_leaked_block():
    m = _mgr()
    m.pool.free_queue.remove(m.pool.blocks[5])
    msg = _violation(m)
    assert "block 5: ref_cnt 0 but not in the free queue (leaked)" in msg
    assert "free 4 + used 3 != usable blocks 8" in msg


def test_wrong_ref_cnt_and_shared_count():
    m = _mgr()
    m.pool.blocks[2].ref_cnt = 2  # one table holds it
    msg = _violation(m)
    assert "block 2: ref_cnt 2 != 1 holders" in msg
    assert "pool counts 2 shared blocks, 3 have ref_cnt > 1" in msg


def test_negative_ref_cnt():
    m = _mgr()
    b = m.pool.blocks[7]
    m.pool.free_queue.remove(b)
    b.ref_cnt = -1
    msg = _violation(m)
    assert "block 7: negative ref_cnt -1" in msg and "block 7: ref_cnt -1 != 0 holders" in msg


def test_double_free_a_referenced_block_back_in_the_queue():
    m = _mgr()
    m.pool.free_queue.append(m.pool.blocks[2])  # "c" still holds it
    msg = _violation(m)
    assert "block 2: referenced (ref_cnt 1) but in the free queue" in msg
    assert "free 6 + used 3 != usable blocks 8" in msg


def test_foreign_block_object_in_the_queue():
    m = _mgr()
    m.pool.free_queue.remove(m.pool.blocks[4])
    m.pool.free_queue.append(KVCacheBlock(4))
    assert _violation(m) == "free queue holds a foreign block object for id 4"


def test_block_twice_in_one_table_and_a_table_short_of_slots():
    m = _mgr()
    t = m.get_block_table("c")
    t.blocks.append(t.blocks[0])
    t.num_tokens = 3
    msg = _violation(m)
    assert "table c: a block appears twice: [2, 2]" in msg
    assert "block 2: ref_cnt 1 != 2 holders" in msg
    m = _mgr()
    m.get_block_table("a").num_tokens = 9  # 2 blocks hold 8 slots
    assert "table a: 9 tokens but 2 blocks" in _violation(m)


def test_prefix_cache_entry_and_block_hash_must_agree():
    m = _mgr()
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    m.pool.cached[h1] = m.pool.blocks[3]  # an entry pointing at a block without that hash
    msg = _violation(m)
    assert f"cache entry {h1.hex()[:12]} points at block 3 with hash None" in msg
    m = _mgr()
    m.pool.blocks[6].block_hash = h2  # a hash the cache map does not know
    assert _violation(m) == "block 6: carries a hash the cache map does not point at it for"


def test_step_fence_holds_count_as_holders():
    m = _mgr()
    sid = m.begin_step(["c"])
    m.free("c")  # held until the step ends
    assert m.pool.blocks[2].ref_cnt == 1 and check_invariants(m) == 8
    m.pool.blocks[2].ref_cnt = 0
    m.pool.free_queue.append(m.pool.blocks[2])
    assert _violation(m) == "block 2: ref_cnt 0 != 1 holders"
    m.pool.free_queue.remove(m.pool.blocks[2])
    m.pool.blocks[2].ref_cnt = 1
    m.end_step(sid)
    assert m.pool.blocks[2].ref_cnt == 0 and check_invariants(m) == 8


def test_more_than_twenty_problems_are_counted():
    m = KVCacheManager(30, BS)
    for b in m.pool.blocks:
        m.pool.free_queue.remove(b)
    msg = _violation(m)
    assert msg.endswith("(+11 more)")  # 30 leaked blocks + the free/used count: 31 problems
    assert msg.count("(leaked)") == 20


def test_null_block_of_a_hybrid_manager():
    m = KVCacheManager(12, BS, layer_windows=[None, 8])
    m.allocate_slots("a", 6, 0)
    assert check_invariants(m) == 12
    null = m.pool.null_block
    null.ref_cnt = 1
    assert f"null block {null.block_id}: ref_cnt 1, cached False, queued False" in _violation(m)
    null.ref_cnt = 0
    assert m.get_group_block_ids("a") == [[1, 2], [3, 4]]
    full = m.get_block_table("a", group=0)
    full.blocks[1] = null  # the null block in a full-attention table
    assert _violation(m) == ("table a: id list [1, 2] != its blocks; table a: the null block past its 0 "
                             "leading placeholders; block 2: ref_cnt 1 != 0 holders")


def test_group_tables_must_agree():
    m = KVCacheManager(12, BS, layer_windows=[None, 8])
    m.allocate_slots("a", 6, 0)
    m.get_block_table("a", group=1).num_tokens = 5
    assert "table a (group 1): 5 tokens, group 0 has 6" in _violation(m)
    m = KVCacheManager(12, BS, layer_windows=[None, 8])
    m.allocate_slots("a", 6, 0)
    m.group_tables[1].pop("a")
    assert "group 1: requests ['a'] lack a table in some group" in _violation(m)
