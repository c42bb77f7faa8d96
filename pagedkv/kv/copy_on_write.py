"""Copy-on-write (seed §04): a block that a request is about to write but that it does not
own alone (forked: ``ref_cnt > 1``) or that is published to the prefix cache (its K/V must stay
what its hash says) is first replaced by a fresh private block. Its written slots are copied
(``(src, dst)`` pairs the runner applies before the step's writes); a block none of whose
slots were written yet is just replaced. The replaced block's reference is dropped by the
caller (behind the step fence). Used by every KV group manager (``pagedkv.kv.group_full``).
"""

from __future__ import annotations

from pagedkv.kv.block_pool import BlockPool, KVCacheBlock
from pagedkv.kv.block_table import BlockTable, blocks_needed


def cow_indices(table: BlockTable, num_computed_tokens: int, total: int) -> list[int]:
    """Logical blocks of ``table`` that a step writing positions ``num_computed_tokens ..
    total - 1`` writes into and that are shared or published: they need a private copy."""
    bs = table.block_size
    blocks = table.blocks
    return [i for i in range(num_computed_tokens // bs, min(len(blocks), blocks_needed(total, bs)))
            if blocks[i].ref_cnt > 1 or blocks[i].block_hash is not None]


def copy_on_write(pool: BlockPool, table: BlockTable, cow: list[int],
                  num_computed_tokens: int) -> tuple[list[tuple[int, int]], list[KVCacheBlock]]:
    """Give entries ``cow`` of ``table`` fresh blocks from ``pool`` (raises
    ``NoFreeBlocksError`` if it has too few). Returns ``(copies, dropped)``: ``(src, dst)`` for
    each replaced block with written slots (before ``num_computed_tokens``), and the replaced
    blocks, in ``cow`` order, whose references the caller drops."""
    bs = table.block_size
    copies, dropped = [], []
    for i, dst in zip(cow, pool.allocate(len(cow))):
        src = table.replace(i, dst)
        dropped.append(src)
        if i * bs < num_computed_tokens:
            copies.append((src.block_id, dst.block_id))
    return copies, dropped
