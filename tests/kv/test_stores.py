"""TierStores / HostStore (pagedkv/kv/tiers/stores.py): a step's ops run in order on hand-made
payloads (put, move, load, drop, clear), failed loads and moves reported once, and the block /
byte / direction counters."""

import numpy as np
import pytest

from pagedkv.errors import ConfigError
from pagedkv.kv.tiers.index import TierEntry
from pagedkv.kv.tiers.plan import Clear, Drop, Load, Move, Put
from pagedkv.kv.tiers.spec import StoreIdentity, TierSpec
from pagedkv.kv.tiers.stores import HostStore, TierStores

NB = 64


def _ident():
    return StoreIdentity(model_id="m", revision="r", weights="fp32", kv_dtype="float32", block_size=4,
                         num_layers=1, block_format="fake", block_nbytes=NB)


def _e(i):
    return TierEntry(bytes([i]) * 32, None, bytes([i]) * 8, b"")


def _payloads(n):
    return np.stack([np.full(NB, 10 + i, dtype=np.uint8) for i in range(n)])


def _load(level, entry, block_id=3):
    return Load(level=level, entry=entry, block_id=block_id, position=0, context_block_ids=[])


def test_host_store_capacity():
    assert HostStore(10 * NB + 5, NB).capacity_blocks == 10
    with pytest.raises(ConfigError, match=f"kv_offload host:{NB - 1}: holds no block of {NB} bytes"):
        HostStore(NB - 1, NB)


def test_ops_run_in_order_and_are_counted(tmp_path):
    stores = TierStores([TierSpec("host", 4 * NB), TierSpec("host", 8 * NB)], _ident())
    a, b = _e(1), _e(2)
    pl = _payloads(2)
    waited = []
    loaded, failed = stores.execute([Put(0, a, 0), Put(0, b, 1)], pl, wait=lambda: waited.append(1))
    assert (loaded, failed, waited) == ([], [], [1])  # a host put reads the export: wait first
    assert len(stores.levels[0]) == 2
    pl[0, :] = 0  # the store kept its own copy of row 0, not a view of the step's export
    assert int(stores.levels[0].get(a)[0]) == 10
    # move a down, then load it and b: the load of a is served by level 1
    loaded, failed = stores.execute([Move(0, 1, a), _load(1, a, 5), _load(0, b, 6)], None)
    assert [(op.block_id, int(p[0])) for op, p in loaded] == [(5, 10), (6, 11)] and failed == []
    assert stores.levels[0].get(a) is None and len(stores.levels[1]) == 1
    stores.record("export", 0.25)
    stats = stores.transfer_stats()
    assert stats["blocks"] == {"pool->host": 2, "host->host": 1, "host->pool": 2}
    assert stats["bytes"] == {"pool->host": 2 * NB, "host->host": NB, "host->pool": 2 * NB}
    assert stats["seconds"] == {"export": 0.25}
    assert stores.take_failures() == []
    stores.close()
    stores.close()  # idempotent


def test_missing_payloads_fail_and_are_reported_once():
    stores = TierStores([TierSpec("host", 4 * NB), TierSpec("host", 4 * NB)], _ident())
    a, b = _e(1), _e(2)
    stores.execute([Put(0, a, 0)], _payloads(1))
    loaded, failed = stores.execute([Drop(0, a.block_hash), _load(0, a), Move(0, 1, b)], None)
    op = failed[0]
    assert loaded == [] and failed == [op] and op.entry is a
    assert stores.take_failures() == [(0, a.block_hash), (1, b.block_hash)]
    assert stores.take_failures() == []
    assert "host->host" not in stores.transfer_stats()["blocks"]


def test_clear_empties_one_level():
    stores = TierStores([TierSpec("host", 4 * NB), TierSpec("host", 4 * NB)], _ident())
    stores.execute([Put(0, _e(1), 0), Put(1, _e(2), 1), Clear(0)], _payloads(2))
    assert (len(stores.levels[0]), len(stores.levels[1])) == (0, 1)
    assert [len(ix) for ix in stores.indexes()] == [0, 0]  # host indexes start empty
    assert stores.disk() is None


def test_disk_level_round_trip(tmp_path):
    stores = TierStores([TierSpec("host", 1 * NB), TierSpec("disk", 2 << 20, str(tmp_path))], _ident())
    a = _e(9)
    stores.execute([Put(0, a, 0), Move(0, 1, a)], _payloads(1))
    stores.drain()
    assert stores.disk() is stores.levels[1]
    loaded, failed = stores.execute([_load(1, a)], None)
    assert failed == [] and np.array_equal(loaded[0][1], np.full(NB, 10, dtype=np.uint8))
    assert stores.transfer_stats()["blocks"] == {"pool->host": 1, "host->disk": 1, "disk->pool": 1}
    assert set(stores.transfer_stats()["seconds"]) == {"disk_read", "disk_write"}
    stores.close()
    # a fresh store finds the committed block on disk
    again = TierStores([TierSpec("disk", 2 << 20, str(tmp_path))], _ident())
    assert [e.block_hash for e in again.indexes()[0]] == [a.block_hash]
    again.close()
