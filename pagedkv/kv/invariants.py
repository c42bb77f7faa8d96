"""The memory system's invariants (seed §02, §04), checked from tests and from the engine's
debug flag. ``check_invariants(manager)`` raises ``InvariantViolation`` listing every
broken rule, or returns the number of blocks checked.

1. ``ref_cnt`` of every block == number of live block tables holding it + step-fence holds.
2. No block with ``ref_cnt > 0`` is in the free queue; every block with ``ref_cnt == 0`` is.
3. No id appears twice in the free queue (or twice in one table).
4. free + in use == ``num_blocks``; the pool's ``num_shared`` == blocks with ``ref_cnt > 1``.
5. Every prefix-cache entry ``hash -> block`` points at a block carrying that hash, and a
   block carrying a hash is the entry for it.
6. Every table has a slot for each of its ``num_tokens`` positions.
7. Layer groups: every request has a table in every group, all with the same
   ``num_tokens``. The null block (a hybrid manager's block 0) is never referenced, queued
   nor cached, and appears only as the first ``num_null`` entries of a sliding-window
   group's table (never in a full group's); those entries lie wholly before the window of
   position ``num_tokens`` (the furthest the request's next step can start).
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
    null = getattr(pool, "null_block", None)
    group_tables = getattr(manager, "group_tables", [manager.tables])
    windows = manager.groups.windows if hasattr(manager, "groups") else (None,)
    for g, tables in enumerate(group_tables):
        if tables.keys() != group_tables[0].keys():
            problems.append(f"group {g}: requests {sorted(tables.keys() ^ group_tables[0].keys())} "
                            "lack a table in some group")
        for rid, table in tables.items():
            name = f"table {rid}" + (f" (group {g})" if g else "")
            k = getattr(table, "num_null", 0)
            ids = [b.block_id for b in table.blocks[k:]]
            if [b.block_id for b in table.blocks] != table.ids:
                problems.append(f"{name}: id list {table.ids} != its blocks")
            if len(set(ids)) != len(ids):
                problems.append(f"{name}: a block appears twice: {ids}")
            if table.num_tokens > len(table.blocks) * bs:
                problems.append(f"{name}: {table.num_tokens} tokens but {len(table.blocks)} blocks")
            if k and (null is None or windows[g] is None or any(b is not null for b in table.blocks[:k])):
                problems.append(f"{name}: {k} placeholders in a group without a window or not the null block")
            if null is not None and any(b is null for b in table.blocks[k:]):
                problems.append(f"{name}: the null block past its {k} leading placeholders")
            if k and windows[g] is not None and k > max(0, table.num_tokens - windows[g] + 1) // bs:
                problems.append(f"{name}: placeholder blocks 0..{k - 1} reach into the window "
                                f"of position {table.num_tokens}")
            if g and rid in group_tables[0] and table.num_tokens != group_tables[0][rid].num_tokens:
                problems.append(f"{name}: {table.num_tokens} tokens, group 0 has {group_tables[0][rid].num_tokens}")
            held.update(ids)
    if null is not None and (null.ref_cnt or null.block_hash is not None or null in pool.free_queue):
        problems.append(f"null block {null.block_id}: ref_cnt {null.ref_cnt}, cached "
                        f"{null.block_hash is not None}, queued {null in pool.free_queue}")
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
    num_shared = sum(1 for b in pool.blocks if b.ref_cnt > 1)
    if pool.num_shared != num_shared:
        problems.append(f"pool counts {pool.num_shared} shared blocks, {num_shared} have ref_cnt > 1")
    for b in pool.blocks:
        if b is null:
            continue
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
    usable = pool.num_blocks - (null is not None)
    if len(in_queue) + num_used != usable:
        problems.append(f"free {len(in_queue)} + used {num_used} != usable blocks {usable}")

    for h, b in pool.cached.items():
        if b.block_hash != h:
            problems.append(f"cache entry {h.hex()[:12]} points at block {b.block_id} with hash "
                            f"{b.block_hash.hex()[:12] if b.block_hash else None}")

    if problems:
        raise InvariantViolation("; ".join(problems[:20]) + (f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""))
    return pool.num_blocks
