"""KVCacheManager scenarios at block_size 4, each its own test."""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError, InvalidRequestError, InvariantViolation, NoFreeBlocksError
from pagedkv.kv import CacheKeys, KVCacheManager, check_invariants, hash_blocks

BS = 4


def mgr(num_blocks=8, prefix=True, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix, **kw)


def run_prompt(m, rid, tokens, keys=None, chunk=None):
    """Admit a prompt like the engine does: look up, allocate, write, publish."""
    hits, cached = m.get_computed_blocks(rid, tokens, keys)
    chunk = chunk or len(tokens) - cached
    copies = m.allocate_slots(rid, chunk, cached, new_computed_blocks=hits)
    m.cache_blocks(rid, tokens, cached + chunk, keys)
    return hits, cached, copies


def refs(m):
    return [b.ref_cnt for b in m.pool.blocks]


# ---------------------------------------------------------------- prefix caching
def test_same_8_token_prompt_hits_one_block_and_leaves_the_last_token():
    m = mgr()
    p = list(range(100, 108))
    run_prompt(m, "a", p)
    assert m.get_block_ids("a") == [0, 1]
    assert len(m.pool.cached) == 2
    m.free("a")
    hits, cached = m.get_computed_blocks("b", p, None)
    assert [b.block_id for b in hits] == [0] and cached == 4
    m.allocate_slots("b", 4, 4, new_computed_blocks=hits)
    # Block 0 revived from the free queue; block 1 (the prompt's tail) is still cached
    # and free, but the tail must be computed, so b takes a fresh block.
    assert m.get_block_ids("b")[0] == 0 and m.pool.blocks[0].ref_cnt == 1
    assert m.stats.prefix_queries == 16 and m.stats.prefix_hits == 4
    check_invariants(m)


def test_7_token_prompt_never_shares_its_partial_block():
    m = mgr()
    p = list(range(7))
    run_prompt(m, "a", p)
    assert len(m.pool.cached) == 1  # only block 0 is full
    hits, cached = m.get_computed_blocks("b", p, None)
    assert [b.block_id for b in hits] == [0] and cached == 4
    m.allocate_slots("b", 3, 4, new_computed_blocks=hits)
    assert m.get_block_ids("a") == [0, 1] and m.get_block_ids("b") == [0, 2]
    assert refs(m)[:3] == [2, 1, 1]
    check_invariants(m)


def test_salt_7_vs_adapter_7_never_hit_and_same_salt_does():
    m = mgr()
    p = list(range(9))
    salt, adapter = CacheKeys(cache_salt="7"), CacheKeys(adapter_id=7)
    assert salt != adapter
    assert hash_blocks(p, BS, salt) != hash_blocks(p, BS, adapter)
    run_prompt(m, "a", p, salt)
    assert m.get_computed_blocks("b", p, adapter) == ([], 0)
    assert m.get_computed_blocks("b", p, CacheKeys(adapter_id="7")) == ([], 0)
    assert m.get_computed_blocks("b", p, None) == ([], 0)
    hits, cached = m.get_computed_blocks("c", p, CacheKeys(cache_salt="7"))
    assert [b.block_id for b in hits] == [0, 1] and cached == 8


def test_model_revision_isolates_cache():
    m = mgr()
    p = list(range(9))
    run_prompt(m, "a", p, CacheKeys(model_id="m", revision="r1"))
    assert m.get_computed_blocks("b", p, CacheKeys(model_id="m", revision="r2")) == ([], 0)
    assert m.get_computed_blocks("b", p, CacheKeys(model_id="m", revision="r1"))[1] == 8


def test_different_multimodal_hashes_miss_the_blocks_covering_them():
    m = mgr(num_blocks=12)
    p = [1] * 13  # identical placeholder text
    img1 = CacheKeys(mm_hashes=(("img-1", 4, 4),))  # covers logical block 1
    img2 = CacheKeys(mm_hashes=(("img-2", 4, 4),))
    run_prompt(m, "a", p, img1)
    hits, cached = m.get_computed_blocks("b", p, img2)
    assert [b.block_id for b in hits] == [0] and cached == 4  # block 0 precedes the image
    hits, cached = m.get_computed_blocks("c", p, img1)
    assert [b.block_id for b in hits] == [0, 1, 2] and cached == 12


def test_hash_collision_never_serves_wrong_kv():
    # Every block hashes to the same value: the stored token ids tell them apart.
    m = mgr(hash_fn=lambda parent, tokens, extra: b"same")
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    assert m.get_computed_blocks("b", [9, 9, 9, 9, 5], None) == ([], 0)
    hits, cached = m.get_computed_blocks("c", [1, 2, 3, 4, 5], None)
    assert [b.block_id for b in hits] == [0] and cached == 4


def test_eviction_unregisters_the_hash():
    m = mgr(num_blocks=3)
    run_prompt(m, "a", list(range(9)))  # blocks 0, 1 cached; 2 holds the partial tail
    m.free("a")
    assert m.pool.free_queue.ids() == [2, 1, 0]  # tail first: evicted first
    m.allocate_slots("b", 8, 0)  # takes 2 then 1: block 1's hash is evicted
    assert m.get_block_ids("b") == [2, 1]
    assert m.stats.evictions == 1 and len(m.pool.cached) == 1
    assert m.pool.blocks[1].block_hash is None
    hits, cached = m.get_computed_blocks("c", list(range(9)), None)
    assert [b.block_id for b in hits] == [0] and cached == 4
    check_invariants(m)


def test_stale_hit_is_rejected():
    m = mgr(num_blocks=2)
    run_prompt(m, "a", list(range(5)))
    m.free("a")
    hits, _ = m.get_computed_blocks("b", list(range(5)), None)
    m.allocate_slots("x", 8, 0)  # evicts block 0 behind b's back
    with pytest.raises(InvalidRequestError, match="stale"):
        m.allocate_slots("b", 1, 4, new_computed_blocks=hits)


def test_10_token_prompt_in_chunks_of_6_then_aborted_publishes_only_block_0():
    m = mgr()
    p = list(range(50, 60))
    m.allocate_slots("a", 6, 0)
    s1 = m.begin_step(["a"])
    m.end_step(s1)
    m.cache_blocks("a", p, 6, None)  # tokens 0..5 written: block 0 full, block 1 half
    assert len(m.pool.cached) == 1
    m.allocate_slots("a", 4, 6)
    s2 = m.begin_step(["a"])
    m.free("a")  # aborted while the second chunk is in flight
    m.end_step(s2)
    assert len(m.pool.cached) == 1
    assert m.pool.blocks[0].block_hash is not None
    assert [b.block_hash for b in m.pool.blocks[1:]] == [None] * 7
    assert refs(m) == [0] * 8
    check_invariants(m)


# ---------------------------------------------------------------- fences and free
def test_blocks_finished_at_step_n_are_not_handed_out_before_its_fence():
    m = mgr(num_blocks=4, prefix=False)
    m.allocate_slots("a", 8, 0)  # blocks 0, 1
    m.allocate_slots("b", 4, 0)  # block 2
    n = m.begin_step(["a", "b"])
    m.free("a")  # finished at step N, N still in flight
    assert refs(m) == [1, 1, 1, 0] and m.num_free_blocks == 1
    assert m.stats.deferred_frees == 1
    # Step N+1 wants two blocks: only block 3 is free, so nothing is handed out.
    assert not m.can_allocate("c", 8, 0)
    with pytest.raises(NoFreeBlocksError):
        m.allocate_slots("c", 8, 0)
    assert m.get_block_ids("c") == [] and refs(m) == [1, 1, 1, 0]
    m.allocate_slots("c", 4, 0)
    assert m.get_block_ids("c") == [3]
    check_invariants(m)
    m.end_step(n)
    assert refs(m) == [0, 0, 1, 1] and m.pool.free_queue.ids() == [1, 0]
    check_invariants(m)


def test_abort_twice_and_abort_while_finishing_free_once():
    m = mgr(num_blocks=4, prefix=False)
    m.allocate_slots("a", 6, 0)
    s = m.begin_step(["a"])
    m.free("a")  # abort during the step
    m.free("a")  # abort again
    m.free("a")  # and the finish path frees too
    assert refs(m) == [1, 1, 0, 0]
    m.end_step(s)
    m.end_step(s)  # ending twice is a no-op
    m.free("a")
    assert refs(m) == [0, 0, 0, 0]
    assert sorted(m.pool.free_queue.ids()) == [0, 1, 2, 3] and len(m.pool.free_queue) == 4
    check_invariants(m)
    with pytest.raises(InvalidRequestError):
        m.end_step(99)


def test_fork_of_6_token_sequence_copies_the_half_full_block_on_first_write():
    m = mgr(num_blocks=6, prefix=False)
    m.allocate_slots("p", 6, 0)
    assert m.get_block_ids("p") == [0, 1]
    m.fork("p", "c")
    assert m.get_block_ids("c") == [0, 1] and refs(m)[:2] == [2, 2]
    # The parent appends first: the shared half-full block 1 is copied before the write.
    assert m.allocate_slots("p", 1, 6) == [(1, 2)]
    assert m.get_block_ids("p") == [0, 2] and refs(m)[:3] == [2, 1, 1]
    # The child now holds block 1 alone: it writes in place, no copy.
    assert m.allocate_slots("c", 1, 6) == []
    assert m.get_block_ids("c") == [0, 1]
    assert m.stats.cow_copies == 1
    check_invariants(m)
    m.free("p")
    m.free("c")
    assert refs(m) == [0] * 6
    check_invariants(m)


def test_fork_child_writes_first_and_full_shared_blocks_are_never_copied():
    m = mgr(num_blocks=6, prefix=False)
    m.allocate_slots("p", 8, 0)  # two full blocks
    m.fork("p", "c")
    assert m.allocate_slots("c", 1, 8) == []  # a new logical block: no copy
    assert m.get_block_ids("c") == [0, 1, 2] and refs(m)[:3] == [2, 2, 1]


def test_cow_source_is_held_by_the_fence():
    m = mgr(num_blocks=4, prefix=False)
    m.allocate_slots("p", 6, 0)
    m.fork("p", "c")
    s = m.begin_step(["p", "c"])
    m.free("c")  # c aborted mid-step: its refs are held
    assert m.allocate_slots("p", 1, 6) == [(1, 2)]  # block 1 still shared with the fence hold
    m.end_step(s)
    assert refs(m) == [1, 0, 1, 0]
    check_invariants(m)


# ---------------------------------------------------------------- allocation basics
def test_allocation_is_all_or_nothing():
    m = mgr(num_blocks=3, prefix=False)
    m.allocate_slots("a", 4, 0)
    before = m.snapshot()
    with pytest.raises(NoFreeBlocksError):
        m.allocate_slots("b", 12, 0)
    with pytest.raises(NoFreeBlocksError):
        m.allocate_slots("a", 9, 4)
    assert m.snapshot() == before
    assert m.get_block_ids("b") == [] and not m.has_request("b")


def test_contiguous_reservation_and_max_model_len():
    m = KVCacheManager(8, BS, enable_paging=False, max_model_len=10)
    m.allocate_slots("a", 1, 0)
    assert m.get_block_ids("a") == [0, 1, 2]
    m.allocate_slots("a", 9, 1)
    assert m.get_block_ids("a") == [0, 1, 2]
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        m.allocate_slots("a", 1, 10)
    with pytest.raises(ConfigError, match="max_model_len"):
        KVCacheManager(8, BS, enable_paging=False)


def test_shuffle_seed_shuffles_physical_ids():
    m = KVCacheManager(8, BS, shuffle_seed=1)
    m.allocate_slots("a", 32, 0)
    ids = m.get_block_ids("a")
    assert sorted(ids) == list(range(8)) and ids != list(range(8))
    assert ids == KVCacheManager(8, BS, shuffle_seed=1).pool.free_queue.ids()


def test_bad_input_is_typed():
    for bs in (0, -4):
        with pytest.raises(ConfigError, match="block_size"):
            KVCacheManager(4, bs)
    with pytest.raises(ConfigError, match="num_blocks"):
        KVCacheManager(0, 4)
    m = mgr(prefix=False)
    with pytest.raises(InvalidRequestError):
        m.allocate_slots("a", -1, 0)
    with pytest.raises(InvalidRequestError):
        m.allocate_slots("a", 1, 5)  # computed tokens without slots
    with pytest.raises(InvalidRequestError):
        m.fork("nobody", "x")
    m.allocate_slots("a", 1, 0)
    with pytest.raises(InvalidRequestError):
        m.fork("a", "a")
    with pytest.raises(InvalidRequestError):
        CacheKeys(mm_hashes=(("h", -1, 2),))


def test_snapshot_lists_blocks_owners_and_tables():
    m = mgr(num_blocks=4, prefix=False)
    m.allocate_slots("a", 5, 0)
    m.fork("a", "b")
    snap = m.snapshot()
    assert snap["blocks"][0] == {"block_id": 0, "ref_cnt": 2, "is_cached": False, "is_free": False,
                                 "owners": ["a", "b"]}
    assert snap["blocks"][3]["owners"] == [] and snap["blocks"][3]["is_free"]
    assert snap["tables"] == {"a": {"block_ids": [0, 1], "num_tokens": 5},
                              "b": {"block_ids": [0, 1], "num_tokens": 5}}
    assert snap["free_queue"] == [2, 3] and snap["usage"] == 0.5


def test_invariant_checker_catches_corruption():
    m = mgr(num_blocks=4, prefix=False)
    m.allocate_slots("a", 5, 0)
    m.pool.blocks[0].ref_cnt = 2
    with pytest.raises(InvariantViolation, match="block 0: ref_cnt 2 != 1 holders"):
        check_invariants(m)
    m.pool.blocks[0].ref_cnt = 1
    m.pool.free_queue._q[1] = m.pool.blocks[1]  # a referenced block in the free queue
    with pytest.raises(InvariantViolation, match="referenced"):
        check_invariants(m)


def test_decode_fast_paths_match_the_general_path():
    m = mgr(num_blocks=4, prefix=False)
    m.allocate_slots("a", 4, 0)
    assert m.allocate_slots("a", 1, 4) == [] and m.get_block_ids("a") == [0, 1]  # new block
    assert m.allocate_slots("a", 1, 5) == [] and m.get_block_ids("a") == [0, 1]  # same block
    with pytest.raises(InvalidRequestError, match="computed tokens"):
        m.allocate_slots("a", 1, 9)  # 9 computed tokens but only 8 slots
    m.allocate_slots("b", 8, 0)
    before = m.snapshot()
    with pytest.raises(NoFreeBlocksError):
        m.allocate_slots("a", 1, 8)  # needs a 5th block
    assert m.snapshot() == before
    assert m.num_tokens("a") == 6
    check_invariants(m)
