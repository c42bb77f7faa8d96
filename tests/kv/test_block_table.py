"""BlockTable at block_size 4 (its slots are ``physical_block * block_size + offset``; the batch
builder is tested in test_slot_mapping.py) and the per-request block count."""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError
from pagedkv.kv import BlockPool
from pagedkv.kv.block_table import BlockTable

BS = 4


def table(ids: list[int], num_tokens: int = 0) -> BlockTable:
    pool = BlockPool(16)
    return BlockTable(BS, [pool.blocks[i] for i in ids], num_tokens)


def test_positions_map_to_physical_slots():
    t = table([7, 2, 5])
    assert t.ids == [7, 2, 5] and len(t) == 3 and t.num_slots == 12
    assert t.physical(0) == (7, 0) and t.physical(5) == (2, 1) and t.physical(11) == (5, 3)
    assert [t.slot(p) for p in (0, 3, 4, 9)] == [28, 31, 8, 21]
    assert t.slot_mapping(2, 7).tolist() == [30, 31, 8, 9, 10]


def test_append_and_replace_keep_the_id_list():
    pool = BlockPool(16)
    t = BlockTable(BS, [pool.blocks[3]])
    t.append([pool.blocks[4], pool.blocks[9]])
    old = t.replace(1, pool.blocks[12])  # copy-on-write of logical block 1
    assert old is pool.blocks[4] and t.ids == [3, 12, 9]
    ids = t.ids
    ids.append(99)  # a copy: the table is unchanged
    assert t.ids == [3, 12, 9]


def test_nullify_swaps_the_front_for_the_placeholder_once():
    pool = BlockPool(8, reserve_null=True)
    t = BlockTable(BS, [pool.blocks[i] for i in (3, 4, 5, 6)])
    gone = t.nullify(2, pool.null_block)
    assert [b.block_id for b in gone] == [3, 4] and t.ids == [0, 0, 5, 6] and t.num_null == 2
    assert [b.block_id for b in t.live_blocks] == [5, 6]
    assert t.nullify(2, pool.null_block) == [] and t.nullify(1, pool.null_block) == []
    assert [b.block_id for b in t.nullify(3, pool.null_block)] == [5] and t.ids == [0, 0, 0, 6]


def test_request_blocks_needed_sums_blocks_needed_over_the_layer_groups():
    from pagedkv.kv.block_table import request_blocks_needed

    assert request_blocks_needed(20, 4) == 5  # one full group
    assert request_blocks_needed(20, 4, (None, 8)) == 5 + 2  # window 8: blocks of positions 12..19
    assert request_blocks_needed(20, 4, (None, 8), chunk=8) == 5 + 5  # min(5, ceil(15 / 4) + 1)
    assert request_blocks_needed(0, 4, (None, 8, 8)) == 0
    with pytest.raises(ConfigError, match="window"):
        request_blocks_needed(20, 4, (None, 0))
