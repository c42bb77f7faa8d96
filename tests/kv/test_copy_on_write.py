"""Copy-on-write (pagedkv/kv/copy_on_write.py) at block size 4 over a pool handing out 0, 1, 2, ..."""

from __future__ import annotations

from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.block_table import BlockTable
from pagedkv.kv.copy_on_write import copy_on_write, cow_indices


def test_shared_or_published_blocks_written_by_the_step_are_copied_once_written():
    pool = BlockPool(8)
    blocks = pool.allocate(3)  # 0, 1, 2: a table of 10 tokens
    t = BlockTable(4, blocks, 10)
    assert cow_indices(t, 10, 11) == []  # private, unpublished: written in place
    pool.touch([blocks[2]])  # block 2 now shared (a fork)
    assert cow_indices(t, 10, 11) == [2] and cow_indices(t, 4, 11) == [2]
    pool.publish(blocks[1], b"h" * 32, None, b"t", b"")  # block 1 published
    assert cow_indices(t, 4, 11) == [1, 2] and cow_indices(t, 8, 12) == [2]
    copies, dropped = copy_on_write(pool, t, [1, 2], 6)
    # block 1 holds written slots (4, 5 < 6): copied; block 2 (slots from 8) just replaced
    assert copies == [(1, 3)] and [b.block_id for b in dropped] == [1, 2] and t.ids == [0, 3, 4]
    assert [b.ref_cnt for b in pool.blocks[:5]] == [1, 1, 2, 1, 1]  # the caller drops 1 and 2
