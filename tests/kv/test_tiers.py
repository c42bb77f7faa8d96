"""The KV tiers behind the block pool at the memory-system level, no model: a
fake runner whose "K/V" of a block is a function of its chained hash (what real K/V
depend on: the block's tokens and everything before them), so a block served with wrong
K/V is caught by value. Exact hit counts per tier, LRU push-down, pins, the disk store's
identity check, corruption, restart and size limit, tenant isolation; KV events over
ZeroMQ (vLLM's shapes, sequence numbers without gaps, the replay socket)."""

from __future__ import annotations

import os

import time

import lmdb
import numpy as np
import pytest
import zmq

from pagedkv.errors import ConfigError
from pagedkv.kv import CacheKeys, KVCacheManager, check_invariants
from pagedkv.kv.prefix_cache import hash_blocks, iter_block_hashes
from pagedkv.kv.tiers import (KVStoreMismatchError, StoreIdentity, ZmqEventPublisher, decode_batch, open_tiers,
                              parse_tier_specs)
from pagedkv.kv.tiers.disk import DiskStore, disk_capacity_blocks
from pagedkv.kv.tiers.events import END_SEQ, replay_endpoint_for
from pagedkv.utils import free_port, free_port_pair
from pagedkv.worker.kv_transfer import run_transfer

BS = 4
NB = 4096  # payload bytes per block
KEYS = CacheKeys(model_id="m")


def ident(**kw) -> StoreIdentity:
    base = dict(model_id="m", revision="r", weights="fp32", kv_dtype="float32", block_size=BS, num_layers=2,
                block_format="fake", block_nbytes=NB)
    return StoreIdentity(**{**base, **kw})


def content(block_hash: bytes) -> np.ndarray:
    return np.frombuffer((block_hash * (NB // 32 + 1))[:NB], dtype=np.uint8)


class FakeRunner:
    """A pool cache of ``num_blocks`` payloads; a computed block gets ``content(hash)``."""

    def __init__(self, num_blocks: int, specs: list[str], publisher=None) -> None:
        self.tiers, self.stores = open_tiers(parse_tier_specs(specs), ident(), BS, publisher)
        self.kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True, tiers=self.tiers)
        self.cache = np.zeros((num_blocks, NB), dtype=np.uint8)
        self.recomputed = 0

    # the codec protocol of worker.kv_transfer
    def export(self, ids):
        return self.cache[list(ids)].copy(), None

    def import_blocks(self, ids, payloads):
        self.cache[list(ids)] = payloads

    def recompute(self, load):
        self.recomputed += 1
        self.cache[load.block_id] = content(load.entry.block_hash)

    def run(self, rid: str, tokens: list[int], keys: CacheKeys = KEYS) -> dict[str, int]:
        """Admit, transfer, check every hit block's value, compute the rest, publish, free.
        Returns the request's cached tokens per tier."""
        kv = self.kv
        hits, n = kv.get_computed_blocks(rid, tokens, keys)
        by_tier: dict[str, int] = {}
        for h in hits:
            t = getattr(h, "tier", "pool")
            by_tier[t] = by_tier.get(t, 0) + BS
        kv.allocate_slots(rid, len(tokens) - n, n, new_computed_blocks=hits)
        step = kv.begin_step([rid])
        t = kv.take_transfer()
        if t is not None:
            run_transfer(self, t, self.stores, self.recompute)
        table = kv.get_block_ids(rid)
        hashes = [h for h, *_ in iter_block_hashes(tokens, BS, keys)]
        for i in range(n // BS):  # served K/V are those of these tokens
            assert (self.cache[table[i]] == content(hashes[i])).all(), f"block {i} of {rid}: wrong K/V"
        for i in range(n // BS, len(hashes)):
            self.cache[table[i]] = content(hashes[i])
        kv.cache_blocks(rid, tokens, len(tokens), keys)
        kv.end_step(step)
        kv.free(rid)
        check_invariants(kv)
        return by_tier


def toks(seed: int, n: int) -> list[int]:
    return [(seed * 1009 + 7 * i) % 30000 for i in range(n)]


def test_specs_parse_and_reject():
    t = parse_tier_specs(["host:4GiB", "disk:/a:b/c:50GiB"])
    assert [(x.kind, x.capacity_bytes, x.path) for x in t] == [("host", 4 << 30, None), ("disk", 50 << 30, "/a:b/c")]
    for bad in (["gpu:1GiB"], ["disk:/x:1GiB", "host:1GiB"], ["host:1GiB", "host:2GiB"], ["host:0"],
                ["host:lots"], ["disk:1GiB"], ["host:/x:1GiB"], [3]):
        with pytest.raises(ConfigError):
            parse_tier_specs(bad)


def test_a_hit_from_each_tier_exact_counts(tmp_path):
    """Pool 10 blocks, host 2 blocks, disk: A's 6 blocks end up 2 in the pool, 2 in host,
    2 on disk (evicted tail first), and one lookup walks pool -> host -> disk."""
    r = FakeRunner(10, ["host:8KiB", f"disk:{tmp_path}:4MiB"])
    a = toks(1, 25)  # 6 full blocks looked up (the last token is always computed)
    assert r.run("a", a) == {}
    # b takes 8 blocks: the 3 never used, then a's tail: 6 (unhashed), 5, 4, 3, 2
    assert r.run("b", toks(2, 29)) == {}
    st = r.kv.tier_stats()["tiers"]
    assert (st["host"]["blocks"], st["disk"]["blocks"]) == (2, 2)
    assert r.run("a2", a) == {"pool": 8, "host": 8, "disk": 8}
    st = r.kv.tier_stats()["tiers"]
    assert (st["host"]["hit_blocks"], st["disk"]["hit_blocks"]) == (2, 2)
    tr = r.kv.tier_stats()["transfer"]["blocks"]
    assert tr["host->pool"] == 2 and tr["disk->pool"] == 2 and tr["host->disk"] >= 2
    assert r.recomputed == 0
    r.stores.close()


def test_full_tier_pushes_lru_down_and_last_drops(tmp_path):
    cap = disk_capacity_blocks(1 << 20, NB)
    r = FakeRunner(4, ["host:8KiB", f"disk:{tmp_path}:1MiB"])
    for i in range(cap + 12):  # each run evicts the previous one's block
        r.run(f"r{i}", toks(100 + i, 5))
    st = r.kv.tier_stats()["tiers"]
    assert st["host"]["blocks"] == 2 and st["disk"]["blocks"] == cap
    assert st["disk"]["removed_blocks"] == st["disk"]["stored_blocks"] - cap > 0
    r.stores.drain()
    assert r.stores.disk().file_bytes() <= 1 << 20
    r.stores.close()


def test_tenants_and_salts_never_share_an_entry(tmp_path):
    r = FakeRunner(6, ["host:64KiB"])
    a = toks(3, 9)
    r.run("t1", a, CacheKeys(model_id="m", tenant="alice"))
    r.run("evict", toks(4, 21))
    assert r.kv.tier_stats()["tiers"]["host"]["blocks"] == 2
    assert r.run("t2", a, CacheKeys(model_id="m", tenant="bob")) == {}
    assert r.run("t3", a, CacheKeys(model_id="m", tenant="alice", cache_salt="7")) == {}
    assert r.run("t4", a, CacheKeys(model_id="m", tenant="alice")) == {"host": 8}


def stored_on_disk(tmp_path, seed: int) -> list[int]:
    """Run a 17-token prompt, evict its 4 blocks to a disk tier, close; returns the prompt."""
    r = FakeRunner(6, [f"disk:{tmp_path}:4MiB"])
    a = toks(seed, 17)
    r.run("a", a)
    r.run("evict", toks(seed + 1, 21))
    r.stores.close()
    return a


def test_disk_restart_serves_previous_blocks_and_refuses_another_identity(tmp_path):
    a = stored_on_disk(tmp_path, 5)
    r2 = FakeRunner(6, [f"disk:{tmp_path}:4MiB"])  # a restart: the index comes from disk
    assert r2.kv.tier_stats()["tiers"]["disk"]["blocks"] == 4
    assert r2.run("a", a) == {"disk": 16}
    r2.stores.close()
    for other in (dict(block_size=8), dict(model_id="x"), dict(weights="int4"), dict(kv_dtype="bfloat16"), dict(num_layers=3),
                  dict(block_format="hnd"), dict(hash_scheme="xxhash")):
        with pytest.raises(KVStoreMismatchError, match="another model or format"):
            DiskStore(str(tmp_path), 4 << 20, ident(**other))


def test_corrupt_entry_is_a_miss_and_recomputed(tmp_path):
    a = stored_on_disk(tmp_path, 7)
    env = lmdb.open(str(tmp_path), max_dbs=2, map_size=4 << 20)
    data = env.open_db(b"data")
    with env.begin(write=True, db=data) as txn:
        key = next(iter(txn.cursor().iternext(values=False)))
        raw = bytearray(txn.get(key))
        raw[100] ^= 0xFF  # one flipped byte
        txn.put(key, bytes(raw))
        key2 = [k for k in txn.cursor().iternext(values=False) if k != key][0]
        txn.put(key2, txn.get(key2)[:-10])  # a truncated payload
    env.close()
    r2 = FakeRunner(6, [f"disk:{tmp_path}:4MiB"])
    assert r2.run("a", a) == {"disk": 16}  # admitted as hits; FakeRunner.run checks the values
    assert r2.recomputed == 2
    assert r2.kv.tier_stats()["tiers"]["disk"]["blocks"] == 4  # not yet synced ...
    r2.kv.take_transfer()
    st = r2.kv.tier_stats()["tiers"]["disk"]
    assert (st["blocks"], st["failed_blocks"]) == (2, 2)  # ... then forgotten
    r2.stores.close()


def test_disk_store_clear_errors_at_open(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="cannot create or write"):
        DiskStore(str(f / "sub"), 4 << 20, ident())
    with pytest.raises(ConfigError, match="exceeds the free space"):
        DiskStore(str(tmp_path / "big"), 1 << 60, ident())
    with pytest.raises(ConfigError, match="hold no block"):
        DiskStore(str(tmp_path / "tiny"), 8192, ident())
    s = DiskStore(str(tmp_path / "s"), 4 << 20, ident())
    with pytest.raises(ConfigError, match="in use by another process"):
        DiskStore(str(tmp_path / "s"), 4 << 20, ident())
    s.close()
    assert sorted(os.listdir(tmp_path / "s")) == ["data.mdb", "lock.mdb", "pagedkv.lock"]


def test_reset_prefix_cache_clears_every_tier(tmp_path):
    r = FakeRunner(6, ["host:8KiB", f"disk:{tmp_path}:4MiB"])
    r.run("a", toks(9, 17))
    r.run("evict", toks(10, 21))
    assert sum(t["blocks"] for t in r.kv.tier_stats()["tiers"].values()) == 4
    r.kv.reset_prefix_cache()
    assert sum(t["blocks"] for t in r.kv.tier_stats()["tiers"].values()) == 0
    assert r.run("a", toks(9, 17)) == {}
    r.stores.drain()
    assert r.stores.disk().scan() is not None and list(r.stores.disk().scan()) == []
    r.stores.close()


# ---- KV events ---------------------------------------------------------------------------

def subscribe(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    time.sleep(0.3)  # let the subscription reach the publisher before anything is sent
    return sub


def receive(sub: zmq.Socket, n: int, timeout: float = 10.0) -> list[tuple[int, list[dict]]]:
    out = []
    deadline = time.time() + timeout
    while len(out) < n and time.time() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            out.append((int.from_bytes(seq, "big"), decode_batch(payload)[1]))
    return out


def test_stored_then_removed_in_order_without_gaps(tmp_path):
    port = free_port_pair()  # the endpoint and its replay endpoint, port + 1
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", replay_endpoint_for(f"tcp://127.0.0.1:{port}"))
    sub = subscribe(f"tcp://127.0.0.1:{port}")
    r = FakeRunner(8, ["host:64KiB"], publisher=pub)
    a = toks(1, 13)  # 3 full blocks
    r.run("a", a)  # step 1: BlockStored(pool) for a's 3 blocks, one chain
    r.run("b", toks(2, 29))  # step 2: a's blocks evicted: removed from the pool, stored in host
    batches = receive(sub, 2)
    assert [s for s, _ in batches] == [0, 1]
    ha = hash_blocks(a, BS, KEYS)
    (stored,) = [e for e in batches[0][1] if e["medium"] == "pool"]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == ha
    assert stored["parent_block_hash"] is None and stored["token_ids"] == a[:12] and stored["block_size"] == BS
    assert len(stored["extra_keys"]) == 3 and "model=str:'m'" in stored["extra_keys"][0][0]
    ev = batches[1][1]
    removed = [h for e in ev if e["type"] == "BlockRemoved" and e["medium"] == "pool" for h in e["block_hashes"]]
    to_host = [h for e in ev if e["type"] == "BlockStored" and e["medium"] == "host" for h in e["block_hashes"]]
    assert set(ha) <= set(removed) and set(ha) <= set(to_host)
    assert ev.index(next(e for e in ev if e["type"] == "BlockRemoved")) < ev.index(
        next(e for e in ev if e["medium"] == "host"))
    r.kv.reset_prefix_cache()
    r.kv.end_step(r.kv.begin_step([]))
    (last,) = receive(sub, 1)
    assert last[0] == 2 and {"type": "AllBlocksCleared"} in last[1]

    req = zmq.Context.instance().socket(zmq.DEALER)  # many replies to one request
    req.setsockopt(zmq.LINGER, 0)
    req.connect(replay_endpoint_for(f"tcp://127.0.0.1:{port}"))
    req.send_multipart((b"", (1).to_bytes(8, "big")))
    got = []
    while True:
        assert req.poll(5000)
        _, seq, payload = req.recv_multipart()
        if seq == END_SEQ:
            assert payload == b""
            break
        got.append((int.from_bytes(seq, "big"), decode_batch(payload)[1]))
    assert got == batches[1:] + [last]
    for s in (sub, req):
        s.close()
    pub.close()


def test_an_endpoint_in_use_is_a_clear_error():
    port = free_port()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}")
    with pytest.raises(ConfigError, match="cannot bind"):
        ZmqEventPublisher(f"tcp://127.0.0.1:{port}")
    pub.close()
