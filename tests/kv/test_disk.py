"""DiskStore (pagedkv/kv/tiers/disk.py) in a temporary directory: capacity arithmetic,
queued payloads served before their commit, verified reads (a corrupt or foreign entry is a
miss), delete/clear, scan order after reopening, and the errors at open."""

import numpy as np
import pytest

from pagedkv.errors import ConfigError
from pagedkv.kv.tiers.disk import DiskStore, KVStoreMismatchError, disk_capacity_blocks, entry_bytes
from pagedkv.kv.tiers.index import TierEntry
from pagedkv.kv.tiers.spec import StoreIdentity

NB = 100
CAP = 4 << 20


def _ident(**kw):
    base = dict(model_id="m", revision="r", weights="fp32", kv_dtype="float32", block_size=4, num_layers=1,
                block_format="fake", block_nbytes=NB)
    return StoreIdentity(**{**base, **kw})


def _e(i, parent=None):
    return TierEntry(bytes([i]) * 32, parent, bytes([i]) * 8, b"k")


def _p(v):
    return np.full(NB, v, dtype=np.uint8)


@pytest.fixture
def store(tmp_path):
    s = DiskStore(str(tmp_path), CAP, _ident())
    yield s
    s.close()


def test_capacity_arithmetic():
    assert entry_bytes(100) == 4096 + 512 and entry_bytes(4081) == 2 * 4096 + 512
    # reserve: 64 pages + 2 batches of 16 entries
    assert disk_capacity_blocks(64 * 4096 + 32 * 4608 + 3 * 4608, 100) == 3
    assert disk_capacity_blocks(1000, 100) == 0


def test_put_is_served_before_and_after_its_commit(store):
    a = _e(1)
    store.put(a, _p(7))
    assert int(store.get(a)[0]) == 7  # still queued: served from memory
    store.drain()
    got = store.get(a)
    assert got.dtype == np.uint8 and got.shape == (NB,) and np.array_equal(got, _p(7))
    assert store.get(_e(2)) is None and store.take_failures() == []


def test_a_read_is_verified(store):
    a = _e(1)
    store.put(a, _p(7))
    store.drain()
    # the same hash asked for with another parent / tokens: a miss, never wrong K/V
    assert store.get(TierEntry(a.block_hash, b"x" * 32, a.token_bytes, b"k")) is None
    assert store.get(TierEntry(a.block_hash, None, b"\x00" * 8, b"k")) is None
    with store.env.begin(write=True, db=store._data) as txn:  # flip one payload byte on disk
        txn.put(a.block_hash, _p(7)[:-1].tobytes() + b"\x08")
    assert store.get(a) is None
    with store.env.begin(write=True, db=store._data) as txn:  # truncated payload
        txn.put(a.block_hash, _p(7)[:50].tobytes())
    assert store.get(a) is None


def test_delete_clear_and_scan_order_after_reopen(tmp_path):
    s = DiskStore(str(tmp_path), CAP, _ident())
    a, b, c = _e(1), _e(2, b"\x01" * 32), _e(3)
    for e, v in ((c, 3), (a, 1), (b, 2)):
        s.put(e, _p(v))
    s.delete(a.block_hash)
    assert s.get(a) is None
    s.close()
    s = DiskStore(str(tmp_path), CAP, _ident())
    assert [(e.block_hash, e.parent_hash) for e in s.scan()] == [(c.block_hash, None), (b.block_hash, b"\x01" * 32)]
    assert np.array_equal(s.get(b), _p(2))
    s.clear()
    s.drain()
    assert s.get(b) is None and list(s.scan()) == []
    s.close()
    s.close()  # idempotent


def test_open_errors(tmp_path):
    with pytest.raises(ConfigError, match="1000 bytes hold no block of 100 bytes"):
        DiskStore(str(tmp_path), 1000, _ident())
    first = DiskStore(str(tmp_path), CAP, _ident())
    with pytest.raises(ConfigError, match="the store is in use by another process"):
        DiskStore(str(tmp_path), CAP, _ident())
    first.close()
    with pytest.raises(KVStoreMismatchError, match="the store was written for another model or format"):
        DiskStore(str(tmp_path), CAP, _ident(model_id="other"))
    again = DiskStore(str(tmp_path), CAP, _ident())  # the refused open released the lock
    again.close()
