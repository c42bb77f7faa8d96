"""``qmm``'s f16 kernel (``qmm.c``, "f16 weights"; ``pack_gguf("F16", ...)``, ``FMT_F16``): a GGUF's
F16 matrices kept as stored (2 bytes per weight) and multiplied by the float32 activations as
given.

The kernel's sums are compared bit for bit with the same arithmetic written in numpy: per
output 16 float32 lanes, lane i of each 16 inputs adding x * w with one rounding (a fused
multiply-add: the product of a half and a float32 is exact in float64, the sum is taken exactly
as float64 + error (TwoSum) and rounded to odd, which float32 then rounds as the exact value
would be), the lanes summed at the end 8, 4, 2 and 1 apart. Every build the host
can run gives those bits, at every row count: one pass (up to 3 rows on AVX-512 builds) widens
each weight as it is read, more rows read a float32 widening of the group made once, the same
values.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from pagedkv.cpu_isa import profile
from pagedkv.ops import qmm
from tests.model.builders import qmm_ops

BUILDS = ["default", "x86-64-v3", "x86-64"] if platform.machine() == "x86_64" else ["default"]
if platform.machine() == "x86_64" and {"avx512f", "avx512bw", "avx512vl"} <= set(profile().flags()):
    BUILDS.append("skylake-avx512")


@pytest.fixture(scope="module", params=BUILDS)
def ops(request):
    return qmm_ops(request.param)


def raw_f16(w: torch.Tensor) -> np.ndarray:
    """A half ``[N, K]`` tensor as a GGUF stores it: uint8 ``[N, 2 K]``."""
    return w.contiguous().view(torch.uint8).numpy()


def fma32(a: np.ndarray, p: np.ndarray) -> np.ndarray:
    """float32 ``a + p`` rounded once (``a`` float32 values, ``p`` exact float64 products):
    TwoSum gives the float64 sum and its exact error, a sum with an error is moved to the odd
    neighbour on the error's side (round to odd), and float32 rounding of that equals rounding
    the exact sum (53 >= 24 + 2 bits)."""
    s = a + p
    bb = s - a
    e = (a - (s - bb)) + (p - bb)
    odd = (s.view(np.int64) & 1) == 1
    s = np.where((e != 0) & ~odd, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def f16_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[R, N]``: float32 ``x`` ``[R, K]`` times half ``w`` ``[N, K]`` in the kernel's
    order (the module docstring), plus ``bias``."""
    r, k = x.shape
    n = w.shape[0]
    xs = x.double().numpy().reshape(r, 1, k // 16, 16)
    ws = w.double().numpy().reshape(1, n, k // 16, 16)
    acc = np.zeros((r, n, 16), dtype=np.float32)
    for c in range(k // 16):
        acc = fma32(acc.astype(np.float64), xs[:, :, c] * ws[:, :, c])  # the product exact in float64
    acc = torch.from_numpy(acc)
    t = acc[..., :8] + acc[..., 8:]
    t = t[..., :4] + t[..., 4:]
    t = t[..., :2] + t[..., 2:]
    y = t[..., 0] + t[..., 1]
    return y + bias if bias is not None else y


@pytest.mark.parametrize("n,k", [(8, 32), (40, 96), (64, 576), (24, 1536)])
def test_f16_sums_equal_the_reference_bit_for_bit_at_every_row_count(ops, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).half()
    bias = torch.randn(n, generator=g)
    p, pb = ops.pack_gguf("F16", raw_f16(w), k), ops.pack_gguf("F16", raw_f16(w), k, bias)
    assert (p.fmt, p.n, p.k, p.nbytes) == (qmm.FMT_F16, n, k, n * k * 2)  # the file's bytes
    for rows in (1, 2, 3, 4, 5, 7, 64):
        x = torch.randn(rows, k, generator=g) * 3
        want = f16_reference(x, w)
        assert torch.equal(ops.linear(x, p), want), rows
        assert torch.equal(ops.linear(x, pb), want + bias), rows
        if rows > 1:
            assert torch.equal(ops.linear(x[1:2], p), want[1:2])  # a row alone = that row in a batch


def test_rows_at_a_stride_special_values_and_dequantize(ops):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g).half()
    w[0, 0], w[1, 1], w[2, 2] = 6.0e-8, -65504.0, 1e-5  # a denormal, the largest half, a small normal
    p = ops.pack_gguf("F16", raw_f16(w), 64)
    assert torch.equal(ops.dequantize(p), w.float())
    big = torch.randn(5, 96, generator=g)
    x = big[:, :64]  # rows 96 apart
    assert torch.equal(ops.linear(x, p), f16_reference(x.contiguous(), w))
    assert ops.linear(torch.zeros(0, 64), p).shape == (0, 16)
    x = torch.randn(2, 64, generator=g)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    y = ops.linear(x, p)
    assert y[0].isnan().all() and not y[1].isfinite().any()  # a NaN or inf input reaches every output


def test_concat_of_f16_and_integer_parts_runs_each_part(ops):
    """A fused layer mixing an F16 part with an int8 one: each part's columns as its own call
    gives, at one row and at a batch (the int8 part's activations made, the F16 part's not)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(16, 64, generator=g).half()
    codes = torch.randint(-127, 128, (8, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(8, generator=g) + 0.01
    pa, p8 = ops.pack_gguf("F16", raw_f16(a), 64), qmm.pack_int8(codes, scale)
    for rows in (1, 40):
        x = torch.randn(rows, 64, generator=g)
        mixed = ops.linear(x, qmm.concat_packed([p8, pa]))
        assert torch.equal(mixed, torch.cat([ops.linear(x, p8), f16_reference(x, a)], dim=1)), rows


def test_the_reference_rounds_once():
    """The reference's fused multiply-add on a case float64-then-float32 gets wrong (two roundings):
    1 + 0.0004878... x 0.00012219 is just above 1 + half an ulp, so it rounds up once."""
    a = np.array([1.0])
    p = np.array([np.float64(np.float32(0.0004878048785030842)) * np.float64(np.float16(0.00012218952178955078))])
    assert np.float32(a[0] + p[0]) == np.float32(1.0)  # the double rounding
    assert fma32(a, p)[0] == np.nextafter(np.float32(1.0), np.float32(2.0))


def test_pack_f16_keeps_rows_and_refuses_other_shapes():
    w = torch.randn(16, 64).half()
    raw = raw_f16(w)
    p = qmm.pack_gguf("F16", raw, 64)
    assert torch.equal(p.codes.view(torch.float16).reshape(16, 64), w)  # row-major, as stored
    rows = qmm.pack_gguf_rows("F16", 16, 64, lambda r0, r1: raw[r0:r1], chunk_rows=8)
    assert rows.fmt == qmm.FMT_F16 and torch.equal(rows.codes, p.codes)
    strided = np.zeros((16, 256), dtype=np.uint8)
    strided[:, :128] = raw
    assert torch.equal(qmm.pack_gguf("F16", strided[:, :128], 64).codes, p.codes)  # rows at a stride
    for bad, k in ((raw[:12], 64), (raw[:, :96], 48), (raw, 48), (raw.astype(np.int16), 64)):
        with pytest.raises(ValueError):
            qmm.pack_gguf("F16", bad, k)
