"""Triton backend specifics (under TRITON_INTERPRET=1 on CPU: tiny shapes): the split-K
decode path with many splits inside a mixed batch, strided queries, write_kv skipping -1."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import AttentionMetadata
from pagedkv.errors import BackendError
from pagedkv.testing import Case, run_case


def _triton(**kw):
    from pagedkv.attention.triton_backend import TritonBackend

    try:
        return TritonBackend(**kw)
    except BackendError as exc:
        pytest.skip(str(exc))


def test_windowed_split_k_and_prefill_tiles():
    """A window of 150 over 200-331 token contexts split into 64-token partitions (the splits
    cover the window only; the reduce merges just those), and a prefill whose query tiles
    start their key loops at different window starts; blocks before the window are NaN."""
    be = _triton(split_len=64, block_n=32, block_m=16)
    cases = [Case("window_splits", (200, 331, 90), (1, 1, 70), 8, 6, 2, 32, sliding_window=150,
                  logits_soft_cap=4.0, tags=("window", "split", "mixed")),
             Case("window_splits_int8", (331, 47), (1, 40), 8, 4, 2, 32, sliding_window=150,
                  kv_cache_dtype="int8", tags=("window", "split", "quantized"))]
    for case in cases:
        res = run_case(be, case, torch.float32)
        assert res.ok, res.line()


def test_many_splits_in_a_mixed_batch():
    be = _triton(split_len=64, block_n=32)
    case = Case("mixed_split", (200, 30, 131), (1, 30, 1), 8, 6, 2, 32, tags=("split", "mixed"))
    for dtype in (torch.float32, torch.bfloat16):
        res = run_case(be, case, dtype)
        assert res.ok, res.line()


def test_strided_query_and_padding_rows():
    be = _triton()
    ref = _triton()
    bs, hkv, d, hq = 4, 2, 16, 4
    cache = be.allocate_kv_cache(8, bs, hkv, d, torch.float32)
    md_full = AttentionMetadata.build([9], [9], [[5, 2, 7]], bs)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(9, hkv, d, generator=g), torch.randn(9, hkv, d, generator=g)
    be.write_kv(cache, k, v, md_full.slot_mapping)
    md = AttentionMetadata.build([9], [1], [[5, 2, 7]], bs)
    md.slot_mapping = torch.cat([md.slot_mapping, torch.tensor([-1])])  # one padding row
    md.query_lens_list = None  # exercise the path without python-side lengths
    qkv = torch.randn(2, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, : hq * d].view(2, hq, d)
    out = be.forward(q, cache, md, d ** -0.5)
    out_c = ref.forward(q.contiguous(), cache, md, d ** -0.5)
    assert torch.equal(out, out_c)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    gk, gv = be.gather_kv(cache, md_full.slot_mapping)
    assert torch.equal(gk, k) and torch.equal(gv, v)
