"""manager_snapshot (pagedkv/kv/snapshot.py): the JSON-able picture of the KV manager, with
exact block ids, owners, holds and open steps."""

from __future__ import annotations

import json

from pagedkv.kv import KVCacheManager
from pagedkv.kv.snapshot import manager_snapshot


def test_snapshot_shows_tables_owners_holds_and_open_steps():
    m = KVCacheManager(4, 4, enable_prefix_caching=False)
    m.allocate_slots("a", 6, 0)  # blocks 0, 1
    m.allocate_slots("b", 3, 0)  # block 2
    step = m.begin_step(["a"])
    m.free("a")  # held behind the open step
    snap = manager_snapshot(m)
    json.dumps(snap)  # JSON-able as it is
    assert (snap["num_blocks"], snap["block_size"], snap["num_free_blocks"]) == (4, 4, 1)
    assert snap["free_queue"] == [3]
    assert snap["tables"] == {"b": {"block_ids": [2], "num_tokens": 3}}  # tokens with a slot
    assert [(b["block_id"], b["ref_cnt"], b["is_free"], b["owners"]) for b in snap["blocks"]] == [
        (0, 1, False, []), (1, 1, False, []), (2, 1, False, ["b"]), (3, 0, True, [])]
    assert snap["holds"] == [{"req_id": "a", "block_ids": [1, 0], "steps": [step]}]  # freed tail first
    assert snap["open_steps"] == {step: ["a"]}
    assert snap["null_block"] is None and snap["tiers"] == {}
    m.end_step(step)
    after = manager_snapshot(m)
    assert after["holds"] == [] and after["open_steps"] == {} and after["num_free_blocks"] == 3
