"""The causal prefill-attention kernel (pagedkv.attention.prefill_kernel) against float64
attention with an explicit bottom-right causal mask: chunk shapes (whole prompts, chunks over
earlier context, lengths off the 16-key tile), GQA / MQA / MHA, head dims 8..256, one and two
threads; keys a row may not see have no influence (NaN there changes nothing); shapes it does
not take return None; and the CPU backend runs prefill chunks through it with the result of its
torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.attention import prefill_kernel
from pagedkv.attention.cpu import CPUBackend
from tests.attention.test_cpu import _random_step

KERNEL = prefill_kernel.get()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"prefill kernel not built: {prefill_kernel.build_error()}")


def _reference(q, k, v, scale):
    ql, n = q.shape[0], k.shape[0]
    mask = torch.ones(ql, n, dtype=torch.bool).tril(n - ql)  # row j sees keys 0 .. n - ql + j
    qh, kh, vh = (t.double().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("ql,n,hq,hkv,d", [
    (2, 2, 1, 1, 8),       # the smallest chunk
    (16, 16, 9, 3, 64),    # one whole tile (SmolLM2's heads)
    (17, 17, 9, 3, 64),    # one key past a tile, rows past a 4-row block
    (37, 100, 9, 3, 64),   # a chunk after 63 tokens of context
    (130, 130, 4, 1, 128), # MQA, d = 128
    (33, 50, 8, 8, 256),   # MHA, the largest head dim
    (64, 64, 6, 2, 72),    # d not a multiple of 64 (the 8-wide P V path)
])
def test_matches_float64_causal_attention(ql, n, hq, hkv, d, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    q, k, v = _rand(ql, hq, d, seed=1) * 2, _rand(n, hkv, d, seed=2) * 2, _rand(n, hkv, d, seed=3)
    out = KERNEL.attend(q, k, v, d ** -0.5)
    assert out.shape == (ql, hq, d) and out.dtype == torch.float32
    assert (out.double() - _reference(q, k, v, d ** -0.5)).abs().max().item() < 2e-5


def test_strided_views_and_keys_a_row_cannot_see():
    """q a view of a fused projection, k / v views of one [n, 2, hkv, d] buffer; NaN in keys and
    values past every row's position but the last leaves the other rows' outputs unchanged."""
    ql, n, hq, hkv, d = 20, 20, 9, 3, 64
    qkv = _rand(ql, (hq + 2) * d, seed=4)
    q = qkv[:, : hq * d].view(ql, hq, d)
    kv = _rand(n, 2, hkv, d, seed=5)
    k, v = kv[:, 0], kv[:, 1]
    want = _reference(q, k, v, 0.125)
    got = KERNEL.attend(q, k, v, 0.125)
    assert (got.double() - want).abs().max().item() < 2e-5
    kv[n - 1] = float("nan")  # the last token: only the last row sees it
    got2 = KERNEL.attend(q, k, v, 0.125)
    assert torch.equal(got2[: ql - 1], got[: ql - 1])
    assert torch.isnan(got2[ql - 1]).all()


def test_shapes_it_does_not_take_return_none():
    q, k = torch.zeros(4, 4, 64), torch.zeros(4, 2, 64)
    assert KERNEL.attend(q[..., :12].contiguous(), k[..., :12].contiguous(), k[..., :12].contiguous(), 1.0) is None
    assert KERNEL.attend(torch.zeros(4, 4, 264), torch.zeros(4, 2, 264), torch.zeros(4, 2, 264), 1.0) is None
    assert KERNEL.attend(torch.zeros(4, 3, 64), k, k, 1.0) is None  # 3 query heads over 2 KV heads
    assert KERNEL.attend(torch.zeros(5, 4, 64), k, k, 1.0) is None  # more rows than context
    assert KERNEL.attend(q.bfloat16(), k.bfloat16(), k.bfloat16(), 1.0) is None
    assert KERNEL.attend(q, k, k.clone().transpose(0, 1).contiguous().transpose(0, 1), 1.0) is None  # strides differ


def test_backend_prefill_chunks_take_the_kernel_and_equal_the_torch_path(monkeypatch):
    """A step with two prefill chunks (one after cached context) and a decode row: the chunks
    go through the kernel (counted), the output equals ``use_kernel=False``'s."""
    be, cache, md = _random_step("nhd", torch.float32, [300, 45, 128], [40, 45, 1])
    q = _rand(md.num_tokens, 9, 64, seed=6)
    calls = []
    real = KERNEL.attend
    monkeypatch.setattr(KERNEL, "attend", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    fast = be.forward(q, cache, md, 0.125)
    slow = CPUBackend(use_kernel=False).forward(q, cache, md, 0.125)
    assert sorted(calls) == [40, 45]
    assert (fast - slow).abs().max().item() < 2e-5
