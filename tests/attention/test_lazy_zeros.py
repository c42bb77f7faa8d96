"""``layouts.lazy_zeros``: a CPU KV cache from pages the OS hands out already zero, so a large
budget costs no start-up clearing and no resident memory until blocks are written."""

from __future__ import annotations

import torch

from pagedkv.attention import layouts


def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_zeros_aligned_of_the_dtype_and_shape_and_not_resident_until_written():
    before = _rss()
    t = layouts.lazy_zeros((64, 16, 2, 1024), torch.bfloat16)  # 4 MiB x 16 = 64 MiB
    assert t.shape == (64, 16, 2, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % 64 == 0
    assert _rss() - before < 8 << 20  # the budget is not faulted in
    t[3, 5] = 1.5  # one block written: its pages only
    assert _rss() - before < 16 << 20
    assert float(t[3, 5].float().sum()) == 1.5 * 2 * 1024 and int(torch.count_nonzero(t)) == 2 * 1024
    t.zero_()
    assert int(torch.count_nonzero(t)) == 0


def test_small_or_non_cpu_tensors_are_plain_zeros():
    t = layouts.lazy_zeros((4, 8), torch.float32)
    assert torch.equal(t, torch.zeros(4, 8)) and t.dtype == torch.float32


def test_allocate_gives_lazily_zeroed_caches_in_every_format():
    for name in layouts.LAYOUTS:
        for dtype in (torch.float32, torch.bfloat16, "int8"):
            c = layouts.allocate(layouts.get_layout(name), 256, 16, 4, 64, dtype)  # 4 MiB per fp32 tensor
            assert c.key.data_ptr() % 64 == 0 and c.value.data_ptr() % 64 == 0
            assert int(torch.count_nonzero(c.key)) == 0 and int(torch.count_nonzero(c.value)) == 0
