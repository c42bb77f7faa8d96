"""The CPU attention kernel is batch-invariant (docs/determinism.md): a query row's output is
bit-identical whether it is computed alone (a decode row), inside a prefill chunk of any length,
beside other sequences, split into context segments or not, on 1 or 2 threads; for float32,
bf16 and int8/fp8 caches, GQA, sliding windows and soft-caps."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import AttentionMetadata
from pagedkv.ops import cpu_kernel
from pagedkv.attention.cpu import CPUBackend
from pagedkv.attention import quant as Q

KERNEL = cpu_kernel.get()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"CPU kernel not built: {cpu_kernel.build_error()}")

BS = 16


def _setup(seq_lens, cache_dtype, hq, hkv, d, seed=0):
    """A cache holding K/V for every position of ``seq_lens`` sequences (shuffled blocks) and
    one query vector per position: ``q[s]`` ``[seq_len, hq, d]``."""
    g = torch.Generator().manual_seed(seed)
    be = CPUBackend()
    need = sum(-(-s // BS) for s in seq_lens)
    perm = torch.randperm(need + 3, generator=g).tolist()
    tables, p = [], 0
    for s in seq_lens:
        n = -(-s // BS)
        tables.append(perm[p : p + n])
        p += n
    cache = be.allocate_kv_cache(need + 3, BS, hkv, d, cache_dtype,
                                 quant_group_size=32 if cache_dtype in Q.FORMATS else None)
    full = AttentionMetadata.build(seq_lens, seq_lens, tables, BS)
    kv_dtype = torch.float32 if cache_dtype in Q.FORMATS else cache_dtype
    be.write_kv(cache, torch.randn(full.num_tokens, hkv, d, generator=g).to(kv_dtype),
                torch.randn(full.num_tokens, hkv, d, generator=g).to(kv_dtype), full.slot_mapping)
    q = [torch.randn(s, hq, d, generator=g) for s in seq_lens]
    return be, cache, tables, q


def _attend(be, cache, tables, q, seq_lens, q_lens, qdt, window, cap):
    """Rows ``[seq_len - q_len, seq_len)`` of each listed sequence in one call; returns the
    output rows per sequence."""
    md = AttentionMetadata.build(seq_lens, q_lens, tables, BS)
    query = torch.cat([q[i][s - n : s] for i, (s, n) in enumerate(zip(seq_lens, q_lens))]).to(qdt)
    out = be.forward(query, cache, md, 0.125, sliding_window=window, logits_soft_cap=cap)
    res, a = [], 0
    for n in q_lens:
        res.append(out[a : a + n])
        a += n
    return res


@pytest.mark.parametrize("cache_dtype,qdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), ("int8", torch.float32),
                                             ("fp8_e4m3", torch.float32)])
@pytest.mark.parametrize("window,cap", [(None, None), (40, None), (None, 30.0)])
@pytest.mark.parametrize("split", [0, 32, 512])
def test_a_row_gets_the_same_bits_in_any_chunk_batch_split_and_thread_count(cache_dtype, qdt, window, cap, split,
                                                                           monkeypatch):
    monkeypatch.setattr(KERNEL, "min_split_len", split)
    hq, hkv, d = 6, 2, 64
    L = 150  # the sequence under test; the others ride along
    seq_lens = [L, 97, 33]
    be, cache, tables, q = _setup(seq_lens, cache_dtype, hq, hkv, d)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        # reference: every position of sequence 0 as a decode row, alone, one thread
        ref = torch.cat([_attend(be, cache, [tables[0]], [q[0]], [p], [1], qdt, window, cap)[0]
                         for p in range(1, L + 1)])
        assert torch.isfinite(ref.float()).all()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            # one-shot prefill of the whole sequence
            whole = _attend(be, cache, [tables[0]], [q[0]], [L], [L], qdt, window, cap)[0]
            assert torch.equal(whole, ref), f"one-shot prefill, {threads} threads"
            # chunks of 4 / 5 / 16 / 17 rows over the cached prefix, each beside other sequences
            for chunk in (4, 5, 16, 17):
                rows = []
                for s in range(0, L, chunk):
                    e = min(L, s + chunk)
                    lens, ql = [e, 97, 33], [e - s, 7, 1]
                    rows.append(_attend(be, cache, tables, q, lens, ql, qdt, window, cap)[0])
                assert torch.equal(torch.cat(rows), ref), f"chunk {chunk}, {threads} threads"
            # the last rows as a batch of decode rows with other sequences' chunks
            got = _attend(be, cache, [tables[1], tables[0], tables[2]], [q[1], q[0], q[2]], [97, L, 33], [30, 1, 33],
                          qdt, window, cap)[1]
            assert torch.equal(got, ref[-1:])
    finally:
        torch.set_num_threads(old)


def test_the_split_length_is_a_multiple_of_the_tile_and_changes_nothing_but_the_work_items(monkeypatch):
    """split_len is rounded up to whole 16-key tiles; results agree with the unsplit kernel to
    float32 rounding (a different but fixed summation order)."""
    be, cache, tables, q = _setup([700], torch.float32, 4, 2, 64)
    monkeypatch.setattr(KERNEL, "min_split_len", 0)
    a = _attend(be, cache, tables, q, [700], [3], torch.float32, None, None)[0]
    monkeypatch.setattr(KERNEL, "min_split_len", 100)  # -> 112
    b = _attend(be, cache, tables, q, [700], [3], torch.float32, None, None)[0]
    c = torch.cat([_attend(be, cache, tables, q, [p], [1], torch.float32, None, None)[0] for p in (698, 699, 700)])
    assert torch.equal(b, c)
    assert (a - b).abs().max().item() < 1e-5


def test_out_of_range_split_and_window_values_mean_off(monkeypatch):
    """A split length near INT_MAX means "never split" (it once overflowed to a negative
    segment and an all-zero output); a window of 2**31 tokens or more is no window (it was cut
    to 32 bits: 2**32 + 5 became a window of 5)."""
    be, cache, tables, q = _setup([40], torch.float32, 2, 1, 8)
    monkeypatch.setattr(KERNEL, "min_split_len", 0)
    want = _attend(be, cache, tables, q, [40], [3], torch.float32, None, None)[0]
    for split in (2**31 - 1, 2**31 - 15):
        monkeypatch.setattr(KERNEL, "min_split_len", split)
        assert torch.equal(_attend(be, cache, tables, q, [40], [3], torch.float32, None, None)[0], want)
    monkeypatch.setattr(KERNEL, "min_split_len", 512)
    for window in (2**31 - 1, 2**31, 2**32 + 5, 2**63):
        assert torch.equal(_attend(be, cache, tables, q, [40], [3], torch.float32, window, None)[0], want)
