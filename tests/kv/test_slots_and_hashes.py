"""BlockTable slots through the package's public names, and the chained, typed block hash."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.kv import BlockTable, CacheKeys, KVCacheBlock, hash_blocks, slot_mapping
from pagedkv.kv.prefix_cache import iter_block_hashes, sha256_block_hash, token_bytes


# ---------------------------------------------------------------- block table
def test_block_table_slots():
    t = BlockTable(4, [KVCacheBlock(7), KVCacheBlock(2)], num_tokens=6)
    assert t.ids == [7, 2] and t.num_slots == 8
    assert t.physical(5) == (2, 1)
    assert t.slot(0) == 28 and t.slot(5) == 9
    assert t.slot_mapping(2, 7).tolist() == [30, 31, 8, 9, 10]
    assert slot_mapping([3], 16, 0, 3).dtype == np.int64
    with pytest.raises(InvalidRequestError):
        t.slot_mapping(0, 9)
    old = t.replace(1, KVCacheBlock(5))
    assert old.block_id == 2 and t.ids == [7, 5]


# ---------------------------------------------------------------- hashing
def test_block_hash_is_chained_typed_and_full_blocks_only():
    toks = list(range(10))
    hs = hash_blocks(toks, 4)
    assert len(hs) == 2 and all(len(h) == 32 for h in hs)  # 2 full blocks; the tail is not hashed
    assert hs[0] == sha256_block_hash(None, token_bytes([0, 1, 2, 3]), CacheKeys().extra_bytes(0, 4))
    assert hs[1] == sha256_block_hash(hs[0], token_bytes([4, 5, 6, 7]), CacheKeys().extra_bytes(4, 8))
    # Changing block 0 changes block 1 (chain); changing block 1 leaves block 0.
    assert hash_blocks([9] + toks[1:], 4)[1] != hs[1]
    assert hash_blocks(toks[:4] + [9] + toks[5:], 4)[0] == hs[0]
    # Numpy input gives the same hashes (int64 little-endian bytes).
    assert hash_blocks(np.arange(10), 4) == hs
    # Typed keys.
    assert CacheKeys(cache_salt="7").extra_bytes(0, 4) != CacheKeys(adapter_id=7).extra_bytes(0, 4)
    assert CacheKeys(adapter_id="7").extra_bytes(0, 4) != CacheKeys(adapter_id=7).extra_bytes(0, 4)
    # A multimodal item only changes the blocks overlapping it (and later ones by chaining).
    mm = CacheKeys(mm_hashes=(("img", 4, 2),))
    assert mm.extra_bytes(0, 4) == CacheKeys().extra_bytes(0, 4)
    assert mm.extra_bytes(4, 8) != CacheKeys().extra_bytes(4, 8)
    assert [h for h, *_ in iter_block_hashes(toks, 4, first_block=1, parent_hash=hs[0])] == [hs[1]]
