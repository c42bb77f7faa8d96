"""BlockPayloadCodec and run_transfer (pagedkv/worker/kv_transfer.py) with a fake backend
whose blocks hold a float32 tensor and an int8 scale: payload size and format, bit-exact
export/import, and a transfer whose failed load is recomputed."""

import numpy as np
import torch

from pagedkv.kv.tiers.index import TierEntry
from pagedkv.kv.tiers.plan import KVTransfer, Load, Put
from pagedkv.kv.tiers.spec import StoreIdentity, TierSpec
from pagedkv.kv.tiers.stores import TierStores
from pagedkv.worker.kv_transfer import BlockPayloadCodec, run_transfer


class FakeBackend:
    """A layer's cache is (values float32 [blocks, 2, 3], scales int8 [blocks, 4]): caches of
    its own, no ``Layout``, so the payload format names the backend."""

    name = "fake"

    def export_blocks(self, cache, ids):
        return [cache[0][ids], cache[1][ids]]

    def import_blocks(self, cache, ids, tensors):
        cache[0][ids] = tensors[0]
        cache[1][ids] = tensors[1]


def _caches(num_layers=2, num_blocks=6):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(num_blocks, 2, 3, generator=g), torch.randint(-100, 100, (num_blocks, 4), dtype=torch.int8,
                                                                       generator=g))
            for _ in range(num_layers)]


def test_payload_size_and_format():
    codec = BlockPayloadCodec(FakeBackend(), _caches(), torch.device("cpu"))
    assert codec.parts[0] == [(torch.float32, (2, 3), 24), (torch.int8, (4,), 4)]
    assert codec.nbytes == 2 * (24 + 4)
    assert codec.format == "fake float32[2, 3],int8[4] x2 layers"


def test_export_import_round_trips_bit_for_bit():
    src, dst = _caches(), [(torch.zeros(6, 2, 3), torch.zeros(6, 4, dtype=torch.int8)) for _ in range(2)]
    enc = BlockPayloadCodec(FakeBackend(), src, torch.device("cpu"))
    payloads, wait = enc.export([4, 1])
    assert wait is None and payloads.shape == (2, 56) and payloads.dtype == np.uint8
    # row 0 = block 4: layer 0's values then scales, then layer 1's
    assert payloads[0, :24].tobytes() == src[0][0][4].numpy().tobytes()
    assert payloads[0, 24:28].tobytes() == src[0][1][4].numpy().tobytes()
    assert payloads[0, 28:52].tobytes() == src[1][0][4].numpy().tobytes()
    BlockPayloadCodec(FakeBackend(), dst, torch.device("cpu")).import_blocks([0, 5], payloads)
    for (sv, ss), (dv, ds) in zip(src, dst):
        assert torch.equal(dv[0], sv[4]) and torch.equal(dv[5], sv[1])
        assert torch.equal(ds[0], ss[4]) and torch.equal(ds[5], ss[1])
        assert not dv[1:5].any() and not ds[1:5].any()  # nothing else written


def test_run_transfer_stores_loads_and_recomputes_a_missing_block():
    caches = _caches()
    codec = BlockPayloadCodec(FakeBackend(), caches, torch.device("cpu"))
    ident = StoreIdentity(model_id="m", revision="r", weights="fp32", kv_dtype="float32", block_size=4,
                          num_layers=2, block_format=codec.format, block_nbytes=codec.nbytes)
    stores = TierStores([TierSpec("host", 8 * codec.nbytes)], ident)
    a, gone = TierEntry(b"a" * 32, None, b"", b""), TierEntry(b"g" * 32, None, b"", b"")
    # step 1: block 2 is evicted to the host tier
    run_transfer(codec, KVTransfer(store_block_ids=[2], ops=[Put(0, a, 0)]), stores, recompute=None)
    want = [(v[2].clone(), s[2].clone()) for v, s in caches]
    # step 2: load it into block 3; the other load's entry is gone, so it is recomputed
    recomputed = []
    ops = [Load(0, a, 3, 8, [0, 1]), Load(0, gone, 4, 12, [0, 1, 3])]
    run_transfer(codec, KVTransfer(store_block_ids=[], ops=ops), stores, recomputed.append)
    assert [(ld.block_id, ld.position) for ld in recomputed] == [(4, 12)]
    for (v, s), (wv, ws) in zip(caches, want):
        assert torch.equal(v[3], wv) and torch.equal(s[3], ws)
    stats = stores.transfer_stats()
    assert stats["blocks"] == {"pool->host": 1, "host->pool": 1}
    assert stats["bytes"] == {"pool->host": 56, "host->pool": 56}
    assert set(stats["seconds"]) == {"export", "import", "recompute"}
    assert stores.take_failures() == [(0, gone.block_hash)]
    stores.close()
