"""The integer matmul kernels (``pagedkv.ops.qmm``): int4 / int8 weights times activations
quantised to int8 blocks of 32, and the ``"q8"`` route of the quantised linear layers.

The kernels' sums are checked against the same arithmetic done in float64 by torch (the
activation codes emulated here), so a wrong nibble, lane, block or scale shows as an error far
above float32 rounding. Each build the host can run is checked: the default one (VNNI where
the CPU has it), the AVX2 one (``vpmaddubsw``; what an AVX2-only CPU runs) and the plain C one.
"""

from __future__ import annotations

import platform

import pytest
import torch

from pagedkv.ops import qmm
from pagedkv.model.quant import CpuFeatures, Int4Linear, Int8Linear
from pagedkv.model import quant
from pagedkv.model.compiled import route_boundaries
from tests.model.builders import qmm_ops

BUILDS = ["default", "x86-64-v3", "x86-64"] if platform.machine() == "x86_64" else ["default"]
if qmm.get() is not None and qmm.get().isa == "avx512-vnni":
    BUILDS.append("tiles-ymm")  # the 8-column tiles AVX-VNNI CPUs (no AVX-512) run, built here


@pytest.fixture(scope="module", params=BUILDS)
def ops(request):
    return qmm_ops(request.param)


def _emulated(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activations: codes round(x / d) * d per block of 32 (d = max|x| / 127,
    float32 like the C code), float64 ``[R, K]``, and the exact block sums ``[R, K / 32]``."""
    r, k = x.shape
    xb = x.reshape(r, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # a correctly rounded float32 division, as C's 127.0f / mx: torch's ``127.0 / amax`` is
    # reciprocal(amax) * 127, one ulp off at times, which moves an x / d on a tie by one code
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).double()
    return (q * (amax / 127.0).double()).reshape(r, k), xb.double().sum(-1)


# 8 columns: one group; 24: a pair of groups and an odd one (the 512-bit path pairs groups)
SHAPES = [(8, 32), (24, 64), (48, 96), (576, 576), (64, 1536)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_sums_equal_the_emulated_arithmetic(ops, n, k):
    g = torch.Generator().manual_seed(n + k)
    m = Int4Linear.from_float(torch.randn(n, k, generator=g) * 0.1)
    bias = torch.randn(n, generator=g)
    w = qmm.pack_int4(m.codes(), m.scale, m.min, bias)
    assert torch.equal(m.scale.half().float(), m.scale)  # from_float rounds the scales as Q4_1 stores them
    codes = m.codes().double().reshape(n, k // 32, 32)
    for rows in (1, 2, 3, 4, 5, 9, 17):  # row tiles of 5 (AVX2) or 8: whole, partial, several
        base = torch.randn(rows, k + 7, generator=g)
        x = base[:, :k]  # a row stride that is not k
        x[0, 3] = 40.0  # an outlier: costs its own block's precision only
        xq, xs = _emulated(x)
        ref = torch.einsum("rbj,nbj,nb->rn", xq.reshape(rows, k // 32, 32), codes, m.scale.double())
        ref += xs @ m.min.double().T + bias.double()
        got = ops.linear(x, w)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert (got.double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_sums_equal_the_emulated_arithmetic(ops, n, k):
    g = torch.Generator().manual_seed(n * k)
    m = Int8Linear.from_float(torch.randn(n, k, generator=g))
    m.qweight[0, :32] = 127  # the largest codes of both signs: pairwise int16 sums at their limit
    m.qweight[1, :32] = -127
    w = qmm.pack_int8(m.qweight, m.scale)
    for rows in (1, 4, 6):
        x = torch.randn(rows, k, generator=g)
        x[:, :32] = torch.where(torch.arange(32) % 2 == 0, 1.0, -1.0) * 3.0  # codes +-127
        xq, _ = _emulated(x)
        ref = xq @ m.dequantize().double().T
        got = ops.linear(x, w)
        assert (got.double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


def test_zero_rows_and_zero_blocks(ops):
    m = Int4Linear.from_float(torch.randn(16, 64))
    w = qmm.pack_int4(m.codes(), m.scale, m.min)
    assert torch.equal(ops.linear(torch.zeros(2, 64), w), torch.zeros(2, 16))  # d = 0 blocks
    assert ops.linear(torch.zeros(0, 64), w).shape == (0, 16)


def test_dequantize_gives_the_formats_weights(ops):
    g = torch.Generator().manual_seed(2)
    m4 = Int4Linear.from_float(torch.randn(24, 64, generator=g))
    torch.testing.assert_close(ops.dequantize(qmm.pack_int4(m4.codes(), m4.scale, m4.min)), m4.dequantize(),
                               rtol=1e-6, atol=1e-6)
    m8 = Int8Linear.from_float(torch.randn(24, 64, generator=g))
    assert torch.equal(ops.dequantize(qmm.pack_int8(m8.qweight, m8.scale)), m8.dequantize())


def test_bad_inputs_are_value_errors():
    ops = qmm.get()
    m = Int4Linear.from_float(torch.randn(16, 64))
    w = qmm.pack_int4(m.codes(), m.scale, m.min)
    for bad, what in ((torch.randn(2, 64, dtype=torch.float64), "float32"), (torch.randn(2, 32), "float32 \\[rows, 64\\]"),
                      (torch.randn(64, 2).T, "unit column stride"), (torch.randn(64), "float32")):
        with pytest.raises(ValueError, match=what):
            ops.linear(bad, w)
    with pytest.raises(ValueError, match="bias"):
        qmm.pack_int4(m.codes(), m.scale, m.min, torch.randn(8))
    with pytest.raises(ValueError, match="multiple of 8"):
        qmm.pack_int4(torch.zeros(12, 64, dtype=torch.uint8), torch.ones(12, 2), torch.zeros(12, 2))
    with pytest.raises(ValueError, match="multiple of 32"):
        qmm.pack_int8(torch.zeros(16, 40, dtype=torch.int8), torch.ones(16))
    with pytest.raises(ValueError, match="-127..127"):
        qmm.pack_int8(torch.full((8, 32), -128, dtype=torch.int8), torch.ones(8))


# ---- the route of the quantised layers ---------------------------------------------------------

AVX2 = CpuFeatures("AVX2", avx512_bf16=False, amx=False, vnni=False)
AMX = CpuFeatures("AVX512", avx512_bf16=True, amx=True, vnni=True)


@pytest.mark.parametrize("make", [Int4Linear.from_float, Int8Linear.from_float])
def test_q8_route_takes_every_row_count_without_amx(monkeypatch, make):
    monkeypatch.delenv("PAGEDKV_QMM", raising=False)
    monkeypatch.delenv("PAGEDKV_INT8_ROWS", raising=False)
    monkeypatch.setattr(quant, "cpu_features", lambda: AVX2)
    g = torch.Generator().manual_seed(11)
    m = make(torch.randn(48, 96, generator=g) * 0.1, torch.randn(48, generator=g)).prepare("fast")
    assert m.qmm_rows == qmm.ALL_ROWS and m.int8_rows == 0
    assert [m.kernel(r) for r in (1, 7, 8, 64, 65, 600)] == ["q8"] * 6
    assert not m.takes_bf16(1)  # it quantises float32 activations itself
    if isinstance(m, Int4Linear):
        assert m._packed is None  # no ATen copy of the weights kept
    for rows in (1, 5, 100):
        x = torch.randn(rows, 96, generator=g)
        ref = x @ m.dequantize().T + m.bias
        got = m(x)
        assert got.dtype == torch.float32
        assert (got - ref).abs().max().item() < 0.02 * ref.abs().max().item()  # 8-bit activation blocks
        assert m(x.bfloat16()).dtype == torch.bfloat16
    assert route_boundaries(torch.nn.Sequential(m)) == []  # one kernel: one compiled graph
    m.prepare("fallback")
    assert m.qmm_rows == 0 and m.kernel(1) == "fallback"


@pytest.mark.parametrize("make,buf", [(Int4Linear.from_float, "qcodes"), (Int8Linear.from_float, "qweight")])
def test_the_packed_copy_replaces_the_stored_codes_where_it_runs_every_row_count(monkeypatch, make, buf):
    """Without AMX the packed copy is all a layer runs: the stored codes are freed and come back
    from it, bit for bit, for state_dict, dequantize, a copy and a re-prepare on another route."""
    import copy
    import threading

    from pagedkv.model.quant import module_from_state, shapes_only

    monkeypatch.delenv("PAGEDKV_QMM", raising=False)
    monkeypatch.delenv("PAGEDKV_INT8_ROWS", raising=False)
    monkeypatch.setattr(quant, "cpu_features", lambda: AVX2)
    g = torch.Generator().manual_seed(5)
    m = make(torch.randn(48, 96, generator=g) * 0.1, torch.randn(48, generator=g))
    codes, w, state = getattr(m, buf).clone(), m.dequantize(), {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(3, 96, generator=g)
    m.prepare("fast")
    assert getattr(m, buf) is None and buf not in dict(m.named_buffers())  # freed
    assert torch.equal(m.stored_codes(), codes) and torch.equal(m.dequantize(), w)
    got = m.state_dict()
    assert list(got) == list(state) and all(torch.equal(got[k], state[k]) for k in state)
    with shapes_only():  # key and shape checks unpack nothing
        meta = m.state_dict()[buf]
    assert meta.is_meta and meta.shape == codes.shape and meta.dtype == codes.dtype
    y = m(x)
    assert torch.equal(copy.deepcopy(m)(x), y) and getattr(module_from_state(got, "").prepare("fast"), buf) is None
    m.prepare("fallback")  # the kernels that read the codes: the codes back first
    assert torch.equal(getattr(m, buf), codes) and m._qmm is None
    m.prepare("fast")
    assert getattr(m, buf) is None and torch.equal(m(x), y)
    other = make(torch.randn(48, 96, generator=g) * 0.1, torch.randn(48, generator=g)).prepare("fast")
    m.load_state_dict(other.state_dict())  # dropped codes come back and load like any buffer
    assert torch.equal(getattr(m, buf), other.stored_codes())
    m.prepare("fast")
    assert getattr(m, buf) is None and torch.equal(m.dequantize(), other.dequantize()) and torch.equal(m(x), other(x))
    seen = {}
    with shapes_only():  # one thread's key and shape check: another thread's state_dict is real
        t = threading.Thread(target=lambda: seen.setdefault("device", m.state_dict()[buf].device.type))
        t.start()
        t.join()
    assert seen == {"device": "cpu"}
    monkeypatch.setattr(quant, "cpu_features", lambda: AMX)  # AMX: oneDNN runs decode batches from the codes
    m.prepare("fast")
    assert m.qmm_rows < qmm.ALL_ROWS and torch.equal(getattr(m, buf), other.stored_codes())


def test_q8_route_leaves_decode_batches_to_amx(monkeypatch):
    monkeypatch.delenv("PAGEDKV_QMM", raising=False)
    monkeypatch.delenv("PAGEDKV_INT8_ROWS", raising=False)
    assert qmm.max_rows(amx=False, int8_rows=8) == qmm.ALL_ROWS
    assert qmm.max_rows(amx=True, int8_rows=8) == 8 and qmm.max_rows(amx=True, int8_rows=0) == 65
    monkeypatch.setenv("PAGEDKV_QMM", "0")
    assert qmm.max_rows(amx=False, int8_rows=8) == 0
    m = Int4Linear.from_float(torch.randn(32, 64)).prepare("fast")
    assert m.qmm_rows == 0 and m.kernel(1) != "q8"


def test_q8_route_off_leaves_the_other_kernels(monkeypatch):
    monkeypatch.setenv("PAGEDKV_QMM", "0")
    monkeypatch.setattr(quant, "cpu_features", lambda: AVX2)
    m = Int4Linear.from_float(torch.randn(32, 64)).prepare("fast")
    assert [m.kernel(r) for r in (1, 64, 65)] == ["bf16", "bf16", "wide"]
    with pytest.raises(RuntimeError, match="no integer-kernel weights"):
        m.qmm_forward(torch.randn(1, 64))


def test_compiled_steps_reach_the_kernel_through_an_opaque_op():
    m = Int4Linear.from_float(torch.randn(32, 64), torch.randn(32)).prepare("fast")
    x = torch.randn(3, 64)
    if m.qmm_rows == 0:
        pytest.fail(f"qmm unavailable: {qmm.build_error()}")
    assert torch.equal(torch.ops.pagedkv.qmm_linear(x, m.int8_key, 32), m.qmm_forward(x))
    with pytest.raises(RuntimeError, match="no prepared layer"):
        torch.ops.pagedkv.qmm_linear(x, -1, 32)


def test_an_unprepared_layer_runs_the_fallback():
    g = torch.Generator().manual_seed(12)
    for make in (Int4Linear.from_float, Int8Linear.from_float):
        m = make(torch.randn(16, 64, generator=g))
        x = torch.randn(3, 64, generator=g)
        assert m.kernel(3) == "fallback" and m.qmm_rows == 0
        torch.testing.assert_close(m(x), x @ m.dequantize().T)


def test_blocks_of_zeros_subnormals_and_huge_values(ops):
    g = torch.Generator().manual_seed(13)
    m = Int8Linear.from_float(torch.randn(8, 96, generator=g))
    w = qmm.pack_int8(m.qweight, m.scale)
    x = torch.zeros(1, 96)
    x[0, 32:64] = 1e-40  # subnormal block: its codes are 0
    x[0, 64:96] = torch.linspace(-1e30, 1e30, 32)  # large but whose products stay finite in float32
    y = ops.linear(x, w)
    assert torch.isfinite(y).all()
    wd = m.dequantize().double()
    ref = x[:, 64:].double() @ wd[:, 64:].T
    # each code within half a step (d / 2 = 1e30 / 254) of its value; the rest float32 rounding
    bound = 1e30 / 254 * wd[:, 64:].abs().sum(1) + 1e-5 * ref.abs().max()
    assert ((y.double() - ref).abs() <= bound).all()
