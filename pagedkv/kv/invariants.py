"""The memory system's invariants (seed §02, §04), checked from tests and from the engine's
debug flag. ``check_invariants(manager)`` raises ``InvariantViolation`` listing every
broken rule, or returns the number of blocks checked.

1. ``ref_cnt`` of every block == number of live block tables holding it + step-fence holds.
2. No block with ``ref_cnt > 0`` is in the free queue; every block with ``ref_cnt == 0`` is.
3. No id appears twice in the free queue (or twice in one table).
4. free + in use == ``num_blocks``.
5. Every prefix-cache entry ``hash -> block`` points at a block carrying that hash, and a
   block carrying a hash is the entry for it.
6. Every table has a slot for each of its ``num_tokens`` positions.
"""

from __future__ import annotations

from collections import Counter
from typing import Any
from pagedkv.errors import InvariantViolation


def check_invariants(manager: Any) -> int:
    """Check every invariant above on a ``KVCacheManager``; raise ``InvariantViolation`` with all problems found."""
    pool = manager.pool
    problems: list[str] = []
    held: Counter[int] = Counter()
    bs = manager.block_size
    for rid, table in manager.tables.items():
        ids = [b.block_id for b in table.blocks]
        if ids != table.ids:
            problems.append(f"table {rid}: id list {table.ids} != blocks {ids}")
        if len(set(ids)) != len(ids):
            problems.append(f"table {rid}: a block appears twice: {ids}")
        if table.num_tokens > len(ids) * bs:
            problems.append(f"table {rid}: {table.num_tokens} tokens but {len(ids)} blocks")
        held.update(ids)
    for rid, blocks, _steps in manager.holds:
        held.update(b.block_id for b in blocks)

    queue_ids = pool.free_queue.ids()
    in_queue = set(queue_ids)
    if len(in_queue) != len(queue_ids):
        dup = [i for i, c in Counter(queue_ids).items() if c > 1]
        problems.append(f"free queue holds ids twice: {dup}")
    for b in pool.free_queue:
        if pool.blocks[b.block_id] is not b:
            problems.append(f"free queue holds a foreign block object for id {b.block_id}")

    num_used = 0
    for b in pool.blocks:
        if b.ref_cnt != held[b.block_id]:
            problems.append(f"block {b.block_id}: ref_cnt {b.ref_cnt} != {held[b.block_id]} holders")
        if b.ref_cnt < 0:
            problems.append(f"block {b.block_id}: negative ref_cnt {b.ref_cnt}")
        if b.ref_cnt > 0:
            num_used += 1
            if b.block_id in in_queue:
                problems.append(f"block {b.block_id}: referenced (ref_cnt {b.ref_cnt}) but in the free queue")
        elif b.block_id not in in_queue:
            problems.append(f"block {b.block_id}: ref_cnt 0 but not in the free queue (leaked)")
        if b.block_hash is not None and pool.cached.get(b.block_hash) is not b:
            problems.append(f"block {b.block_id}: carries a hash the cache map does not point at it for")
    if len(in_queue) + num_used != pool.num_blocks:
        problems.append(f"free {len(in_queue)} + used {num_used} != num_blocks {pool.num_blocks}")

    for h, b in pool.cached.items():
        if b.block_hash != h:
            problems.append(f"cache entry {h.hex()[:12]} points at block {b.block_id} with hash "
                            f"{b.block_hash.hex()[:12] if b.block_hash else None}")

    if problems:
        raise InvariantViolation("; ".join(problems[:20]) + (f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""))
    return pool.num_blocks
