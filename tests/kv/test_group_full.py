"""FullAttentionGroup (pagedkv/kv/group_full.py) on its own over a BlockPool of 8 blocks of
4 tokens (ids handed out 0, 1, 2, ...): sizing, allocation plans, copy-on-write, fork, trim,
free, and its own prefix-hash chain. The group returns what it drops; it never releases."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvalidRequestError, NoFreeBlocksError
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.group_full import FullAttentionGroup
from pagedkv.kv.manager import GROUP_TYPES
from pagedkv.kv.prefix_cache import sha256_block_hash

TOKENS = list(range(100, 112))


def _ids(blocks):
    return [b.block_id for b in blocks]


def _admit(group: FullAttentionGroup, rid: str, n: int) -> None:
    table, n_fresh, cow, revived = group.plan(rid, n, 0, (), 0)
    assert (table, cow, revived) == (None, [], 0)
    group.extend(group.open_table(rid, ()), n_fresh, n)


def test_plan_sizes_and_extend_appends_blocks_in_free_queue_order():
    pool = BlockPool(8)
    g = FullAttentionGroup(0, None, 4, pool)
    assert (g.kind, g.needs_whole_prefix, g.tag) == ("full", True, None)
    assert g.first_live_block(100) == 0 and g.blocks_held(10) == 3 and g.blocks_held(10, chunk=4) == 3
    assert g.plan("a", 10, 0, (), 0)[1] == 3
    assert g.plan("a", 10, 0, (), 6)[1] == 6  # a contiguous reservation of 6 blocks
    _admit(g, "a", 10)
    assert g.tables["a"].ids == [0, 1, 2] and g.tables["a"].num_tokens == 10
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0, 0, 0, 0, 0]
    with pytest.raises(InvalidRequestError, match="12 computed tokens but only 12 slots|13 computed"):
        g.plan("a", 1, 13, (), 0)


def test_fork_shares_and_copy_on_write_returns_the_copy_and_the_dropped_block():
    pool = BlockPool(8)
    g = FullAttentionGroup(0, None, 4, pool)
    _admit(g, "a", 10)
    g.fork("a", "b")
    assert g.tables["b"].ids == [0, 1, 2] and [b.ref_cnt for b in pool.blocks[:3]] == [2, 2, 2]
    table, n_fresh, cow, _ = g.plan("b", 1, 10, (), 0)
    assert (n_fresh, cow) == (0, [2])  # block 2 holds 2 written slots and is shared
    copies, dropped = g.copy_on_write(table, cow, 10)
    assert copies == [(2, 3)] and _ids(dropped) == [2] and g.tables["b"].ids == [0, 1, 3]
    assert dropped[0].ref_cnt == 2  # the caller drops it (behind the step fence)


def test_pop_and_trim_return_blocks_tail_first_without_releasing():
    pool = BlockPool(8)
    g = FullAttentionGroup(0, None, 4, pool)
    _admit(g, "a", 10)
    assert _ids(g.trim("a", 5)) == [2] and g.tables["a"].ids == [0, 1] and g.tables["a"].num_tokens == 5
    with pytest.raises(InvalidRequestError, match="has no 6 token slots"):
        g.trim("a", 6)
    assert _ids(g.pop("a")) == [1, 0] and g.pop("a") == [] and "a" not in g.tables
    assert [b.ref_cnt for b in pool.blocks[:3]] == [1, 1, 1]


def test_publish_and_lookup_use_the_groups_own_hash_chain():
    pool = BlockPool(8)
    g0 = FullAttentionGroup(0, None, 4, pool)
    g1 = FullAttentionGroup(1, None, 4, pool)
    assert g1.tag == "group=1,window=None" and g1.keys(None).kv_group == g1.tag
    _admit(g0, "a", 10)
    assert g0.publish("a", TOKENS[:10], 10, None, sha256_block_hash) == 2  # blocks 0, 1 are full
    assert g0.publish("a", TOKENS[:10], 10, None, sha256_block_hash) == 0  # each hashed once
    assert _ids(g0.lookup(TOKENS, None, 3, sha256_block_hash, None)) == [0, 1]  # stops at the miss
    assert g1.lookup(TOKENS, None, 3, sha256_block_hash, None) == []  # another group's chain
    hits = g0.lookup(TOKENS, None, 2, sha256_block_hash, None)
    assert g0.check_hits("b", hits) == 0  # referenced by "a": nothing revived
    pool.reset_prefix_cache()
    with pytest.raises(InvalidRequestError, match="stale"):
        g0.check_hits("b", hits)


def test_the_registry_names_each_group_type_by_its_kind():
    assert {k: c.__name__ for k, c in GROUP_TYPES.items()} == {
        "full": "FullAttentionGroup", "sliding_window": "SlidingWindowGroup"}
    assert all(c.kind == k for k, c in GROUP_TYPES.items())


def test_append_in_place_is_the_decode_fast_path_and_declines_what_needs_a_plan():
    pool = BlockPool(4)
    g = FullAttentionGroup(0, None, 4, pool)
    assert g.append_in_place("a", 1, 0, True) is False  # no table yet
    _admit(g, "a", 6)  # blocks 0, 1
    assert g.append_in_place("a", 1, 6, True) and g.tables["a"].num_tokens == 7  # into private block 1
    assert g.append_in_place("a", 1, 7, True) and g.tables["a"].ids == [0, 1]
    assert g.append_in_place("a", 2, 8, True) and g.tables["a"].ids == [0, 1, 2]  # a new logical block
    assert g.append_in_place("a", 1, 12, False) is False  # unpaged: the plan decides
    g.fork("a", "b")
    assert g.append_in_place("b", 1, 10, True) is False  # block 2 is shared: copy-on-write first
    assert g.tables["b"].num_tokens == 10
    with pytest.raises(NoFreeBlocksError, match="needs 2 new blocks, 1 free"):
        g.append_in_place("a", 5, 12, True)
    assert g.tables["a"].ids == [0, 1, 2] and pool.num_free == 1
