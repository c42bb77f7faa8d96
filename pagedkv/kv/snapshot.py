"""A JSON-able picture of the KV manager for live UIs (the ``/ui`` page)."""

from __future__ import annotations

from typing import Any


def manager_snapshot(mgr: Any) -> dict[str, Any]:
    """Every block and table, JSON-able, for a live UI:
    ``{"num_blocks", "block_size", "num_free_blocks", "usage", "free_queue": [ids],
    "blocks": [{"block_id", "ref_cnt", "is_cached", "is_free", "owners": [req_ids]}],
    "tables": {req_id: {"block_ids", "num_tokens"}}, "holds": [{"req_id", "block_ids",
    "steps"}], "open_steps": {step_id: [req_ids]}, "stats": {...}, "tiers": {...},
    "groups": [{"group", "window", "layers"}], "group_tables": [{req_id: {"block_ids",
    "num_null"}}]}`` (``mgr``: a ``KVCacheManager``; ``tables`` is group 0's; ``tiers``: its
    ``tier_stats()``, ``{}`` without tiers; ``null_block``: id 0 or ``None``)."""
    owners: dict[int, list[str]] = {}
    for tables in mgr.group_tables:
        for rid, t in tables.items():
            for b in t.live_blocks:
                owners.setdefault(b.block_id, []).append(rid)
    free_q = mgr.pool.free_queue
    return {
        "num_blocks": mgr.num_blocks,
        "block_size": mgr.block_size,
        "num_free_blocks": mgr.num_free_blocks,
        "usage": mgr.usage,
        "free_queue": free_q.ids(),
        "blocks": [
            {"block_id": b.block_id, "ref_cnt": b.ref_cnt, "is_cached": b.block_hash is not None,
             "is_free": b in free_q, "owners": owners.get(b.block_id, [])}
            for b in mgr.pool.blocks
        ],
        "tables": {rid: {"block_ids": t.ids, "num_tokens": t.num_tokens} for rid, t in mgr.tables.items()},
        "holds": [{"req_id": rid, "block_ids": [b.block_id for b in blocks], "steps": sorted(waiting)}
                  for rid, blocks, waiting in mgr.holds],
        "open_steps": {sid: sorted(r) for sid, r in mgr.open_steps.items()},
        "stats": mgr.stats.as_dict(),
        "tiers": mgr.tier_stats(),
        "groups": mgr.groups.describe(),
        "group_tables": [{rid: {"block_ids": t.ids, "num_null": t.num_null} for rid, t in tables.items()}
                         for tables in mgr.group_tables],
        "null_block": None if mgr.null_block is None else mgr.null_block.block_id,
    }
