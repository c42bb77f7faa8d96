"""The integer matmul kernels on GGUF blocks as stored (``pagedkv.ops.qmm.pack_gguf``):
Q4_0 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 in their own layouts (the file's bytes),
Q4_1 in the int4 one (its bytes too), and the concat format whose parts are of different types.

The reference is gguf-py's own dequantiser (``gguf.dequantize``) of random but valid stored blocks
(random code and packed-scale bytes; fp16 block scales of realistic magnitudes, some subnormal;
MXFP4's e8m0 exponents near 2^0, and at both ends in a test of their own). ``ops.dequantize`` of the
packed weights must equal it exactly. ``ops.linear`` is checked two ways: against the kernels'
arithmetic done in float64 (the activation codes emulated as in test_qmm.py; each format's weights
split into the part multiplying the activation codes and a per-block offset multiplying the block's
exact float sum, the split checked to recompose gguf's weights exactly), within float32 accumulation
rounding; and against ``x @ W.T`` within the bound that the activations' rounding gives. Each build
the host can run is checked: the default one, AVX2 (``x86-64-v3``) and plain C (``x86-64``).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.ops import qmm

from tests.model.test_qmm import _emulated as emulated  # noqa: E402  (the kernels' activations)
from tests.model.test_qmm import ops  # noqa: F401,E402  (the fixture: each build the host runs)

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 33, 64, 200]
#: the block-quantised types (int8 activations, integer block sums); F16's float kernel:
#: tests/model/test_qmm_f16.py
QUANT_TYPES = tuple(t for t in qmm.GGUF_TYPES if t != "F16")


# ---- random stored blocks and the split of their weights ----------------------------------------


def _f16(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
    """fp16 bytes ``[..., 2]`` of values of either sign with magnitudes log-uniform in [lo, hi)."""
    v = rng.choice([-1.0, 1.0], size=shape) * 10.0 ** rng.uniform(np.log10(lo), np.log10(hi), size=shape)
    return v.astype(np.float16)[..., None].view(np.uint8)


def random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 ``[n, row bytes]``: random code and scale bytes; fp16 scales at GGUF-like sizes
    (d ~ 1e-6 .. 1e-2 per block: some fp16 subnormals; Q4_1's and the K-quants' minima too)."""
    rng = np.random.default_rng(seed)
    _, per, bs = qmm.GGUF_BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n, k // per, bs), dtype=np.uint8)
    nb = (n, k // per)
    if qtype in ("Q4_0", "Q8_0", "Q5_0"):
        raw[..., 0:2] = _f16(rng, nb, 1e-6, 1e-2)
    elif qtype == "MXFP4":  # e8m0: 2^(e - 128), 2^-16 .. 2^3
        raw[..., 0] = rng.integers(112, 132, size=nb, dtype=np.uint8)
    elif qtype in ("Q4_1", "Q5_1"):
        raw[..., 0:2] = _f16(rng, nb, 1e-6, 1e-2)
        raw[..., 2:4] = _f16(rng, nb, 1e-4, 1e-1)
    elif qtype in ("Q4_K", "Q5_K"):
        raw[..., 0:2] = _f16(rng, nb, 1e-6, 1e-3)
        raw[..., 2:4] = _f16(rng, nb, 1e-6, 1e-3)
    else:  # Q6_K: d last
        raw[..., 208:210] = _f16(rng, nb, 1e-7, 1e-4)
    return raw.reshape(n, -1)


def _unit_scales(qtype: str, raw: np.ndarray, k: int) -> np.ndarray:
    """``raw`` with every scale 1 and every minimum 0: gguf's dequantiser then gives the codes
    (Q4_0 c - 8, Q5_0 c - 16, Q6_K c - 32)."""
    _, per, bs = qmm.GGUF_BLOCKS[qtype]
    b = raw.reshape(raw.shape[0], k // per, bs).copy()
    one = np.array([1.0], np.float16).view(np.uint8)
    if qtype == "Q6_K":
        b[..., 192:208] = 1
        b[..., 208:210] = one
    elif qtype == "MXFP4":  # 2^(128 - 128): the values kvalues_mxfp4[c]
        b[..., 0] = 128
    else:
        b[..., 0:2] = one
        if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            b[..., 2:4] = 0
        if qtype in ("Q4_K", "Q5_K"):  # sc = 1, m = 0 for all 8 sub-blocks
            b[..., 4:8], b[..., 8:12], b[..., 12:16] = 1, 0, 1
    return b.reshape(raw.shape)


def split(qtype: str, raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the kernels multiply: ``(dc, off, w)``, float64 ``dc`` ``[N, K]`` (the weight part
    that multiplies the activation codes: d c, d sc c, d sc (c - 32)), ``off`` ``[N, K / 32]``
    (the per-32 part that multiplies the block's float sum: Q4_1's and Q5_1's m, the
    K-quants' -dmin m, else 0: Q4_0 and Q5_0 multiply their signed codes c - 8, c - 16) and
    gguf's weights ``w`` float32 ``[N, K]``; asserts that ``dc + off`` (in float32, as gguf
    computes it) is ``w`` exactly. MXFP4's ``dc`` = 2^(e - 128) kv is made in float64 (exact:
    at e >= 254 it can exceed float32, where gguf's ``w`` is inf)."""
    n = raw.shape[0]
    qt = gguf.GGMLQuantizationType[qtype]
    _, per, bs = qmm.GGUF_BLOCKS[qtype]
    with np.errstate(over="ignore"):  # MXFP4 at e >= 254: inf, as ggml's
        w = gguf.dequantize(raw, qt).reshape(n, k)
    codes = gguf.dequantize(_unit_scales(qtype, raw, k), qt).reshape(n, k).astype(np.float32)
    b = raw.reshape(n, k // per, bs)

    def half(lo: int) -> np.ndarray:
        return b[..., lo:lo + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, blocks]

    off = np.zeros((n, k // 32), np.float32)
    if qtype in ("Q8_0", "Q4_0", "Q5_0"):
        mult = np.repeat(half(0), 32, axis=1)
    elif qtype == "MXFP4":
        mult = np.repeat(gguf.quants.MXFP4.e8m0_to_fp32_half(b[..., 0]).astype(np.float64), 32, axis=1)
    elif qtype in ("Q4_1", "Q5_1"):
        mult, off = np.repeat(half(0), 32, axis=1), half(2)
    elif qtype in ("Q4_K", "Q5_K"):
        sc, m = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        dsc = half(0)[..., None] * sc.reshape(n, -1, 8).astype(np.float32)
        mult = np.repeat(dsc.reshape(n, -1), 32, axis=1)
        off = -(half(2)[..., None] * m.reshape(n, -1, 8).astype(np.float32)).reshape(n, -1)
    else:  # Q6_K: per-16 int8 scales
        dsc = half(208)[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)
        mult = np.repeat(dsc.reshape(n, -1), 16, axis=1)
    dc = mult * codes  # exact (float32: an fp16 times 6-bit and 8-bit integers; MXFP4's float64)
    with np.errstate(over="ignore"):  # MXFP4 at e >= 254: inf, as gguf's
        np.testing.assert_array_equal((dc + np.repeat(off, 32, axis=1)).astype(np.float32), w)
    return dc.astype(np.float64), off.astype(np.float64), w


def check_linear(ops, packed: qmm.Packed, dc: np.ndarray, off: np.ndarray, w: np.ndarray, x: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
    got = ops.linear(x, packed).double()
    assert got.shape == (x.shape[0], packed.n)
    xh, xs = emulated(x)
    dct, offt = torch.from_numpy(dc), torch.from_numpy(off)
    b = torch.zeros(packed.n, dtype=torch.float64) if bias is None else bias.double()
    # 1. the kernels' arithmetic in float64: exact integer block sums leave float32 rounding only
    ref = xh @ dct.T + xs @ offt.T + b
    # the summed terms' size; a block's float sum of x is rounded relative to its sum of |x|
    # (a block whose values cancel has a small sum but not a small rounding error)
    xa = x.reshape(x.shape[0], -1, 32).abs().sum(-1).double()
    mag = xh.abs() @ dct.abs().T + xa @ offt.abs().T + b.abs()
    err = (got - ref).abs()
    assert (err <= 2e-6 * mag + 1e-30).all(), f"max error / size {(err / mag.clamp_min(1e-30)).max():.3g}"
    # 2. the true product with gguf's weights: off by the activations' rounding (|x - x_hat| on
    # the codes' part; the offsets take exact sums) and that float32 rounding
    true = x.double() @ torch.from_numpy(w).double().T + b
    bound = (x.double() - xh).abs() @ dct.abs().T + 2e-6 * mag
    assert ((got - true).abs() <= bound + 1e-30).all()


# ---- the formats one at a time -------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_dequantize_equals_gguf(ops, qtype):
    for n, k in ((8, 256), (24, 768), (40, 512)):
        raw = random_blocks(qtype, n, k, seed=n + k)
        packed = ops.pack_gguf(qtype, raw, k)
        w = gguf.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k)
        assert torch.equal(ops.dequantize(packed), torch.from_numpy(w))
        assert packed.fmt == (4 if qtype == "Q4_1" else 100 + qmm.GGUF_BLOCKS[qtype][0])
        assert packed.nbytes == raw.nbytes  # the file's bytes


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_linear_every_row_count(ops, qtype):
    k = 768  # 3 super-blocks: not a power of two
    g = torch.Generator().manual_seed(7)
    for n in (8, 24, 40):
        raw = random_blocks(qtype, n, k, seed=3 * n)
        dc, off, w = split(qtype, raw, k)
        bias = torch.randn(n, generator=g) if n != 24 else None
        packed = ops.pack_gguf(qtype, raw, k, bias)
        for rows in ROWS:
            base = torch.randn(rows, k + 5, generator=g)
            x = base[:, :k]  # a row stride that is not k
            x[0, 3] = 40.0  # an outlier: costs its own block's precision only
            check_linear(ops, packed, dc, off, w, x, bias)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_a_row_does_not_depend_on_how_many_rows_share_the_call(ops, qtype):
    """From 16 rows (48 for formats with minimums) the VNNI builds decode each column tile once
    per call and run another kernel over the rows; each output's arithmetic is the group
    kernels' to the bit, so a row gives the same float32 bits alone, in any slice of a batch,
    on 1 or 2 threads, with an odd group count (the last group through the group kernel)."""
    k = 512
    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    try:
        for n, has_bias in ((24, True), (40, False)):
            raw = random_blocks(qtype, n, k, seed=11 * n)
            packed = ops.pack_gguf(qtype, raw, k, torch.randn(n, generator=g) if has_bias else None)
            x = torch.randn(130, k, generator=g) * 2
            x[3, 7] = 50.0  # an outlier block
            torch.set_num_threads(1)
            alone = torch.cat([ops.linear(x[i:i + 1], packed) for i in range(x.shape[0])])
            for nt in (1, 2):
                torch.set_num_threads(nt)
                for cut in (5, 7, 13, 16, 47, 48, 130):  # AVX2 group passes: 5, 4 + 3, 5 + 4 + 4
                    got = torch.cat([ops.linear(x[i:i + cut], packed) for i in range(0, x.shape[0], cut)])
                    assert torch.equal(got, alone), (qtype, n, nt, cut)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_extreme_codes_keep_exact_sums(ops, qtype, fill):
    """Every code byte at its extreme and activation codes of +-127 with the product's sign
    fixed, alone and in batches that take the column tiles: the pairwise int16 sums at their
    largest (Q5_K 8 x 31 x 127, Q6_K 8 x 32 x 127 (the AVX2 tiles: 4 x 255 x 32),
    Q5_0 8 x 2 x 16 x 127 with codes 0 (c - 16 = -16), Q5_1 2 x 2 x 31 x 127 a step, Q8_0
    2 x 128 x 127 with code -128, MXFP4 4 x 2 x 28 x 127 with codes 7 (kv + 16 = 28, the
    unsigned operand of its lookup; codes 0 give 16)), so an overflow or a lost sign shows."""
    n, k = 8, 512
    raw = random_blocks(qtype, n, k, seed=fill + 1)
    _, per, bs = qmm.GGUF_BLOCKS[qtype]
    b = raw.reshape(n, k // per, bs)
    code_bytes = {"Q4_0": slice(2, 18), "Q4_1": slice(4, 20), "Q5_0": slice(2, 22), "Q5_1": slice(4, 24),
                  "Q8_0": slice(2, 34), "Q4_K": slice(16, 144), "Q5_K": slice(16, 176), "Q6_K": slice(0, 192),
                  "MXFP4": slice(1, 17)}[qtype]
    b[..., code_bytes] = fill
    if qtype == "Q8_0" and fill == 0xFF:
        b[..., 2:34] = 0x80  # -128
    if qtype == "MXFP4" and fill == 0xFF:
        b[..., code_bytes] = 0x77  # code 7: kv = +12, the kernels' largest unsigned operand kv + 16 = 28
    dc, off, w = split(qtype, raw, k)
    x = torch.where(torch.from_numpy(dc[:1]) >= 0, 1.0, -1.0).float().repeat(3, 1)  # codes +-127
    x[1] *= -2.0
    x[2, :64] = 0.0  # blocks of zeros
    packed = ops.pack_gguf(qtype, raw, k)
    check_linear(ops, packed, dc, off, w, x, None)
    # 51 rows: the column tiles (from 16 rows, 48 with minimums), whose AVX2 Q6_K takes the
    # activations as u8 (q + 128) and the codes as s8 (c - 32): the same exact sums, to the bit
    many = ops.linear(x.repeat(17, 1), packed)
    assert torch.equal(many, ops.linear(x, packed).repeat(17, 1)), qtype


def test_an_activation_on_a_rounding_tie_rounds_to_even(ops):
    """x * (127 / max) == 89.5 exactly in float32 (hypothesis found it): the code is 90, as C's
    correctly rounded division and round-half-even give (torch's ``127.0 / t`` is a reciprocal
    times 127, one ulp lower here, which made the test's emulation say 89)."""
    raw = random_blocks("Q4_K", 8, 512, 404117)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(404117))
    xb = x[2, 288:320]
    inv = torch.full_like(xb[:1], 127.0) / xb.abs().max()
    assert float(xb[27] * inv) == 89.5
    xh, _ = emulated(x[2:3])
    assert float(xh[0, 288 + 27] / (xb.abs().max() / 127.0)) == pytest.approx(90.0, abs=1e-4)
    dc, off, w = split("Q4_K", raw, 512)
    check_linear(ops, ops.pack_gguf("Q4_K", raw, 512), dc, off, w, x, None)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(qtype=st.sampled_from(QUANT_TYPES), groups=st.integers(1, 6), blocks=st.integers(1, 4),
       rows=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_random_shapes(qtype, groups, blocks, rows, seed):
    ops = qmm.get()
    n, k = 8 * groups, blocks * qmm.GGUF_BLOCKS[qtype][1]
    raw = random_blocks(qtype, n, k, seed)
    dc, off, w = split(qtype, raw, k)
    packed = qmm.pack_gguf(qtype, raw, k)
    assert torch.equal(ops.dequantize(packed), torch.from_numpy(w))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    check_linear(ops, packed, dc, off, w, x, None)


def test_inputs_as_tensors_and_strided_rows(ops):
    n, k = 16, 512
    raw = random_blocks("Q4_K", n, k, seed=5)
    ref = ops.dequantize(ops.pack_gguf("Q4_K", raw, k))
    wide = np.zeros((n, raw.shape[1] + 40), np.uint8)
    wide[:, 8:8 + raw.shape[1]] = raw
    assert torch.equal(ops.dequantize(ops.pack_gguf("Q4_K", wide[:, 8:8 + raw.shape[1]], k)), ref)
    assert torch.equal(ops.dequantize(ops.pack_gguf("Q4_K", torch.from_numpy(raw), k)), ref)
    ro = raw.copy()
    ro.setflags(write=False)  # as a read-only memory map of the file
    assert torch.equal(ops.dequantize(ops.pack_gguf("Q4_K", ro, k)), ref)


# ---- MXFP4 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(24, 2880), (40, 96)])
def test_mxfp4_from_gguf_quantize(ops, n, k):
    """MXFP4 blocks as gguf's quantiser writes them (rows of 2880, gpt-oss's width: 90 blocks;
    and 3 blocks): the packed bytes are as many as the file's, ``dequantize`` is gguf's, and the
    product is ``gguf.dequantize(raw) @ x`` within the activations' int8 rounding at 1, 2, 3, 4,
    7, 8, 9, 16 and 33 rows (every row tile of the group kernels, and the column tiles)."""
    g = torch.Generator().manual_seed(n + k)
    raw = gguf.quants.quantize((torch.randn(n, k, generator=g) * 0.02).numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert raw.shape == (n, k // 32 * 17)
    dc, off, w = split("MXFP4", raw, k)
    bias = torch.randn(n, generator=g)
    packed = ops.pack_gguf("MXFP4", raw, k, bias)
    assert packed.fmt == 139 and packed.codes.nbytes == raw.nbytes
    assert torch.equal(ops.dequantize(packed), torch.from_numpy(w))
    for rows in (1, 2, 3, 4, 7, 8, 9, 16, 33):
        check_linear(ops, packed, dc, off, w, torch.randn(rows, k, generator=g), bias)


def test_mxfp4_scales_at_both_ends_and_zero_blocks(ops):
    """e8m0 exponents e = 0 and 1 (ggml's special case: the float32 subnormals 2^-128, 2^-127),
    2 (2^-126, the smallest normal), 254 and 255 (2^126, 2^127: gguf's float32 weights are inf
    for |kv| >= 4 there, the kernels' 2^(e - 128) d_x stays finite), each with a third of the
    blocks all-zero bytes (e = 0, codes 0): ``dequantize`` equals gguf's bit for bit (inf too),
    and the products, the activations scaled so that 2^(e - 128) d_x is a normal float, equal
    the exact float64 weights' within the activations' rounding (alone and in the column tiles)."""
    n, k = 16, 256
    g = torch.Generator().manual_seed(39)
    for e, scale in ((0, 2.0**100), (1, 2.0**100), (2, 2.0**100), (254, 2.0**-90), (255, 2.0**-90)):
        raw = random_blocks("MXFP4", n, k, seed=e)
        b = raw.reshape(n, k // 32, 17)
        b[..., 0] = e
        b[:, 1::3] = 0  # all-zero blocks
        packed = ops.pack_gguf("MXFP4", raw, k)
        assert packed.codes.nbytes == raw.nbytes
        with np.errstate(over="ignore"):
            w = gguf.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(n, k)
        assert np.isinf(w).any() == (e >= 254)
        assert torch.equal(ops.dequantize(packed), torch.from_numpy(w))
        dc, off, _ = split("MXFP4", raw, k)
        assert (dc[:, 32:64] == 0).all() and (dc[:, :32] != 0).any()
        for rows in (1, 3, 17):
            check_linear(ops, packed, dc, off, dc, torch.randn(rows, k, generator=g) * scale, None)


# ---- concat ------------------------------------------------------------------------------------


def test_concat_of_mixed_types_is_the_column_concatenation(ops):
    k = 512
    g = torch.Generator().manual_seed(21)
    specs = [("Q4_K", 32, True), ("Q6_K", 8, False), ("Q4_0", 24, True), ("Q8_0", 16, False), ("Q5_0", 8, True),
             ("Q5_1", 16, False), ("MXFP4", 16, True)]
    parts, splits = [], []
    for i, (qtype, n, has_bias) in enumerate(specs):
        raw = random_blocks(qtype, n, k, seed=100 + i)
        splits.append(split(qtype, raw, k))
        parts.append(ops.pack_gguf(qtype, raw, k, torch.randn(n, generator=g) if has_bias else None))
    cat = qmm.concat_packed(parts)
    assert cat.fmt == qmm.FMT_CONCAT and cat.n == 120 and cat.k == k
    assert cat.nbytes == sum(p.nbytes for p in parts) + 120 * 4  # the parts and the concatenated bias
    assert torch.equal(cat.bias, torch.cat([p.bias if p.bias is not None else torch.zeros(p.n) for p in parts]))
    assert torch.equal(ops.dequantize(cat), torch.cat([ops.dequantize(p) for p in parts]))
    dc = np.concatenate([s[0] for s in splits])
    off = np.concatenate([s[1] for s in splits])
    w = np.concatenate([s[2] for s in splits])
    threads = torch.get_num_threads()
    try:
        for nt in (1, 3):  # 3: thread shares that cut parts unevenly
            torch.set_num_threads(nt)
            for rows in (1, 5, 17, 64):
                x = torch.randn(rows, k, generator=g)
                got = ops.linear(x, cat)
                # the same arithmetic per part: bit for bit the parts' own outputs
                assert torch.equal(got, torch.cat([ops.linear(x, p) for p in parts], dim=1))
                check_linear(ops, cat, dc, off, w, x, cat.bias)
    finally:
        torch.set_num_threads(threads)
    nobias = qmm.concat_packed([ops.pack_gguf("Q4_K", random_blocks("Q4_K", 8, k, 1), k),
                                ops.pack_gguf("Q6_K", random_blocks("Q6_K", 16, k, 2), k)])
    assert nobias.bias is None
    x = torch.randn(2, k, generator=g)
    assert torch.equal(ops.linear(x, nobias), torch.cat([ops.linear(x, p) for p in nobias.parts], dim=1))


# ---- errors ------------------------------------------------------------------------------------


def test_bad_inputs_are_value_errors():
    raw = random_blocks("Q4_K", 16, 512, seed=1)
    with pytest.raises(ValueError, match="Q2_K"):
        qmm.pack_gguf("Q2_K", raw, 512)
    with pytest.raises(ValueError, match="multiple of 8"):
        qmm.pack_gguf("Q4_K", raw[:12], 512)
    with pytest.raises(ValueError, match="multiple of 256"):
        qmm.pack_gguf("Q4_K", raw, 384)
    with pytest.raises(ValueError, match="multiple of 32"):
        qmm.pack_gguf("Q8_0", random_blocks("Q8_0", 8, 64, 1), 48)
    with pytest.raises(ValueError, match="blocks of 144 bytes"):
        qmm.pack_gguf("Q4_K", raw[:, :200], 512)
    with pytest.raises(ValueError, match="uint8"):
        qmm.pack_gguf("Q4_K", raw.view(np.int8), 512)
    with pytest.raises(ValueError, match="uint8"):
        qmm.pack_gguf("Q4_K", torch.from_numpy(raw).float(), 512)
    with pytest.raises(ValueError, match="contiguous"):
        qmm.pack_gguf("Q8_0", np.zeros((16, 2 * 68), np.uint8)[:, ::2], 64)
    with pytest.raises(ValueError, match="bias"):
        qmm.pack_gguf("Q4_K", raw, 512, torch.zeros(8))
    with pytest.raises(ValueError, match="blocks of 22 bytes"):
        qmm.pack_gguf("Q5_0", random_blocks("Q4_0", 8, 64, seed=2), 64)
    a = qmm.pack_gguf("Q4_K", raw, 512)
    b = qmm.pack_gguf("Q8_0", random_blocks("Q8_0", 8, 256, 3), 256)
    with pytest.raises(ValueError, match="in features"):
        qmm.concat_packed([a, b])
    with pytest.raises(ValueError, match="concatenation"):
        qmm.concat_packed([qmm.concat_packed([a]), a])
    with pytest.raises(ValueError, match="at least one"):
        qmm.concat_packed([])


# ---- a real file -------------------------------------------------------------------------------


def test_the_bundled_q4_k_m_tensors(gemma3_gguf):
    """Real blocks: the bundled Gemma-3-270M Q4_K_M's first Q4_K, Q6_K and Q8_0 matrices."""
    ops = qmm.get()
    reader = gguf.GGUFReader(str(gemma3_gguf))
    seen = set()
    g = torch.Generator().manual_seed(4)
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in ("Q4_K", "Q6_K", "Q8_0") or qtype in seen or len(t.shape) != 2 or int(t.shape[1]) > 4096:
            continue
        seen.add(qtype)
        k, n = (int(s) for s in t.shape)
        raw = np.asarray(t.data).reshape(n, -1)
        dc, off, w = split(qtype, raw, k)
        packed = qmm.pack_gguf(qtype, raw, k)
        assert packed.nbytes == raw.nbytes
        assert torch.equal(ops.dequantize(packed), torch.from_numpy(w))
        check_linear(ops, packed, dc, off, w, torch.randn(3, k, generator=g), None)
    assert seen == {"Q4_K", "Q6_K", "Q8_0"}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "MXFP4", "F16", "int8"])
def test_row_blocks_are_views_that_multiply_as_the_whole_matrix(ops, qtype):  # noqa: F811
    """``qmm.row_blocks``: a stacked per-head matrix ``[4 x 16, K]`` cut into 4 views of 16 rows
    (every format it takes: GGUF blocks, Q4_1's int4 layout, F16, int8 codes with per-row scales);
    each block's product is the whole matrix's 16 columns bit for bit (one activation row, as the
    native step's absorbed MLA multiplies head by head), and no memory is copied."""
    k = 256
    if qtype == "int8":
        g = torch.Generator().manual_seed(5)
        w = qmm.pack_int8(torch.randint(-127, 128, (64, k), generator=g, dtype=torch.int8), torch.rand(64, generator=g))
    elif qtype == "F16":
        w = ops.pack_gguf(qtype, (np.random.default_rng(5).standard_normal((64, k)) * 0.1).astype(np.float16)
                          .view(np.uint8), k)
    else:
        w = ops.pack_gguf(qtype, random_blocks(qtype, 64, k, seed=5), k)
    blocks = qmm.row_blocks(w, 16)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
    whole = ops.linear(x, w)
    assert len(blocks) == 4 and all((b.n, b.k, b.fmt) == (16, k, w.fmt) for b in blocks)
    for i, b in enumerate(blocks):
        assert b.codes.data_ptr() == w.codes.data_ptr() + i * w.codes.nbytes // 4
        assert w.scale is None or b.scale.data_ptr() == w.scale.data_ptr() + i * 16 * 4
        assert torch.equal(ops.linear(x, b), whole[:, 16 * i:16 * (i + 1)])
    for rows in (12, 24, 0):
        with pytest.raises(ValueError, match="row_blocks"):
            qmm.row_blocks(w, rows)
    with pytest.raises(ValueError, match="row_blocks"):
        qmm.row_blocks(qmm.pack_bf16(torch.randn(64, k).bfloat16()), 16)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4"])
def test_a_nan_or_inf_activation_gives_nan_outputs(ops, qtype):
    """A NaN or an inf in a row's activations makes every output of that row NaN (the block's
    scale becomes NaN), as a float matmul would, rather than codes of 0 and plausible finite
    outputs; the other rows are the same bits as without it, alone and in batches (group
    kernels and column tiles)."""
    n, k = 16, 512
    packed = ops.pack_gguf(qtype, random_blocks(qtype, n, k, seed=7), k)
    for rows in (3, 40):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        clean = ops.linear(x, packed)
        x[1, 5], x[2, 300] = float("nan"), float("inf")
        y = ops.linear(x, packed)
        assert y[1:3].isnan().all()
        keep = [0] + list(range(3, rows))
        assert torch.isfinite(y[keep]).all() and torch.equal(y[keep], clean[keep])
