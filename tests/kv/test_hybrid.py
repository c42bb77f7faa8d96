"""Hybrid KV manager: layer groups (full + sliding window) with real block ids.

Layout used throughout: 4 layers, ``[full, window 8, full, window 8]``, block size 4, so
group 0 = full, group 1 = window 8; the null block is id 0 and the free queue hands out
1, 2, 3, ... A step computing from position ``p`` needs window blocks from
``(p - 7) // 4`` on.
"""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError, InvalidRequestError, InvariantViolation, NoFreeBlocksError
from pagedkv.kv import KVCacheManager, KVCacheSpec, check_invariants
from pagedkv.kv.groups import MAX_GROUPS, LayerGroups, longest_valid_hit

WINDOWS = [None, 8, None, 8]


def mgr(num_blocks: int = 24, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, layer_windows=WINDOWS, **kw)


def run(m: KVCacheManager, rid: str, start: int, end: int) -> None:
    """Decode positions ``start .. end-1`` one step each (fence opened and closed)."""
    for p in range(start, end):
        m.allocate_slots(rid, 1, p)
        m.end_step(m.begin_step([rid]))


def test_groups_from_layer_windows():
    g = LayerGroups.from_layer_windows([8, None, 8, None])  # equal kinds: one group each
    assert g.windows == (None, 8) and g.layer_group == (1, 0, 1, 0)
    assert g.slot_of_layer == [0, 0, 1, 1]
    assert g.max_layers == 2 and g.is_hybrid and g.page_waste == 0
    assert [g.first_live_block(1, p, 4) for p in (0, 7, 8, 11, 12)] == [0, 0, 0, 1, 1]
    # unequal kinds are cut into groups of the smallest kind's size (here 1 layer)
    g = LayerGroups.from_layer_windows([8, None, 8, None, 16])
    assert g.windows == (None, None, 8, 8, 16)
    assert g.layer_group == (2, 0, 3, 1, 4)
    assert g.slot_of_layer == [0] * 5 and g.max_layers == 1 and g.page_waste == 0
    # ... but never more than about MAX_GROUPS groups: 1 full + 20 window layers -> groups of 3
    g = LayerGroups.from_layer_windows([None] + [4] * 20)
    assert MAX_GROUPS == 8 and g.windows == (None,) + (4,) * 7
    assert g.layer_group == (0,) + tuple(1 + i // 3 for i in range(20))
    assert g.max_layers == 3 and g.page_waste == pytest.approx(1 - 21 / 24)
    assert not LayerGroups.from_layer_windows(None, 3).is_hybrid
    with pytest.raises(ConfigError):
        LayerGroups.from_layer_windows([0, None])


def test_gemma3_12b_groups_and_plan():
    """The shipped Gemma-3-12B config: 8 full + 40 window-1024 layers -> one full group and five
    window groups of 8 layers; a 32k request holds 2048 + 5 x 64 block ids of 8 layers each =
    0.1927x the all-full bytes (one 40-layer group would have been 0.8594x)."""
    from pagedkv.examples.capacity_plan import group_plan

    spec = KVCacheSpec.from_hf_config("gemma-3-12b", dtype="bf16")
    g = spec.groups
    assert g.windows == (None,) + (1024,) * 5 and g.max_layers == 8 and g.page_waste == 0
    assert g.layers_of(0) == list(range(5, 48, 6))
    assert g.layers_of(1) == [0, 1, 2, 3, 4, 6, 7, 8]
    plan = group_plan(spec, 20 * 2**30, 16, 32768)
    assert [x["blocks_per_request"] for x in plan["groups"]] == [2048] + [64] * 5
    assert plan["hybrid"]["block_bytes"] == 16 * 2 * 8 * 256 * 2 * 8 == 1_048_576
    assert plan["hybrid"]["bytes_per_request"] == (2048 + 5 * 64) * 1_048_576
    assert plan["all_full"]["bytes_per_request"] == 2048 * 1_048_576 * 6
    assert plan["bytes_per_request_ratio"] == pytest.approx(2368 / (2048 * 6))


def test_window_blocks_freed_exactly_after_the_step_fence():
    m = mgr()
    assert m.null_block.block_id == 0 and m.num_free_blocks == 23  # block 0 never handed out
    m.allocate_slots("a", 8, 0)
    assert m.get_group_block_ids("a") == [[1, 2], [3, 4]]
    m.end_step(m.begin_step(["a"]))
    run(m, "a", 8, 10)
    assert m.get_group_block_ids("a") == [[1, 2, 5], [3, 4, 6]]
    in_flight = m.begin_step(["a"])  # the step that computed position 10 is still running
    assert m.allocate_slots("a", 1, 11) == []  # the query at 11 sees 4..11: block 3 is out
    assert m.get_group_block_ids("a") == [[1, 2, 5], [0, 4, 6]]  # placeholder = null block
    assert m.pool.blocks[3].ref_cnt == 1 and 3 not in m.pool.free_queue.ids()  # held
    assert m.held_blocks("a") == [3, 2]
    check_invariants(m)
    m.end_step(in_flight)
    assert m.pool.blocks[3].ref_cnt == 0 and m.pool.free_queue.ids()[-1] == 3
    assert m.stats.window_freed_blocks == 1 and m.stats.deferred_frees == 1
    check_invariants(m)


def test_long_request_holds_window_over_block_size_plus_one():
    m = mgr()
    m.allocate_slots("a", 8, 0)
    run(m, "a", 8, 64)
    # position 63's window 56..63 is blocks 14, 15; at 62 it was 13..15 (W/bs + 1 = 3)
    assert m.held_blocks("a") == [16, 2]
    ids = m.get_group_block_ids("a")
    assert ids[1][:14] == [0] * 14 and ids[1][14:] == [14, 18]
    assert m.get_block_table("a", 1).num_null == 14
    assert m.stats.window_freed_blocks == 14
    check_invariants(m)
    m.free("a")
    assert m.num_free_blocks == 23 and m.num_used_blocks == 0
    check_invariants(m)


def test_admission_and_preemption_count_every_group():
    m = mgr(num_blocks=9)  # 8 usable
    assert m.num_blocks_needed(8) == 4  # 2 blocks x 2 groups
    m.allocate_slots("a", 8, 0)
    m.allocate_slots("b", 4, 0)
    assert m.num_free_blocks == 2
    assert m.can_allocate("c", 4, 0)
    assert not m.can_allocate("c", 5, 0)  # 2 per group = 4 > 2 free
    with pytest.raises(NoFreeBlocksError):
        m.allocate_slots("c", 5, 0)
    assert not m.has_request("c") and m.num_free_blocks == 2  # all or nothing
    with pytest.raises(NoFreeBlocksError, match="needs 4 new blocks"):
        m.allocate_slots("b", 8, 4)  # 2 more blocks in each group, 2 free
    assert m.get_group_block_ids("b") == [[5], [6]]
    m.free("a")  # preemption frees both groups' blocks
    assert m.num_free_blocks == 6
    assert m.allocate_slots("b", 8, 4) == []
    # freed tail first (a: full 2, 1 then window 4, 3): the queue is 7, 8, 2, 1, 4, 3
    assert m.get_group_block_ids("b") == [[5, 7, 8], [6, 2, 1]]
    check_invariants(m)


def test_fork_and_copy_on_write_on_a_window_group():
    m = mgr()
    m.allocate_slots("p", 8, 0)
    run(m, "p", 8, 14)  # positions 0..13; window blocks: 0 -> null
    assert m.get_group_block_ids("p") == [[1, 2, 5, 7], [0, 4, 6, 8]]
    m.fork("p", "c")  # n=2 / beam: the child shares every group, placeholders included
    assert m.get_group_block_ids("c") == m.get_group_block_ids("p")
    assert [m.pool.blocks[i].ref_cnt for i in (1, 2, 5, 7, 4, 6, 8)] == [2] * 7
    assert m.null_block.ref_cnt == 0
    # both write position 14 into the shared, partly filled last block of each group
    assert m.allocate_slots("c", 1, 14) == [(7, 9), (8, 10)]
    assert m.get_group_block_ids("c") == [[1, 2, 5, 9], [0, 4, 6, 10]]
    assert m.allocate_slots("p", 1, 14) == []  # now private again
    check_invariants(m)
    m.free("p")
    m.free("c")
    assert m.num_used_blocks == 0
    check_invariants(m)


def test_no_leak_after_abort_with_steps_in_flight():
    m = mgr()
    m.allocate_slots("a", 8, 0)
    run(m, "a", 8, 20)
    s = m.begin_step(["a"])
    m.allocate_slots("a", 1, 20)
    m.free("a")  # abort mid-step: every group's blocks held until the step ends
    assert m.num_used_blocks == 6 + 3 and len(m.holds) == 1
    check_invariants(m)
    m.end_step(s)
    assert m.num_used_blocks == 0 and m.num_free_blocks == 23 and m.holds == []
    check_invariants(m)


def test_prefix_hit_needs_only_the_window_blocks_before_the_hit():
    m = mgr(enable_prefix_caching=True)
    toks = list(range(100, 124))  # 6 blocks
    m.allocate_slots("a", 24, 0)
    m.cache_blocks("a", toks, 24)
    m.allocate_slots("a", 1, 24)  # the window moves past blocks 0..3 (position 24 sees 17..24)
    assert m.get_group_block_ids("a")[1][:4] == [0, 0, 0, 0]
    m.free("a")
    hits, n = m.get_computed_blocks("b", toks + [1])
    # full group: blocks 0..5; window group at 24 tokens: only blocks 4, 5 (tokens 16..23)
    assert n == 24
    assert [b.block_id for b in hits[0]] == [1, 2, 3, 4, 5, 6]
    assert [b.block_id for b in hits[1]] == [0, 0, 0, 0, 11, 12]
    # one fresh block per group + the 8 hits, which are free cached blocks leaving the queue
    assert m.num_blocks_needed(25, hits) == 10
    m.allocate_slots("b", 1, 24, new_computed_blocks=hits)
    assert m.get_group_block_ids("b") == [[1, 2, 3, 4, 5, 6, 15], [0, 0, 0, 0, 11, 12, 16]]
    assert m.held_blocks("b") == [7, 3]
    check_invariants(m)


def test_prefix_hit_is_the_longest_prefix_valid_in_every_group():
    m = mgr(enable_prefix_caching=True)
    toks = list(range(100, 124))
    m.allocate_slots("a", 24, 0)
    m.cache_blocks("a", toks, 24)
    m.free("a")
    # evict the window group's block 5 (tokens 20..23): a hit of 6 blocks is invalid there
    victim = m.get_computed_blocks("x", toks + [1])[0][1][5]
    m.pool.free_queue._q.move_to_end(victim.block_id, last=False)  # to the front
    m.allocate_slots("y", 1, 0)  # takes the front block: evicts it (its full twin stays)
    hits, n = m.get_computed_blocks("b", toks + [1])
    # 5 blocks (20 tokens): full 0..4 and window blocks 3, 4 (tokens 13..19 + ...) are cached
    assert n == 20
    assert [b.block_id for b in hits[0]] == [1, 2, 3, 4, 5]
    assert [b.block_id for b in hits[1]] == [0, 0, 0, 10, 11]
    assert longest_valid_hit([[True] * 6, [False, True, True, True, True, False]],
                             m.groups, 4, 6) == 5
    assert longest_valid_hit([[True] * 6, [True, False, True, False, True, True]],
                             m.groups, 4, 6) == 6  # 24 tokens need window blocks 4, 5 only
    assert longest_valid_hit([[True, True, False, True, True, True], [True] * 6], m.groups, 4, 6) == 2
    check_invariants(m)


def test_all_window_model_single_group():
    m = KVCacheManager(8, 4, layer_windows=[4, 4])
    assert m.num_groups == 1 and m.null_block is not None
    m.allocate_slots("a", 8, 0)
    assert m.get_block_ids("a") == [1, 2]
    run(m, "a", 8, 13)  # position 12 sees 9..12: blocks 0, 1 out
    assert m.get_block_ids("a") == [0, 0, 3, 4]
    assert m.num_free_blocks == 5
    check_invariants(m)


def test_invariants_see_groups_and_the_null_block():
    m = mgr()
    m.allocate_slots("a", 8, 0)
    m.get_block_table("a", 0).nullify(1, m.null_block)  # a placeholder in a full group
    with pytest.raises(InvariantViolation, match="without a window"):
        check_invariants(m)
    m = mgr()
    m.allocate_slots("a", 8, 0)
    del m.group_tables[1]["a"]
    with pytest.raises(InvariantViolation, match="lack a table"):
        check_invariants(m)


def test_hybrid_refuses_tiers_and_contiguous_reservation():
    with pytest.raises(ConfigError, match="kv tiers"):
        KVCacheManager(8, 4, layer_windows=WINDOWS, tiers=object())
    with pytest.raises(ConfigError, match="enable_paging"):
        KVCacheManager(8, 4, layer_windows=WINDOWS, enable_paging=False, max_model_len=16)
    with pytest.raises(InvalidRequestError):
        mgr().allocate_slots("a", 4, 0, new_computed_blocks=([],))


def test_spec_sizes_gemma2_per_group():
    g = KVCacheSpec.from_hf_config("gemma-2-9b", dtype="bf16")
    assert g.layer_windows[:4] == (4096, None, 4096, None) and len(g.layer_windows) == 42
    assert g.block_bytes(16) == 21 * g.page_size_bytes(16)
    full = KVCacheSpec.from_hf_config("llama-3-8b", dtype="bf16")
    assert full.layer_windows is None and full.block_bytes(16) == 32 * full.page_size_bytes(16)
    # one request at 32k: 2048 full + 256 window blocks, half-size block ids
    assert g.blocks_per_request(32768, 16) == 2304
    assert g.blocks_per_request(32768, 16, chunk=512) == 2048 + 289
    from dataclasses import replace
    ag = replace(g, layer_windows=None)
    assert ag.blocks_per_request(32768, 16) == 2048
    assert g.bytes_per_request(32768, 16) / ag.bytes_per_request(32768, 16) == 0.5625
    assert KVCacheSpec.from_hf_config("mistral-7b").groups.windows == (4096,)
    assert KVCacheSpec.from_hf_config("qwen2.5-7b").layer_windows is None  # use_sliding_window false


def test_one_groups_allocation_never_evicts_another_groups_hit():
    """Found by the hybrid state machine: with the free cached blocks at the front of the free
    queue, the full group's fresh block must not be taken from the window group's hits."""
    m = KVCacheManager(7, 4, enable_prefix_caching=True, layer_windows=WINDOWS)  # 6 usable
    toks = list(range(100, 108))
    m.allocate_slots("a", 8, 0)  # full [1, 2], window [3, 4]
    m.cache_blocks("a", toks, 8)
    m.free("a")  # queue: 5, 6, 2, 1, 4, 3
    m.allocate_slots("x", 1, 0)
    m.free("x")
    m.pool.free_queue._q.move_to_end(4, last=False)  # the window hit is the next block out
    hits, n = m.get_computed_blocks("b", toks + [9, 9, 9])
    assert n == 8 and [[b.block_id for b in h] for h in hits] == [[1, 2], [3, 4]]
    m.allocate_slots("b", 3, 8, new_computed_blocks=hits)
    ids = m.get_group_block_ids("b")
    assert ids[1][:2] == [3, 4] and not set(ids[0]) & set(ids[1])
    assert [m.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 1, 1]
    check_invariants(m)
