"""StepFences (pagedkv/kv/fences.py) on its own over a BlockPool: a drop for a request an
open step uses is held until every such step ends; other drops release at once."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.fences import StepFences


def Fences(num_blocks: int) -> StepFences:
    return StepFences(BlockPool(num_blocks), tiers=None)


def refs(f: StepFences) -> list[int]:
    return [b.ref_cnt for b in f.pool.blocks]


def test_a_drop_outside_any_step_releases_at_once():
    f = Fences(4)
    a = f.pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    other = f.begin_step(["b"])
    f.drop("a", a)  # "a" is not in the open step
    assert refs(f) == [0, 0, 0, 0] and f.pool.free_queue.ids() == [2, 3, 0, 1]
    assert f.holds == [] and f.num_deferred_frees == 0
    f.end_step(other)


def test_a_drop_for_a_request_in_flight_is_held_until_its_step_ends():
    f = Fences(4)
    a = f.pool.allocate(2)  # blocks 0, 1
    s = f.begin_step(["a", "b"])
    f.drop("a", a)
    assert refs(f) == [1, 1, 0, 0] and f.pool.free_queue.ids() == [2, 3]
    assert [(rid, [b.block_id for b in bl], w) for rid, bl, w in f.holds] == [("a", [0, 1], {s})]
    assert f.num_deferred_frees == 1
    assert [b.block_id for b in f.pool.allocate(2)] == [2, 3]  # the held blocks are not handed out
    f.end_step(s)
    assert refs(f) == [0, 0, 1, 1] and f.pool.free_queue.ids() == [0, 1]  # released in the given order
    assert f.holds == [] and f.open_steps == {}


def test_a_hold_waits_for_every_open_step_that_used_the_request():
    f = Fences(3)
    blocks = f.pool.allocate(1)  # block 0
    s1 = f.begin_step(["a"])
    s2 = f.begin_step(["a", "c"])
    assert (s1, s2) == (1, 2)
    f.drop("a", blocks)
    f.end_step(s2)  # the later step ends first: s1 may still read block 0
    assert refs(f) == [1, 0, 0] and [w for _, _, w in f.holds] == [{s1}]
    f.end_step(s1)
    assert refs(f) == [0, 0, 0] and f.pool.free_queue.ids() == [1, 2, 0]


def test_ending_a_step_twice_is_a_no_op_and_an_unknown_id_raises():
    f = Fences(2)
    s = f.begin_step([])
    f.end_step(s)
    f.end_step(s)
    with pytest.raises(InvalidRequestError, match="unknown step id 7"):
        f.end_step(7)
    with pytest.raises(InvalidRequestError):
        f.end_step("1")
