"""Quantised KV-cache formats (int8, fp8_e4m3, fp8_e5m2; pagedkv.attention.quant): codes and
bf16 scales within the format's error bound and dequantised exactly; the CPU kernel built
without -march=native and the torch path alone pass the kit's quantised cases; the kit fails
backends that dequantise, quantise or copy quantised blocks wrongly."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import cpu_kernel
from pagedkv.attention import layouts
from pagedkv.attention.cpu import CPUBackend
from pagedkv.attention.quant import FORMATS, dequantize, error_bound, quantize
from pagedkv.attention.reference import ReferenceBackend
from pagedkv.ops import build as csrc
from pagedkv.testing import check_backend, quantized_cases


# ------------------------------------------------------------------ formats (no model)
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("group", [64, 16, 8])
def test_quantize_stays_within_the_format_bound_and_dequantises_exactly(name, group):
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(0)
    # rows from 1e-3 to 1e3 in magnitude: the per-group scale must follow them
    x = torch.randn(40, 3, 64, generator=g) * torch.logspace(-3, 3, 40)[:, None, None]
    codes, scales = quantize(x, fmt, group)
    assert codes.dtype == fmt.storage and codes.shape == (40, 3, 64)
    assert scales.dtype == torch.bfloat16 and scales.shape == (40, 3, 64 // group)
    deq = dequantize(codes, scales, fmt)
    assert deq.dtype == torch.float32
    assert bool(((deq.double() - x.double()).abs() <= error_bound(x, scales, fmt)).all())
    vals = codes.view(fmt.code_dtype) if fmt.code_dtype is not None else codes
    exact = vals.double() * scales.double().repeat_interleave(group, dim=-1)
    assert torch.equal(deq.double(), exact)  # code x bf16 scale is exact in float32
    # the largest element of each group maps to the top code, or (int8) one below: the scale is
    # max|x| / QMAX rounded up to bf16 (at most 2^-7 larger)
    top = vals.double().reshape(40, 3, -1, group).abs().amax(-1)
    assert bool((top >= fmt.qmax * (1 - 2.0 ** -7) - 0.5).all()) and bool((top <= fmt.qmax).all())


def test_int8_codes_and_scales_of_two_groups():
    x = torch.tensor([[[1.0, -0.5, 0.25, 0.0, 127.0, 3.0, -2.0, 1.0]]])
    codes, scales = quantize(x, FORMATS["int8"], 4)
    # 1/127 = 0.0078740 rounds up to the bf16 0.0079346 (= 2^-7 * 1.015625); 127/127 = 1 is exact
    assert scales.float().flatten().tolist() == [0.0079345703125, 1.0]
    assert codes.flatten().tolist() == [126, -63, 32, 0, 127, 3, -2, 1]
    assert dequantize(codes, scales, FORMATS["int8"]).flatten()[4:].tolist() == [127.0, 3.0, -2.0, 1.0]


def test_zero_and_nan_groups():
    x = torch.zeros(2, 1, 8)
    x[1, 0, 3] = float("nan")
    for fmt in FORMATS.values():
        codes, scales = quantize(x, fmt, 8)
        assert scales[0].item() == 0 and torch.equal(dequantize(codes, scales, fmt)[0], torch.zeros(1, 8))
        assert torch.isnan(scales[1]).all()  # a poisoned slot reads back as NaN (conformance kit)


# ------------------------------------------------------------------ kernel portability
def test_cpu_kernel_without_native_flags_passes_the_quantised_cases(monkeypatch):
    """The kernel's int8/fp8/fp16 decoding is portable C (GCC vector extensions, integer bit
    manipulation): built for baseline x86-64 (SSE2 only) it gives the same answers."""
    if cpu_kernel.get() is None:
        pytest.skip(f"no C compiler here: {cpu_kernel.build_error()}")
    import platform

    march = "-march=x86-64" if platform.machine() in ("x86_64", "AMD64") else "-march=armv8-a"
    monkeypatch.setattr(cpu_kernel, "_FLAGS", [march if f.startswith("-march=") else f for f in cpu_kernel._FLAGS])
    monkeypatch.setattr(cpu_kernel, "_KERNEL", csrc.BuiltOnce("PAGEDKV_CPU_KERNEL",
                                                               lambda: cpu_kernel.CPUKernel(cpu_kernel._build())))
    kernel = cpu_kernel.get()
    assert kernel is not None, cpu_kernel.build_error()
    cases = [c for c in quantized_cases() if "group" not in c.tags or c.quant_group_size % 8 == 0]
    report = check_backend(CPUBackend(), cases=cases)
    assert report.ok, report.summary()


def test_torch_path_alone_passes_the_quantised_cases():
    report = check_backend(CPUBackend(use_kernel=False), cases=quantized_cases())
    assert report.ok, report.summary()


# ------------------------------------------------------------------ the kit's quantised cases are not vacuous
class _FirstGroupScaleOnly(ReferenceBackend):
    """Attention dequantises every group with the head vector's first scale."""

    def forward(self, query, kv_cache, metadata, scale):
        def wrong(cache, slots):
            k, v, ks, vs = layouts.gather_raw(cache, slots)
            return tuple(dequantize(c, s[..., :1].expand_as(s).contiguous(), cache.quant) for c, s in ((k, ks), (v, vs)))

        self.gather_kv = wrong
        try:
            return super().forward(query, kv_cache, metadata, scale)
        finally:
            del self.gather_kv


class _CoarseCodes(ReferenceBackend):
    """Stores int8 codes a quarter as fine (scale x4): values within 2 steps, not half of one."""

    def write_kv(self, kv_cache, key, value, slot_mapping):
        slots, key, value = layouts.valid_slots(slot_mapping, key, value)
        for x, codes, scales in ((key, kv_cache.key, kv_cache.key_scale), (value, kv_cache.value, kv_cache.value_scale)):
            c, s = quantize(x, kv_cache.quant, kv_cache.group_size)
            self.layout.write(codes, (c.float() / 4).round().to(torch.int8), slots, kv_cache.block_size)
            self.layout.write(scales, (s.float() * 4).to(s.dtype), slots, kv_cache.block_size)


class _CopiesCodesNotScales(ReferenceBackend):
    def copy_blocks(self, kv_cache, copies):
        src, dst = (torch.tensor([c[i] for c in copies]) for i in (0, 1))
        for t in (kv_cache.key, kv_cache.value):
            t.index_copy_(0, dst, t.index_select(0, src))


@pytest.mark.parametrize("broken,why", [
    (_FirstGroupScaleOnly, "vs the dequantised oracle"),
    (_CoarseCodes, "error bound of what was written"),
    (_CopiesCodesNotScales, "copy_blocks did not copy"),
])
def test_kit_rejects_broken_quantised_backends(broken, why):
    cases = [c for c in quantized_cases() if c.kv_cache_dtype == "int8" and (broken is not _FirstGroupScaleOnly or c.quant_group_size)]
    report = check_backend(broken(), dtypes=(torch.float32,), cases=cases)
    assert not report.ok
    assert all(why in r.message for r in report.failures), report.summary()


# ------------------------------------------------------------------ extreme magnitudes
def _extreme_rows() -> torch.Tensor:
    """[8, 1, 8]: zeros, a constant 1e4, mixed +-1e4, 3e38 (near float32's max), 1e-30,
    1e-42 (subnormal), float32's smallest subnormal, and a row of signed zeros."""
    rows = [[0.0] * 8, [1e4] * 8, [1e4, -1e4, 5e3, -2.5e3, 1.0, 0.0, -1e-3, 7e3],
            [3e38, -1e38, 1e30, 0.0, 1.0, -3e38, 2e38, 5e37], [1e-30, -3e-31, 0.0] + [2e-31] * 5,
            [1e-42, -3e-43, 0.0] + [5e-43] * 5, [1.401298464324817e-45] + [0.0] * 7, [-0.0] * 8]
    return torch.tensor(rows, dtype=torch.float32).unsqueeze(1)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_zero_huge_and_tiny_groups_stay_within_the_bound(name):
    """No NaN or inf from finite input; all-zero groups get scale 0, every other group a
    scale of at least 2^-126: max|x| / QMAX underflowing float32 (1e-42 / 57344, or any
    subnormal group) used to give scale 0, codes of x itself and an error beyond the bound."""
    fmt = FORMATS[name]
    x = _extreme_rows()
    codes, scales = quantize(x, fmt, 8)
    deq = dequantize(codes, scales, fmt)
    assert bool(torch.isfinite(deq).all()) and bool(torch.isfinite(scales.float()).all())
    assert bool(((deq.double() - x.double()).abs() <= error_bound(x, scales, fmt)).all())
    s = scales.float().flatten().tolist()
    assert s[0] == 0.0 and s[7] == 0.0 and torch.equal(deq[[0, 7]], torch.zeros(2, 1, 8))
    assert s[5] == s[6] == 2.0 ** -126  # the floor (tiny groups)
    assert s[1] == {"int8": 79.0, "fp8_e4m3": 22.375, "fp8_e5m2": 0.1748046875}[name]  # 1e4 / QMAX rounded up
    if name == "int8":
        assert deq[1, 0].tolist() == [10033.0] * 8  # code 127 x 79
        assert codes[5].flatten().tolist() == [0] * 8  # 1e-42 is below half a step of 2^-126


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_triton_writes_the_same_codes_and_scales_for_extreme_groups(name):
    """The Triton write kernel (interpreter on CPU) quantises like ``quantize``, the
    zero-scale and 2^-126 floor included: the same scales bit for bit, the same code values
    (a -0.0 may be stored as fp8 +0)."""
    from pagedkv.attention import get_backend

    be = get_backend("triton")
    x = _extreme_rows()
    cache = be.allocate_kv_cache(2, 4, 1, 8, name, quant_group_size=8)
    slots = torch.tensor([7, 0, 1, 2, 3, 4, 5, 6])
    be.write_kv(cache, x, -x, slots)
    k, v, ks, vs = be.gather_kv_raw(cache, slots)
    for got_c, got_s, src in ((k, ks, x), (v, vs, -x)):
        fmt = FORMATS[name]
        want_c, want_s = quantize(src, fmt, 8)
        value = (lambda c: c.view(fmt.code_dtype).float()) if fmt.code_dtype is not None else (lambda c: c)
        assert torch.equal(value(got_c), value(want_c))
        assert torch.equal(got_s.view(torch.int16), want_s.view(torch.int16))


# ------------------------------------------------------------------ chunking (no model)
def _write_in_chunks(be, name, x_k, x_v, table, chunk):
    """A fresh cache with tokens ``0..n-1`` of one sequence (blocks ``table``, 16 tokens each)
    written ``chunk`` tokens per ``write_kv`` call, each call followed by the step's attention
    over the whole context so far (as a chunked prefill does); returns the cache."""
    from pagedkv.attention.base import AttentionMetadata

    n, h, d = x_k.shape
    cache = be.allocate_kv_cache(8, 16, h, d, name)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        md = AttentionMetadata.build([b], [b - a], [table], 16)
        be.write_kv(cache, x_k[a:b], x_v[a:b], md.slot_mapping)
        be.forward(torch.randn(b - a, 2 * h, d), cache, md, d ** -0.5)
    return cache


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_stored_codes_and_scales_do_not_depend_on_chunking(backend, name):
    """Scales are per token (per group of a token's head vector), never per block: a token's
    stored codes and scales are ``quantize`` of its own K/V, bit for bit, whether the prompt
    is written at once or 4 / 16 / 5 tokens at a time (a later chunk never rescales a block an
    earlier one started), by every write route; and attention reads the same values back."""
    from pagedkv.attention import get_backend
    from pagedkv.attention.base import AttentionMetadata

    be = get_backend(backend)
    g = torch.Generator().manual_seed(5)
    n, h, d = 37, 2, 64
    # later tokens much larger than earlier ones in the same block: a block scale fixed by
    # the first chunk would clip them; a rescale would change the earlier ones
    grow = torch.logspace(-2, 2, n).view(n, 1, 1)
    x_k = torch.randn(n, h, d, generator=g) * grow
    x_v = torch.randn(n, h, d, generator=g) * grow.flip(0)
    table = [5, 2, 7]
    slots = AttentionMetadata.build([n], [n], [table], 16).slot_mapping
    fmt = FORMATS[name]
    value = (lambda c: c.view(fmt.code_dtype).float()) if fmt.code_dtype is not None else (lambda c: c)
    want = [quantize(x, fmt, d) for x in (x_k, x_v)]
    ref = None
    q = torch.randn(n, 2 * h, d, generator=g)
    md = AttentionMetadata.build([n], [n], [table], 16)
    for chunk in (n, 4, 16, 5):
        cache = _write_in_chunks(be, name, x_k, x_v, table, chunk)
        k, v, ks, vs = be.gather_kv_raw(cache, slots)
        for got_c, got_s, (want_c, want_s) in ((k, ks, want[0]), (v, vs, want[1])):
            assert torch.equal(value(got_c), value(want_c)), chunk
            assert torch.equal(got_s.view(torch.int16), want_s.view(torch.int16)), chunk
        out = be.forward(q, cache, md, d ** -0.5)  # the same reader over the same stored bytes
        if ref is None:
            ref = out
        assert torch.equal(out, ref), chunk
