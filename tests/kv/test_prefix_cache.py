"""Prefix-cache hashing: the chained sha256 over full blocks, the typed extra keys and the
multimodal items a block overlaps."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.kv.prefix_cache import (
    NO_KEYS, CacheKeys, hash_blocks, iter_block_hashes, sha256_block_hash, token_bytes,
)

BS = 4


def test_token_bytes_are_int64_little_endian():
    assert token_bytes([1, 258]) == b"\x01" + b"\x00" * 7 + b"\x02\x01" + b"\x00" * 6
    assert token_bytes(np.array([1, 258], dtype=np.int32)) == token_bytes([1, 258])
    with pytest.raises(InvalidRequestError, match="int64"):
        token_bytes([2**63])


def test_hashes_chain_over_full_blocks_only():
    toks = list(range(10))  # two full blocks; the last 2 tokens are never hashed
    extra = NO_KEYS.extra_bytes(0, BS)
    h0 = hashlib.sha256(b"\x00" * 32 + struct.pack("<4q", 0, 1, 2, 3) + extra).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<4q", 4, 5, 6, 7) + extra).digest()
    assert hash_blocks(toks, BS) == [h0, h1]
    assert sha256_block_hash(None, token_bytes([0, 1, 2, 3]), extra) == h0
    # resuming at block 1 from its parent gives the same chain; end_block stops early
    assert [h for h, *_ in iter_block_hashes(toks, BS, parent_hash=h0, first_block=1)] == [h1]
    assert [p for _, p, _, _ in iter_block_hashes(toks, BS)] == [None, h0]
    assert [h for h, *_ in iter_block_hashes(toks, BS, end_block=1)] == [h0]
    assert hash_blocks(toks[:3], BS) == []


def test_same_tokens_after_a_different_prefix_hash_differently():
    a = hash_blocks([1, 2, 3, 4, 9, 9, 9, 9], BS)
    b = hash_blocks([5, 6, 7, 8, 9, 9, 9, 9], BS)
    assert a[1] != b[1]


def test_extra_keys_are_typed():
    assert CacheKeys(cache_salt="7") != CacheKeys(adapter_id=7)
    assert CacheKeys(cache_salt="7").extra_bytes(0, 4) != CacheKeys(adapter_id=7).extra_bytes(0, 4)
    assert CacheKeys(model_id="m").extra_bytes(0, 4) == (
        b"model=str:'m'|rev=NoneType:None|adapter=NoneType:None|salt=NoneType:None|tenant=NoneType:None")
    assert hash_blocks([1, 2, 3, 4], BS, CacheKeys(tenant="x")) != hash_blocks([1, 2, 3, 4], BS, CacheKeys(tenant="y"))


def test_a_multimodal_item_changes_only_the_blocks_it_overlaps():
    keys = CacheKeys(model_id="m", mm_hashes=(("img", 5, 2),))  # positions 5, 6: block 1
    plain = CacheKeys(model_id="m")
    toks = list(range(12))
    with_mm, without = hash_blocks(toks, BS, keys), hash_blocks(toks, BS, plain)
    assert with_mm[0] == without[0] and with_mm[1] != without[1]
    assert with_mm[2] != without[2]  # the chain carries the difference on
    assert keys.extra_bytes(4, 8).endswith(b"|mm=str:'img'@5+2")
    assert keys.extra_bytes(8, 12) == plain.extra_bytes(8, 12)


def test_mm_hashes_are_sorted_and_checked():
    k = CacheKeys(mm_hashes=(("b", 9, 1), ("a", 2, 3)))
    assert k.mm_hashes == (("a", 2, 3), ("b", 9, 1))
    with pytest.raises(InvalidRequestError, match="bad offset/length"):
        CacheKeys(mm_hashes=(("a", 0, 0),))
    with pytest.raises(InvalidRequestError, match="expected"):
        CacheKeys(mm_hashes=(("a", 0),))
