"""Attention sinks (gpt-oss: a float32 logit per query head in each softmax's denominator, with
no value) in the CPU backend's C kernel (``pagedkv/csrc/cpu_kernel.c``): its ``forward`` and its
one-call ``write_and_forward`` must equal the torch path (``CPUBackend(use_kernel=False)``, the
sink as one more score column) to float rounding, for several head counts (GQA groups of 1 to
8), windows, block sizes, cache formats, split contexts and thread counts; a huge sink drives the
output to zero, a very negative one leaves the plain attention."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import AttentionMetadata
from pagedkv.attention.base import BackendError
from pagedkv.attention.cpu import CPUBackend
from pagedkv.ops import cpu_kernel

D = 32
LENS, QLENS = [45, 9, 20, 1], [12, 1, 1, 1]  # a chunk, decode rows (one over a block edge), a first token


def _kernel():
    k = cpu_kernel.get()
    if k is None:
        pytest.skip(f"CPU kernel not built here: {cpu_kernel.build_error()}")
    return k


def _setup(hq: int, hkv: int, block: int, dtype, seed: int = 0):
    """A cache (of ``dtype``) holding the context of ``LENS`` before this step's rows, the step's
    metadata, its new q/k/v rows, and sinks ``[hq]``: ``(cache, md, q, k, v, sinks)``."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-n // block) for n in LENS)
    perm = torch.randperm(need + 3, generator=g).tolist()
    tables, p = [], 0
    for n in LENS:
        tables.append(perm[p:p + -(-n // block)])
        p += -(-n // block)
    cache = CPUBackend().allocate_kv_cache(need + 3, block, hkv, D, dtype)
    before = [n - q for n, q in zip(LENS, QLENS)]
    if sum(before):
        ctx = AttentionMetadata.build(before, before, [t for t, b in zip(tables, before)], block)
        CPUBackend().write_kv(cache, torch.randn(sum(before), hkv, D, generator=g),
                              torch.randn(sum(before), hkv, D, generator=g), ctx.slot_mapping)
    md = AttentionMetadata.build(LENS, QLENS, tables, block)
    n = sum(QLENS)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (hq, hkv, hkv))
    return cache, md, q * 2, k * 2, v, torch.randn(hq, generator=g) * 3


def _clone(cache):
    twin = CPUBackend().allocate_kv_cache(cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim,
                                          cache.quant.name if cache.quant is not None else cache.dtype)
    for a, b in zip((twin.key, twin.value), (cache.key, cache.value)):
        a.copy_(b)
    if cache.quant is not None:
        twin.key_scale.copy_(cache.key_scale)
        twin.value_scale.copy_(cache.value_scale)
    return twin


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (8, 1), (12, 4)])
@pytest.mark.parametrize("window", [None, 7, 30])
@pytest.mark.parametrize("block", [1, 4, 16])
def test_kernel_sinks_equal_the_torch_path(hq, hkv, window, block):
    _kernel()
    cache, md, q, k, v, sinks = _setup(hq, hkv, block, torch.float32, seed=hq + block)
    twin = _clone(cache)
    fast, slow = CPUBackend(), CPUBackend(use_kernel=False)
    got = fast.write_and_forward(q, k, v, cache, md, 0.2, sliding_window=window, sinks=sinks)
    slow.write_kv(twin, k, v, md.slot_mapping)
    want = slow.forward(q, twin, md, 0.2, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.key, twin.key) and torch.equal(cache.value, twin.value)
    # forward alone (the multi-sequence kernel entry) gives the one-call path's bits
    assert torch.equal(fast.forward(q, cache, md, 0.2, sliding_window=window, sinks=sinks), got)
    plain = fast.forward(q, cache, md, 0.2, sliding_window=window)
    assert (plain - got).abs().max() > 1e-2  # the sinks matter


@pytest.mark.parametrize("dtype", [torch.bfloat16, "int8", "fp8_e4m3"])
def test_kernel_sinks_on_other_cache_formats(dtype):
    _kernel()
    cache, md, q, k, v, sinks = _setup(8, 2, 4, dtype, seed=3)
    twin = _clone(cache)
    got = CPUBackend().write_and_forward(q, k, v, cache, md, 0.2, sliding_window=9, sinks=sinks)
    slow = CPUBackend(use_kernel=False)
    slow.write_kv(twin, k, v, md.slot_mapping)
    want = slow.forward(q, twin, md, 0.2, sliding_window=9, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_split_contexts_join_the_sink_once(threads, monkeypatch):
    """Segments of a long context are merged with the sink joined once, at the merged max."""
    k = _kernel()
    monkeypatch.setattr(k, "min_split_len", 16)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache, md, q, kn, vn, sinks = _setup(8, 2, 4, torch.float32, seed=11)
        CPUBackend().write_kv(cache, kn, vn, md.slot_mapping)
        got = CPUBackend().forward(q, cache, md, 0.2, sinks=sinks)
        want = CPUBackend(use_kernel=False).forward(q, cache, md, 0.2, sinks=sinks)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sink_extremes_and_a_soft_cap():
    _kernel()
    cache, md, q, k, v, _ = _setup(4, 2, 16, torch.float32, seed=5)
    be = CPUBackend()
    be.write_kv(cache, k, v, md.slot_mapping)
    plain = be.forward(q, cache, md, 0.2)
    assert torch.equal(be.forward(q, cache, md, 0.2, sinks=torch.full((4,), -200.0)), plain)
    assert be.forward(q, cache, md, 0.2, sinks=torch.full((4,), 200.0)).abs().max() < 1e-30
    sinks = torch.tensor([0.5, -1.0, 2.0, 4.0])
    got = be.forward(q, cache, md, 0.2, logits_soft_cap=3.0, sinks=sinks)
    want = CPUBackend(use_kernel=False).forward(q, cache, md, 0.2, logits_soft_cap=3.0, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_write_and_forward_takes_the_kernel_and_checks_sinks_before_writing(monkeypatch):
    k = _kernel()
    cache, md, q, kn, vn, sinks = _setup(4, 2, 16, torch.float32, seed=7)
    seen, orig = [], type(k).write_attend
    monkeypatch.setattr(type(k), "write_attend", lambda self, *a, **kw: seen.append(a[-1]) or orig(self, *a, **kw))
    before = cache.key.clone()
    with pytest.raises(BackendError, match="sinks"):
        CPUBackend().write_and_forward(q, kn, vn, cache, md, 0.2, sinks=torch.zeros(3))
    for backend in (CPUBackend(), CPUBackend(use_kernel=False)):  # a meta tensor has no values to read
        with pytest.raises(BackendError, match="sinks must be on the queries' device"):
            backend.write_and_forward(q, kn, vn, cache, md, 0.2, sinks=torch.zeros(4, device="meta"))
        with pytest.raises(BackendError, match="sinks must be on the queries' device"):
            backend.forward(q, cache, md, 0.2, sinks=torch.zeros(4, device="meta"))
    assert torch.equal(cache.key, before) and not seen
    CPUBackend().write_and_forward(q, kn, vn, cache, md, 0.2, sinks=sinks.double())  # any float dtype
    assert len(seen) == 1 and seen[0].dtype == torch.float32
