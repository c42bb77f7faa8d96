"""KV tiers and KV events in the engine, on the bundled model with block_size 4
and a 12-block pool: greedy outputs identical with and without tiers (and to a cold run
without prefix caching), a hit from each tier by exact counts, K/V loaded from a tier
bit-equal to the computed ones, a restart that finds the disk blocks, a corrupt entry
recomputed, another model config's store refused, clear errors at start, and a subscriber
that sees BlockStored then BlockRemoved with no gap in sequence numbers."""

from __future__ import annotations

import time

import lmdb
import pytest
import torch
import zmq

from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.kv import CacheKeys, hash_blocks
from pagedkv.kv.tiers import KVStoreMismatchError, decode_batch
from pagedkv.utils import free_port_pair

BS = 4
A = [(11 * i + 5) % 4000 + 200 for i in range(25)]  # 6 full blocks looked up
B = [(17 * i + 3) % 4000 + 4300 for i in range(37)]  # 10 blocks: evicts 4 of A's 6
HOST_2_BLOCKS = "host:360KiB"  # SmolLM2 fp32: 46,080 B/token x 4 = 184,320 B per block


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def make(loaded_model, **kw):
    kw.setdefault("enable_prefix_caching", True)
    return LLM(loaded_model, block_size=BS, num_blocks=12, debug_invariants=True, **kw)


def run(llm, prompt):
    return llm.generate([prompt], greedy(), use_tqdm=False)[0]


def payloads_by_hash(llm, hashes):
    """The pool's current K/V payload (every layer) of each cached block in ``hashes``."""
    eng = llm.engine
    codec = eng.runner.kv_payload_codec()
    ids = [eng.kv.pool.cached[h].block_id for h in hashes]
    arr, _ = codec.export(ids)
    return torch.from_numpy(arr.copy()).view(torch.float32)


@pytest.fixture(scope="module")
def cold(loaded_model):
    """Outputs and A's K/V without tiers: prefix caching on (for the K/V by hash) and off."""
    llm = make(loaded_model)
    outs = [run(llm, p).token_ids for p in (A, B, A)]
    kv_a = payloads_by_hash(llm, hash_blocks(A, BS, keys(llm))[:2])
    off = make(loaded_model, enable_prefix_caching=False)
    assert [run(off, p).token_ids for p in (A, B, A)] == outs
    fresh = make(loaded_model)
    run(fresh, A)
    kv_all = payloads_by_hash(fresh, hash_blocks(A, BS, keys(fresh)))
    assert torch.equal(kv_all[:2], kv_a)
    return outs, kv_all


def keys(llm):
    return CacheKeys(model_id=llm.engine.model_id, revision=llm.engine.revision, kv_cache_dtype=llm.engine.kv_format_id)


def test_greedy_identical_and_a_hit_from_each_tier(loaded_model, tmp_path, cold):
    llm = make(loaded_model, kv_offload=[HOST_2_BLOCKS, f"disk:{tmp_path}:16MiB"])
    outs = [run(llm, A), run(llm, B), run(llm, A)]
    assert [o.token_ids for o in outs] == cold[0]
    # A: blocks 0,1 stayed in the pool; B evicted 5,4,3,2 (tail first): host kept the last
    # two (3, 2), pushing 5, 4 to disk. One lookup walks all three.
    assert outs[2].num_cached_tokens == 24
    assert outs[2].num_cached_tokens_by_tier == {"pool": 8, "host": 8, "disk": 8}
    st = llm.engine.get_stats()
    tiers = st.kv_tiers["tiers"]
    assert (tiers["host"]["hit_blocks"], tiers["disk"]["hit_blocks"]) == (2, 2)
    assert (tiers["host"]["hit_tokens"], tiers["disk"]["hit_tokens"], st.kv_pool_hit_tokens) == (8, 8, 8)
    moved = st.kv_tiers["transfer"]["bytes"]
    assert moved["host->pool"] == moved["disk->pool"] == 2 * 184_320
    # the loaded blocks hold exactly the K/V computed for A (bit for bit)
    assert torch.equal(payloads_by_hash(llm, hash_blocks(A, BS, keys(llm))), cold[1])
    llm.close()


def test_restart_finds_disk_blocks_and_a_corrupt_entry_is_recomputed(loaded_model, tmp_path, cold):
    path = tmp_path / "kv"
    first = make(loaded_model, kv_offload=[f"disk:{path}:16MiB"])
    assert run(first, A).token_ids == cold[0][0]
    first.close()  # persists the pool's cached blocks
    second = make(loaded_model, kv_offload=[f"disk:{path}:16MiB"])
    assert second.engine.get_stats().kv_tiers["tiers"]["disk"]["blocks"] == 6
    out = run(second, A)
    assert out.token_ids == cold[0][0] and out.num_cached_tokens_by_tier == {"disk": 24}
    second.close()

    env = lmdb.open(str(path), max_dbs=2, map_size=16 << 20)
    with env.begin(write=True, db=env.open_db(b"data")) as txn:
        h = hash_blocks(A, BS, keys(second))[2]
        raw = bytearray(txn.get(h))
        raw[5000:5004] = b"\x00\x00\xc0\x7f"  # a NaN in block 2's payload
        txn.put(h, bytes(raw))
    env.close()
    third = make(loaded_model, kv_offload=[f"disk:{path}:16MiB"])
    out = run(third, A)
    assert out.token_ids == cold[0][0] and out.num_cached_tokens_by_tier == {"disk": 24}
    kv = payloads_by_hash(third, hash_blocks(A, BS, keys(third)))
    assert torch.equal(kv[[0, 1, 3, 4, 5]], cold[1][[0, 1, 3, 4, 5]])
    torch.testing.assert_close(kv[2], cold[1][2], rtol=1e-4, atol=1e-4)  # recomputed, not loaded
    run(third, [1, 2, 3])
    assert third.engine.get_stats().kv_tiers["tiers"]["disk"]["failed_blocks"] == 1
    third.close()

    with pytest.raises(KVStoreMismatchError, match="block_size: 4 != 8"):
        LLM(loaded_model, block_size=8, num_blocks=12, kv_offload=[f"disk:{path}:16MiB"])
    with pytest.raises(KVStoreMismatchError, match="revision: '[0-9a-f]+' != 'v2'"):
        make(loaded_model, kv_offload=[f"disk:{path}:16MiB"], model_revision="v2")


def test_clear_errors_at_start(loaded_model, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("")
    with pytest.raises(ConfigError, match="cannot create or write the store directory"):
        make(loaded_model, kv_offload=[f"disk:{f}/kv:16MiB"])
    with pytest.raises(ConfigError, match="exceeds the free space"):
        make(loaded_model, kv_offload=[f"disk:{tmp_path}/kv:900PiB"])
    with pytest.raises(ConfigError, match="tiers go fastest first"):
        make(loaded_model, kv_offload=[f"disk:{tmp_path}/kv:16MiB", "host:1GiB"])
    with pytest.raises(ConfigError, match="holds no block"):
        make(loaded_model, kv_offload=["host:100KiB"])
    with pytest.raises(ConfigError, match="ZeroMQ endpoint"):
        make(loaded_model, kv_events="127.0.0.1:5557")


def test_serve_refuses_a_bad_tier_at_start(tmp_path, bundled_gguf, capsys):
    """``pagedkv serve`` exits with status 2 and one clear line, before serving anything."""
    from pagedkv.cli import main

    f = tmp_path / "a-file"
    f.write_text("")
    base = ["serve", "--port", "0", "--num-blocks", "8", "--block-size", "4"]
    assert main(base + ["--kv-offload", "ram:1GiB"]) == 2
    assert "pagedkv: error: kv_offload: 'ram:1GiB': the tier kind must be one of" in capsys.readouterr().err
    assert main(base + ["--kv-offload", f"disk:{f}/kv:16MiB"]) == 2
    assert "cannot create or write the store directory" in capsys.readouterr().err


def test_subscriber_sees_stored_then_removed_without_gaps(loaded_model, cold):
    port = free_port_pair()  # the replay endpoint takes port + 1
    llm = make(loaded_model, enable_prefix_caching=False, kv_events=f"tcp://127.0.0.1:{port}")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    time.sleep(0.3)
    assert [run(llm, p).token_ids for p in (A, B)] == cold[0][:2]
    ha = hash_blocks(A, BS, keys(llm))
    seqs, stored, removed = [], [], []
    deadline = time.time() + 10
    while not set(ha[2:]) <= set(removed) and time.time() < deadline:
        if sub.poll(100):
            _, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            for e in decode_batch(payload)[1]:
                (stored if e["type"] == "BlockStored" else removed).extend(e.get("block_hashes", []))
                assert e.get("medium") == "pool"
    assert seqs == list(range(len(seqs))) and seqs  # from 0, no gap
    assert stored[:6] == ha  # A's new prefix first, as one chain
    assert removed[:4] == [ha[5], ha[4], ha[3], ha[2]]  # evicted tail first, after being stored
    sub.close()
    llm.close()
