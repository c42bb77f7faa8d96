"""``export_blocks`` / ``import_blocks``: whole blocks leave a cache and come back
bit for bit, on every backend and layout, through ``block_tensors`` (what the KV tiers use)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import get_backend
from pagedkv.errors import BackendError

NAMES = ["reference", "cpu", "reference-hnd", "cpu-hnd", "reference-ascend", "cpu-ascend"]


@pytest.mark.parametrize("name", NAMES)
def test_blocks_round_trip_bit_for_bit(name):
    be = get_backend(name)
    src = be.allocate_kv_cache(8, 4, 2, 16, torch.float32)
    for t in src.block_tensors():
        t.copy_(torch.randn_like(t))
    dst = be.allocate_kv_cache(6, 4, 2, 16, torch.float32)
    parts = be.export_blocks(src, torch.tensor([5, 2]))
    assert [tuple(p.shape) for p in parts] == [(2, *t.shape[1:]) for t in src.block_tensors()]
    be.import_blocks(dst, torch.tensor([0, 3]), parts)
    slots = lambda b: torch.arange(b * 4, b * 4 + 4)  # noqa: E731
    for s, d in ((5, 0), (2, 3)):
        for a, b in zip(be.gather_kv(src, slots(s)), be.gather_kv(dst, slots(d))):
            assert torch.equal(a, b)
    assert torch.count_nonzero(dst.key[[1, 2, 4, 5]]) == 0  # nothing else written
    with pytest.raises(BackendError, match="import_blocks"):
        be.import_blocks(dst, torch.tensor([0]), parts)
