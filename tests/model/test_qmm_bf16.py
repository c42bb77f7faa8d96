"""``qmm``'s bf16 kernel (``pagedkv.ops.qmm.pack_bf16``; ``qmm.c``, "bf16 weights") and the bf16
layers that run it below ``BF16_QMM_ROWS`` rows.

The kernel's sums are compared bit for bit with the same arithmetic written in torch: the
activations rounded to bf16, and per output 16 float32 lanes, lane i of each 32 inputs adding
the exact product of element 2i + 1, then of element 2i (vdpbf16ps's order), the lanes summed
at the end 8, 4, 2 and 1 apart. Every build the host can run must give those bits: the default
(vdpbf16ps where the CPU has AVX512-BF16), AVX-512 without BF16 (where the CPU has AVX-512),
AVX2 (what an AVX2-only CPU runs) and plain C. Denormals are not among the values: vdpbf16ps
flushes them to zero, the other builds keep them.
"""

from __future__ import annotations

import platform

import pytest
import torch

from pagedkv.cpu_isa import profile
from pagedkv.model.compiled import route_boundaries
from pagedkv.model.invariant import batch_invariant
from pagedkv.model.quant import BF16_QMM_ROWS, BF16Linear
from pagedkv.ops import qmm
from tests.model.builders import qmm_ops

BUILDS = ["default", "x86-64-v3", "x86-64"] if platform.machine() == "x86_64" else ["default"]
if platform.machine() == "x86_64" and {"avx512f", "avx512bw", "avx512vl"} <= set(profile().flags()):
    BUILDS.append("skylake-avx512")  # AVX-512 without BF16: the pairs split in registers


@pytest.fixture(scope="module", params=BUILDS)
def ops(request):
    return qmm_ops(request.param)


def bf16_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[R, N]``: ``x`` float32 ``[R, K]`` rounded to bf16 times bf16 ``w`` ``[N, K]``
    in the kernel's order (see the module docstring), plus ``bias``."""
    r, k = x.shape
    n = w.shape[0]
    xs = x.to(torch.bfloat16).float().reshape(r, 1, k // 32, 16, 2)
    ws = w.float().reshape(1, n, k // 32, 16, 2)
    acc = torch.zeros(r, n, 16)
    for c in range(k // 32):
        acc = acc + xs[:, :, c, :, 1] * ws[:, :, c, :, 1]  # exact products, one rounding per add
        acc = acc + xs[:, :, c, :, 0] * ws[:, :, c, :, 0]
    t = acc[..., :8] + acc[..., 8:]
    t = t[..., :4] + t[..., 4:]
    t = t[..., :2] + t[..., 2:]
    y = t[..., 0] + t[..., 1]
    return y + bias if bias is not None else y


def wide_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What a bf16 layer gives inputs of ``BF16_QMM_ROWS`` rows or more: oneDNN's bf16 matmul
    where the CPU multiplies bf16 natively, else one float32 matmul (bf16 would be emulated)."""
    import torch.nn.functional as F

    from pagedkv.model import quant

    y = F.linear(x.to(torch.bfloat16), w).float() if quant.cpu_features().bf16_fast else F.linear(x, w.float())
    return y + bias if bias is not None else y


@pytest.mark.parametrize("n,k", [(8, 32), (40, 96), (64, 576), (24, 1536)])
def test_bf16_sums_equal_the_reference_bit_for_bit(ops, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    for rows in (1, 2, 3, 4, 5, 7, 64):
        x = torch.randn(rows, k, generator=g) * 3
        assert torch.equal(ops.linear(x, qmm.pack_bf16(w, bias)), bf16_reference(x, w, bias)), rows
        assert torch.equal(ops.linear(x, qmm.pack_bf16(w)), bf16_reference(x, w)), rows


def test_rows_at_a_stride_zero_rows_and_special_values(ops):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    big = torch.randn(5, 96, generator=g)
    x = big[:, :64]  # rows 96 apart
    assert torch.equal(ops.linear(x, qmm.pack_bf16(w)), bf16_reference(x.contiguous(), w))
    assert ops.linear(torch.zeros(0, 64), qmm.pack_bf16(w)).shape == (0, 16)
    x = torch.randn(2, 64, generator=g)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    y = ops.linear(x, qmm.pack_bf16(w))
    assert y[0].isnan().all() and not y[1].isfinite().any()  # a NaN or inf input reaches every output


def test_concat_of_bf16_and_integer_parts_runs_each_part(ops):
    """A fused layer of bf16 parts (activations rounded to bf16 once), and one mixing a bf16
    part with an int8 one (both activation forms made): each part's columns as its own call gives."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(16, 64, generator=g).to(torch.bfloat16), torch.randn(24, 64, generator=g).to(torch.bfloat16)
    codes = torch.randint(-127, 128, (8, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(8, generator=g) + 0.01
    x = torch.randn(3, 64, generator=g)
    pa, pb, p8 = qmm.pack_bf16(a), qmm.pack_bf16(b), qmm.pack_int8(codes, scale)
    both = ops.linear(x, qmm.concat_packed([pa, pb]))
    assert torch.equal(both, torch.cat([bf16_reference(x, a), bf16_reference(x, b)], dim=1))
    mixed = ops.linear(x, qmm.concat_packed([p8, pa]))
    assert torch.equal(mixed, torch.cat([ops.linear(x, p8), bf16_reference(x, a)], dim=1))


def test_pack_bf16_holds_the_weight_itself_and_refuses_other_tensors():
    w = torch.randn(16, 64).to(torch.bfloat16)
    p = qmm.pack_bf16(w)
    assert (p.fmt, p.n, p.k) == (qmm.FMT_BF16, 16, 64)
    assert p.codes.data_ptr() == w.data_ptr() and p.nbytes == 16 * 64 * 2  # no copy
    assert torch.equal(qmm.get().dequantize(p), w.float())
    for bad in (torch.randn(16, 64), w.t(), w[:12], w[:, :48], torch.zeros(16, 64, 2, dtype=torch.bfloat16)):
        with pytest.raises(ValueError):
            qmm.pack_bf16(bad)


def test_bf16_layers_run_the_kernel_below_its_rows_and_a_plain_matmul_above(monkeypatch):
    """The fast route: ``qmm`` over the layer's own weight below ``BF16_QMM_ROWS`` rows (the
    reference's bits), plain ``F.linear`` from there (its bits), the weight held once;
    deterministic mode runs ``qmm`` at every row count (batch-invariant); a loaded state reaches
    the kernel (the weight is copied into in place)."""
    from pagedkv.model import quant

    g = torch.Generator().manual_seed(11)
    w, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(BF16_QMM_ROWS + 1, 64, generator=g)
    wb = w.to(torch.bfloat16)
    m = BF16Linear(w, bias).prepare("fast")
    assert m.qmm_rows == BF16_QMM_ROWS and m._qmm.codes.data_ptr() == m.weight.data_ptr()
    wide = "bf16" if quant.cpu_features().bf16_fast else "wide"
    assert [m.kernel(r) for r in (1, BF16_QMM_ROWS - 1, BF16_QMM_ROWS)] == ["q8", "q8", wide]
    assert route_boundaries(m) == [BF16_QMM_ROWS]  # a compiled step warms a graph for each side
    for r in (1, 5, BF16_QMM_ROWS - 1):
        assert torch.equal(m(x[:r]), bf16_reference(x[:r], wb, bias)), r
    assert torch.equal(m(x[:BF16_QMM_ROWS]), wide_reference(x[:BF16_QMM_ROWS], wb, bias))
    assert batch_invariant(m) == (False, "bf16 layers (kernels by row count)")
    m.set_deterministic(True)  # qmm at every row count: a row's sums never depend on its batch
    assert m.qmm_rows == qmm.ALL_ROWS and route_boundaries(m) == [] and batch_invariant(m) == (True, "")
    assert torch.equal(m(x), bf16_reference(x, wb, bias))
    assert torch.equal(m(x[3:4]), bf16_reference(x, wb, bias)[3:4])
    m.set_deterministic(False)
    assert m.qmm_rows == BF16_QMM_ROWS
    w2 = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    m.load_state_dict({"weight": w2, "bias": bias}, strict=False)
    assert torch.equal(m(x[:5]), bf16_reference(x[:5], w2, bias))
    monkeypatch.setenv("PAGEDKV_QMM", "0")  # no qmm: oneDNN (prepacked where bf16 is native) at every row count
    m = BF16Linear(w).prepare("fast")
    assert m._qmm is None and torch.equal(m(x[:5]), wide_reference(x[:5], wb))


def test_bf16_layers_on_cpus_without_native_bf16_and_with_amx(monkeypatch):
    """Without native bf16 (AVX2; oneDNN would emulate it) wider inputs run one fp32 matmul (the
    ``wide`` kernel) and ``qmm`` still takes decode rows; on AMX hosts ``qmm`` takes the same
    rows as elsewhere (the integer formats' ``$PAGEDKV_INT8_ROWS`` does not apply)."""
    import torch.nn.functional as F

    from pagedkv.model import quant
    from pagedkv.model.quant import CpuFeatures

    g = torch.Generator().manual_seed(13)
    w, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    x = torch.randn(BF16_QMM_ROWS, 64, generator=g)
    wb = w.to(torch.bfloat16)
    monkeypatch.setattr(quant, "cpu_features", lambda: CpuFeatures("AVX2", avx512_bf16=False, amx=False, vnni=False))
    m = BF16Linear(w, bias).prepare()  # auto_route: fast on every CPU
    assert m.route == "fast" and [m.kernel(r) for r in (1, BF16_QMM_ROWS - 1, BF16_QMM_ROWS)] == ["q8", "q8", "wide"]
    assert torch.equal(m(x[:3]), bf16_reference(x[:3], wb, bias))
    assert torch.equal(m(x), F.linear(x, wb.float()) + bias)
    monkeypatch.setattr(quant, "cpu_features", lambda: CpuFeatures("AVX512", avx512_bf16=True, amx=True, vnni=True))
    monkeypatch.setenv("PAGEDKV_INT8_ROWS", "8")
    m = BF16Linear(w, bias).prepare("fast")
    assert m.qmm_rows == BF16_QMM_ROWS and m.kernel(8) == "q8"


def test_a_new_weight_tensor_is_packed_again():
    """``layer.weight = t`` (or ``load_state_dict(..., assign=True)``) gives the layer a new tensor:
    ``qmm``'s pack follows it, so every row count multiplies by the new weights."""
    g = torch.Generator().manual_seed(17)
    m = BF16Linear(torch.randn(16, 64, generator=g)).prepare("fast")
    new = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    m.weight = new
    x = torch.randn(BF16_QMM_ROWS, 64, generator=g)
    assert m._qmm.codes is new and torch.equal(m(x[:5]), bf16_reference(x[:5], new))
    assert torch.equal(m(x), wide_reference(x, new))
    other = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    m.load_state_dict({"weight": other}, strict=False, assign=True)
    assert m._qmm.codes is m.weight and torch.equal(m(x[:5]), bf16_reference(x[:5], other))
