"""Weight formats: fp32 | bf16 | int8 | int4 linear layers, their kernel
routes, the choice of ``weights="auto"``, loading each format with no weight cache, and agreement with fp32
on the bundled model (thresholds from ``pagedkv bench quality``, docs/benchmarks/weights_quality.md)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.model import quant
from pagedkv.model.quant import (
    BF16Linear, CpuFeatures, Int4Linear, Int8Linear, auto_route, check_weights, dynamic_int8_mm, int8_rows,
    resolve_weights,
)
from pagedkv.model.compiled import route_boundaries
from pagedkv.testing.caches import allocate_kv_caches

AVX512_AMX = CpuFeatures("AVX512", avx512_bf16=True, amx=True, vnni=True)
AVX512_PLAIN = CpuFeatures("AVX512", avx512_bf16=False, amx=False, vnni=False)
AVX2 = CpuFeatures("AVX2", avx512_bf16=False, amx=False, vnni=False)
NO_SIMD = CpuFeatures("DEFAULT", avx512_bf16=False, amx=False, vnni=False)


class VnniHost(CpuFeatures):
    """A VNNI host's features whatever this process's oneDNN cap (``PAGEDKV_CPU_ISA=avx2`` sets
    one): for route logic only, where no int8 matmul runs (prepacking weights is no matmul)."""

    @property
    def int8_exact(self) -> bool:
        return True


VNNI = VnniHost("AVX512", avx512_bf16=False, amx=False, vnni=True)


def int8_here() -> bool:
    """Whether this process's CPU profile runs dynamic int8 (VNNI or AMX-INT8, oneDNN not capped
    below it): every test that runs the int8 kernels asserts them here, else that they refuse."""
    return quant.cpu_features().int8_exact


def assert_int8_refused(m) -> None:
    """What an AVX2 profile gets: a layer without int8 weights whose int8 matmul refuses, and
    the CPU's features saying why."""
    why = quant.cpu_features().int8_refusal
    assert why is not None and "VNNI" in why, why
    assert m.int8_rows == 0 and m._w8_packed is None and m._w8_t is None
    assert getattr(m, "int8_key", None) is None and not m.dynamic_int8(64)
    with pytest.raises(RuntimeError, match="route is off"):
        m.int8_matmul(torch.zeros(2, m.in_features, dtype=torch.uint8))


class ExactInt8:
    """A stand-in layer for ``pagedkv::int8_linear`` whose int8 matmul sums exactly in int64
    (any CPU): ``dynamic_int8_mm``'s rounding of the activations, tested without VNNI."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.q, self.scale, self.out_features = q, scale, q.shape[0]
        self.int8_key = quant.register_int8(self)

    def int8_matmul(self, qx: torch.Tensor) -> torch.Tensor:
        return ((qx.long() - 128) @ self.q.long().T).double().mul_(self.scale.double()).float()

    def release_int8(self) -> None:
        pass
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot", "Water boils at"]


@pytest.fixture
def other_kernels(monkeypatch):
    """The formats' kernels besides ``qmm`` (tests/model/test_qmm.py): what AMX hosts run for
    decode batches and prefill, and every host without a C compiler or with PAGEDKV_QMM=0."""
    monkeypatch.setenv("PAGEDKV_QMM", "0")


# ---- names, choice of auto, routes (no model) ------------------------------------------------

def test_bad_weight_format_is_config_error_naming_the_valid_values():
    from pagedkv.engine.config import EngineConfig

    for bad in ("int3", "", None, 4, "fp8"):
        with pytest.raises(ConfigError, match="one of auto, gguf, fp32, bf16, int8, int4"):
            EngineConfig.from_kwargs({"weights": bad})
    assert check_weights(" INT4 ") == "int4"
    assert EngineConfig.from_kwargs({}).weights == "auto"


def test_cli_rejects_a_bad_weight_format_before_loading(capsys):
    from pagedkv.cli import main

    assert main(["generate", "--weights", "q4_k", "hi"]) == 2
    err = capsys.readouterr().err
    assert "weights: unsupported 'q4_k' (one of auto, gguf, fp32, bf16, int8, int4)" in err


def test_auto_follows_the_cpu_capability_not_timing():
    assert resolve_weights("auto", "float32", features=AVX512_AMX)[0] == "int4"
    assert resolve_weights("auto", "float32", features=AVX512_PLAIN)[0] == "int4"
    assert resolve_weights("auto", "float32", features=AVX2)[0] == "int4"
    fmt, why = resolve_weights("auto", "float32", features=NO_SIMD)
    assert fmt == "fp32" and "DEFAULT" in why
    # a 16-bit model, another device or tensor parallelism keep the model's own weights
    assert resolve_weights("auto", "bfloat16", features=AVX512_AMX)[0] == "bf16"
    assert resolve_weights("auto", "float32", tensor_parallel_size=2, features=AVX512_AMX)[0] == "fp32"
    assert resolve_weights("auto", "float32", device="cuda", features=AVX512_AMX)[0] == "fp32"
    assert resolve_weights("int8", "float32") == ("int8", "requested")
    assert resolve_weights("gguf", "float32") == ("gguf", "requested")
    with pytest.raises(ConfigError, match="'gguf' needs dtype float32"):
        resolve_weights("gguf", "bfloat16")
    # tensor parallelism splits a GGUF's stored blocks per rank (tests/distributed/test_tp_gguf.py),
    # and no other quantised format
    assert resolve_weights("gguf", "float32", tensor_parallel_size=2) == ("gguf", "requested")
    with pytest.raises(ConfigError, match="tensor parallelism; use 'auto', 'gguf'"):
        resolve_weights("int4", "float32", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="needs dtype float32"):
        resolve_weights("fp32", "bfloat16")


def test_routes_by_capability_and_forced_fallback(monkeypatch):
    monkeypatch.delenv("PAGEDKV_WEIGHT_ROUTE", raising=False)
    assert [auto_route(f, AVX512_AMX) for f in ("bf16", "int8", "int4")] == ["fast", "fast", "fast"]
    # bf16: qmm's bf16 kernel builds on every CPU (its wider inputs: fp32 where bf16 is emulated)
    assert [auto_route(f, AVX512_PLAIN) for f in ("bf16", "int8", "int4")] == ["fast", "fast", "fast"]
    assert [auto_route(f, AVX2) for f in ("bf16", "int8", "int4")] == ["fast", "fast", "fast"]
    assert [auto_route(f, NO_SIMD) for f in ("bf16", "int8", "int4")] == ["fast", "fallback", "fallback"]
    monkeypatch.setenv("PAGEDKV_WEIGHT_ROUTE", "fallback")
    assert auto_route("int4", AVX512_AMX) == "fallback"
    assert resolve_weights("auto", "float32", features=AVX512_AMX)[0] == "fp32"


# ---- the modules: both routes compute the same product ---------------------------------------

@pytest.mark.usefixtures("other_kernels")
@pytest.mark.parametrize("rows", [5, 80])  # the kernel (decode) and the wide (prefill) path
@pytest.mark.parametrize("make", [BF16Linear, Int8Linear.from_float, Int4Linear.from_float])
def test_fast_and_fallback_routes_agree(make, rows):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * 0.1
    bias = torch.randn(48, generator=g)
    x = torch.randn(rows, 96, generator=g)
    m = make(w, bias)
    ref = x @ m.dequantize().T + bias  # the weights the format holds, in fp32
    slow = m.prepare("fallback")(x)
    torch.testing.assert_close(slow, ref, rtol=1e-5, atol=1e-5)
    fast = m.prepare("fast")(x)  # runs on any CPU (slowly without AVX-512)
    assert fast.dtype == torch.float32 and fast.shape == (rows, 48)
    assert (fast - ref).abs().max().item() < 0.02 * ref.abs().max().item()  # bf16 activations
    # and the format is close to the float weights it came from
    err = (m.dequantize() - w).abs().max().item()
    assert err < {"bf16": 2e-3, "int8": 2e-3, "int4": 0.05}[m.fmt], err


# ---- dynamic int8 (decode batches of INT8_ROWS..KERNEL_ROWS rows in int8/int4) ----------------

def test_int8_rows_from_the_environment(monkeypatch):
    monkeypatch.delenv("PAGEDKV_INT8_ROWS", raising=False)
    assert int8_rows() == 8
    monkeypatch.setenv("PAGEDKV_INT8_ROWS", "0")
    assert int8_rows() == 0
    assert Int8Linear.from_float(torch.randn(16, 64)).prepare("fast").int8_rows == 0  # off
    monkeypatch.setenv("PAGEDKV_INT8_ROWS", " 64 ")
    assert int8_rows() == 64
    # non-ASCII digits that str.isdigit accepts (superscript two, Arabic-Indic eight), and a
    # threshold above the kernels' 64 rows (the route would silently never run)
    for bad in ("-1", "eight", "1.5", "\u00b2", "\u0668", "65"):
        monkeypatch.setenv("PAGEDKV_INT8_ROWS", bad)
        with pytest.raises(ConfigError, match="PAGEDKV_INT8_ROWS"):
            int8_rows()


@pytest.mark.usefixtures("other_kernels")
@pytest.mark.parametrize("onednn", [True, False])
def test_dynamic_int8_keeps_15_bits_of_the_activations(monkeypatch, onednn):
    # onednn: prepacked weights through onednn::qlinear_pointwise; else torch._int_mm. The
    # rounding of the activations is checked on every CPU (an exact int8 matmul in int64); the
    # kernels where the profile has VNNI/AMX-INT8, and on an AVX2 profile that they refuse
    monkeypatch.delenv("PAGEDKV_INT8_ROWS", raising=False)
    monkeypatch.setattr(quant, "onednn_int8", lambda: onednn)
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (40, 96), generator=g).to(torch.int8)
    scale = torch.rand(40, generator=g) * 0.01 + 1e-3
    m = Int8Linear(q, scale).prepare("fast")
    x = torch.randn(12, 96, generator=g)
    x[3, 7] = 60.0  # an outlier channel: one int8 row per token would lose the rest of row 3
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    # activation error <= max|row| / 127 / 254 / 2 per element, times sum |w| over the row
    bound = (x.abs().amax(1, keepdim=True).double() / 127 / 254 / 2) @ (q.double().abs() * scale.double()[:, None]).sum(1, keepdim=True).T
    exact = ExactInt8(q, scale)
    for layer in (exact, m) if int8_here() else (exact,):
        got = dynamic_int8_mm(x, layer)
        assert got.dtype == torch.float32 and got.shape == (12, 40)
        assert ((got.double() - ref).abs() <= bound + 1e-5).all()
        assert torch.equal(dynamic_int8_mm(torch.zeros(2, 96), layer), torch.zeros(2, 40))
    if not int8_here():
        assert_int8_refused(m)
        return
    assert (m._w8_packed is not None) == onednn and (m._w8_t is None) == onednn
    # the int8 matmul itself: exact int32 sums of the offset codes, times the weight scales
    qx = torch.randint(0, 256, (5, 96), generator=g).to(torch.uint8)
    acc = (qx.long() - 128) @ q.long().T
    assert torch.allclose(m.int8_matmul(qx).double(), acc.double() * scale.double(), rtol=1e-6, atol=0)


@pytest.mark.usefixtures("other_kernels")
def test_int8_matmul_routes_agree_and_refuse_when_off(monkeypatch):
    monkeypatch.delenv("PAGEDKV_INT8_ROWS", raising=False)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=g)
    qx = torch.randint(0, 256, (7, 64), generator=g).to(torch.uint8)
    packed = Int4Linear.from_float(w).prepare("fast")
    monkeypatch.setattr(quant, "onednn_int8", lambda: False)
    plain = Int4Linear.from_float(w).prepare("fast")
    with pytest.raises(RuntimeError, match="no prepared int8 weights"):
        torch.ops.pagedkv.int8_linear(qx, -1, 48)
    if not int8_here():  # AVX2: neither layer has int8 weights; both refuse
        assert_int8_refused(packed)
        assert_int8_refused(plain)
        return
    assert packed._w8_packed is not None and plain._w8_packed is None
    assert torch.allclose(packed.int8_matmul(qx), plain.int8_matmul(qx), rtol=1e-6, atol=1e-6)
    # the compiled steps' op finds each layer by its key
    assert torch.equal(torch.ops.pagedkv.int8_linear(qx, plain.int8_key, 48), plain.int8_matmul(qx))
    plain.prepare("fallback")
    with pytest.raises(RuntimeError, match="route is off"):
        plain.int8_matmul(qx)


#: the kernel of 1, 7, 8, 64, 65 and 600 rows on the fast route in int8/int4, with dynamic int8
#: (VNNI/AMX-INT8) and without it (AVX2: weight-only bf16 kernel up to 64 rows, then wide)
KERNELS_INT8 = ["bf16", "bf16", "int8", "int8", "int8", "int8"]
KERNELS_AVX2 = ["bf16", "bf16", "bf16", "bf16", "wide", "wide"]


@pytest.mark.usefixtures("other_kernels")
@pytest.mark.parametrize("make", [Int8Linear.from_float, Int4Linear.from_float])
def test_dynamic_int8_route_takes_decode_batches_from_int8_rows(monkeypatch, make):
    monkeypatch.delenv("PAGEDKV_INT8_ROWS", raising=False)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 96, generator=g) * 0.1
    bias = torch.randn(48, generator=g)
    sizes = (1, 7, 8, 64, 65, 600)
    with monkeypatch.context() as mp:  # the routes of a VNNI host and of an AVX2 one, on any CPU
        mp.setattr(quant, "onednn_int8", lambda: False)
        mp.setattr(quant, "cpu_features", lambda: VNNI)
        m = make(w, bias).prepare("fast")
        assert m.int8_rows == 8
        # prefill chunks too: from int8_rows up (no dequantised copy of the weights per call)
        assert [m.dynamic_int8(r) for r in sizes] == [False, False, True, True, True, True]
        assert m.takes_bf16(7) and not m.takes_bf16(8)  # the route quantises float32 activations itself
        assert [m.kernel(r) for r in sizes] == KERNELS_INT8
        mp.setattr(quant, "cpu_features", lambda: AVX2)
        m = make(w, bias).prepare("fast")
        assert m.int8_rows == 0 and not any(m.dynamic_int8(r) for r in sizes)
        assert m.takes_bf16(64) and not m.takes_bf16(65) and [m.kernel(r) for r in sizes] == KERNELS_AVX2
    m = make(w, bias).prepare("fast")  # this process's profile: its kernels run
    assert [m.kernel(r) for r in sizes] == (KERNELS_INT8 if int8_here() else KERNELS_AVX2)
    if not int8_here():
        assert_int8_refused(m)
    for rows in (16, 100):
        x = torch.randn(rows, 96, generator=g)
        ref = x @ m.dequantize().T + bias
        got = m(x)
        assert got.dtype == torch.float32
        # int8 weights (int4: the int4 values rounded per output channel) and ~15-bit activations
        assert (got - ref).abs().max().item() < 0.01 * ref.abs().max().item()
    assert m.prepare("fallback").int8_rows == 0 and not m.dynamic_int8(16)
    assert {m.kernel(r) for r in (1, 8, 65)} == {"fallback"}


@pytest.mark.usefixtures("other_kernels")
def test_compiled_decode_warms_a_graph_for_every_kernel_range(monkeypatch):
    # a compiled step branches where a linear changes kernel: int4/int8 on the fast route have
    # 1..7 rows (weight-only) and 8.. (dynamic int8, prefill chunks included); with dynamic
    # int8 off, 1..64 (weight-only) and 65.. (dequantise, one wide matmul). Warm-up must compile
    # each range the compiled steps take, or the first batch of 8 compiles mid-serving
    from pagedkv.model.compiled import CompiledDecode

    monkeypatch.delenv("PAGEDKV_INT8_ROWS", raising=False)
    monkeypatch.setattr(quant, "onednn_int8", lambda: False)
    monkeypatch.setattr(quant, "cpu_features", lambda: VNNI)  # route logic only: any CPU
    w = torch.randn(32, 64)
    fast = torch.nn.Sequential(Int4Linear.from_float(w).prepare("fast"), Int8Linear.from_float(w).prepare("fast"))
    assert route_boundaries(fast) == [8]
    # nothing changes kernel on the fallback route, nor in bf16 without qmm (one kernel at every
    # row count; with qmm: test_qmm_bf16.py)
    assert route_boundaries(torch.nn.Sequential(Int8Linear.from_float(w).prepare("fallback"))) == []
    assert route_boundaries(torch.nn.Sequential(BF16Linear(w).prepare("fast"))) == []
    assert route_boundaries(torch.nn.Linear(4, 4)) == []
    cd = CompiledDecode.__new__(CompiledDecode)
    cd.model, cd.max_rows = fast, 64
    assert cd.warm_up_sizes() == [1, 2, 8]
    cd.max_rows = 512
    assert cd.warm_up_sizes() == [1, 2, 8]
    # an AVX2 CPU (no dynamic int8) has the same ranges as the route turned off
    for features, rows in ((AVX2, None), (VNNI, "0")):
        monkeypatch.setattr(quant, "cpu_features", lambda f=features: f)
        if rows is not None:
            monkeypatch.setenv("PAGEDKV_INT8_ROWS", rows)
        cd.model = torch.nn.Sequential(Int4Linear.from_float(w).prepare("fast"),
                                       Int8Linear.from_float(w).prepare("fast"))
        assert route_boundaries(cd.model) == [65]
        cd.max_rows = 512
        assert cd.warm_up_sizes() == [1, 2, 65]
        cd.max_rows = 64
        assert cd.warm_up_sizes() == [1, 2]


def test_int4_codes_round_trip_q4_1_values_exactly():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (32, 64), generator=g)
    codes[:, 0::32], codes[:, 1::32] = 0, 15  # Q4_1's quantiser puts 0 at the min and 15 at the max
    scale = (torch.rand(32, 2, generator=g) * 0.01 + 1e-3).half().float()  # Q4_1 stores fp16 scales and mins
    mins = (-torch.rand(32, 2, generator=g) * 0.05).half().float()
    m = Int4Linear.from_codes(codes, scale, mins)
    values = m.dequantize()
    assert torch.equal(m.codes().long(), codes)
    again = Int4Linear.from_float(values)  # the min/max rule finds the same codes
    assert torch.equal(again.codes(), m.codes())
    torch.testing.assert_close(again.dequantize(), values, rtol=0, atol=1e-6)


def test_int4_rejects_rows_that_are_not_whole_groups():
    with pytest.raises(ConfigError, match="multiple of 32"):
        Int4Linear.from_float(torch.randn(16, 40))


# ---- the bundled model --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp32_tokens(loaded_model):
    return _greedy(loaded_model)


def _greedy(lm, n: int = 24) -> list[list[int]]:
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.request import SamplingParams

    llm = LLM(lm, num_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.token_ids) for o in outs]


def _prefix_agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    from pagedkv.bench.quality import agreement

    return agreement(ref, got)[0]


FALLBACK_TOL, FAST_TOL = 0.05, 0.08  # of the largest |logit|; measured 0.016 and 0.027
#: the q8 route (activations as int8 blocks of 32, as llama.cpp multiplies Q4_1 x Q8_1): the
#: largest and the mean |logit| difference from the fallback, measured 0.225 (at the first
#: position, whose activations carry the attention-sink outliers) and 0.026 of the largest
#: |logit|; the argmax agreed at 18 of 21 positions
Q8_TOL, Q8_MEAN_TOL = 0.3, 0.04
#: lowest mean fraction of greedy tokens before the first difference from fp32 (4 prompts x 24
#: tokens); measured on the bundled model (AVX-512 + AMX machine, 2 threads): bf16 0.67, int8
#: 0.89, int4 0.60 (int4 on the fallback route 0.67); int4 0.41 on an AVX-512 + VNNI host after
#: the single attention kernel (docs/determinism.md) moved float rounding, which flips int8
#: activation codes: "def fibonacci(n):" then differs at its 4th token, where fp32's own top-2
#: margin is 0.43 nats and int4's 0.28. The bounds leave room for other kernels' rounding (a
#: single flipped token early in one prompt costs up to 0.25); the quality gate proper is the
#: perplexity bound (bench quality, docs/benchmarks/weights_quality.md).
AGREEMENT = {"bf16": 0.45, "int8": 0.5, "int4": 0.38}


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_each_format_loads_generates_and_agrees_with_fp32(bundled_gguf, loaded_model, fp32_tokens, fmt, tmp_path):
    import os
    import shutil

    from pagedkv.model.loader import load_model

    root = tmp_path / "cache"  # a private root holding (hard links to) the session's tokenizer entry
    shutil.copytree(loaded_model.cache_dir, root / loaded_model.cache_dir.name, copy_function=os.link)
    lm = load_model(bundled_gguf, weights=fmt, cache_dir=root)
    # converted as the file streams in: no weight cache entry, only the tokenizer's and the identity
    assert lm.weights == fmt and lm.from_cache and lm.cache_dir == root / loaded_model.cache_dir.name
    assert sorted(p.name for p in root.iterdir()) == sorted([lm.cache_dir.name, "ids"])
    assert lm.report.fmt == fmt and lm.report.tensors == 2 + 6 * 30  # embedding, final norm; 2 norms + 4 linears a layer
    assert json.loads((lm.cache_dir / "manifest.json").read_text())["weights"] == "tokenizer"
    kinds = {type(m).__name__ for m in lm.model.modules()}
    assert {"bf16": "BF16Linear", "int8": "Int8Linear", "int4": "Int4Linear"}[fmt] in kinds
    assert "Linear" not in kinds  # no plain nn.Linear left
    tokens = _greedy(lm)
    assert all(len(t) == 24 for t in tokens)
    assert _prefix_agreement(fp32_tokens, tokens) >= AGREEMENT[fmt]
    again = load_model(bundled_gguf, weights=fmt, cache_dir=root)
    assert again.from_cache and again.cache_dir == lm.cache_dir  # the tokenizer's entry
    a, b = lm.model.state_dict(), again.model.state_dict()  # the same conversion again, bit for bit
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_int4_keeps_the_stored_q4_1_codes(bundled_gguf, loaded_model):
    from pagedkv.model.loader import load_model

    lm = load_model(bundled_gguf, weights="int4")
    for i in (0, 17, 29):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            ours = getattr(lm.model.layers[i], name)
            assert isinstance(ours, Int4Linear)
            # the Q4_1 values dequantised to fp32 are exactly the int4 format's values
            assert torch.equal(ours.dequantize(), getattr(loaded_model.model.layers[i], name).weight)
    # the tied head comes from Q8_0 embeddings: int8 (8-bit source), embeddings themselves fp32
    assert isinstance(lm.model.lm_head, Int8Linear)
    assert torch.equal(lm.model.embed_tokens.weight, loaded_model.model.embed_tokens.weight)


def _logits(lm, text: str) -> torch.Tensor:
    """Logits ``[T, vocab]`` of one prefill of ``text``."""
    from pagedkv.attention import get_backend
    from pagedkv.attention.base import AttentionMetadata

    ids = lm.tokenizer(text)["input_ids"]
    backend = get_backend("cpu")
    caches = allocate_kv_caches(lm.model, backend, num_blocks=8, block_size=16)
    md = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(8))], 16)
    with torch.inference_mode():
        return lm.model.compute_logits(lm.model(torch.tensor(ids), torch.arange(len(ids)), caches, md, backend))


TEXT = "We hold these truths to be self-evident, that all men are created equal, that they are endowed"


def test_forced_fallback_route_runs_correctly(bundled_gguf, loaded_model):
    """What a CPU without the fast kernels runs: dequantise + F.linear in fp32. int4's layer
    weights are exactly fp32's there, so its logits differ from fp32 only through the int8
    head; and the fast route computes the same logits up to bf16 rounding."""
    from pagedkv.model.loader import load_model

    slow = load_model(bundled_gguf, weights="int4", route="fallback")
    routes = {m.route for m in slow.model.modules() if isinstance(m, (Int4Linear, Int8Linear))}
    assert routes == {"fallback"}
    ref, got = _logits(loaded_model, TEXT), _logits(slow, TEXT)
    fast_model = load_model(bundled_gguf, weights="int4")
    fast = _logits(fast_model, TEXT)
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() < FALLBACK_TOL * scale
    q8 = {m.kernel(fast.shape[0]) for m in fast_model.model.modules() if isinstance(m, Int4Linear)} == {"q8"}
    assert (fast - got).abs().max().item() < (Q8_TOL if q8 else FAST_TOL) * scale
    assert (fast - got).abs().mean().item() < Q8_MEAN_TOL * scale
    assert (fast.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    assert all(len(t) == 24 for t in _greedy(slow))


def test_engine_weights_option(loaded_model):
    from pagedkv.engine.engine import LLMEngine

    with pytest.raises(ConfigError, match="has fp32 weights; the engine asks for int4"):
        LLMEngine(loaded_model, weights="int4", num_blocks=8)
    eng = LLMEngine(loaded_model, num_blocks=8)  # auto takes the loaded model as it is
    assert eng.loaded.weights == "fp32"


def test_perplexity_in_decode_sized_chunks_equals_the_whole_window_on_fp32(loaded_model):
    from pagedkv.bench.quality import perplexity

    ids = loaded_model.tokenizer("The quick brown fox jumps over the lazy dog. " * 6)["input_ids"]
    whole = perplexity(loaded_model.model, ids, window=40)
    chunked = perplexity(loaded_model.model, ids, window=40, rows=7)  # chunks across block edges
    assert 1.0 < whole < 1000.0
    assert abs(chunked / whole - 1.0) < 1e-4, (whole, chunked)


@pytest.mark.usefixtures("other_kernels")
def test_dynamic_int8_only_where_int8_sums_are_exact(monkeypatch):
    # without VNNI, oneDNN's u8 x s8 kernels (and torch._int_mm) add pairs of products in int16
    # with saturation: dynamic int8's codes overflow it (under ONEDNN_MAX_CPU_ISA=AVX2 the
    # bundled int4 model's greedy text turned to "jack, jack, jack"), so the route needs VNNI
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("PAGEDKV_INT8_ROWS", raising=False)
    assert not CpuFeatures("AVX2", False, False, False).int8_exact
    assert CpuFeatures("AVX2", False, False, True).int8_exact and CpuFeatures("AVX512", True, True, False).int8_exact
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert not CpuFeatures("AVX512", True, True, True).int8_exact
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")
    assert CpuFeatures("AVX512", True, True, True).int8_exact
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(quant, "cpu_features", lambda: CpuFeatures("AVX2", False, False, False))
    g = torch.Generator().manual_seed(6)
    m = Int4Linear.from_float(torch.randn(48, 64, generator=g)).prepare("fast")
    assert m.int8_rows == 0 and m._w8_packed is None and m._w8_t is None
    assert [m.kernel(r) for r in (8, 64, 65)] == ["bf16", "bf16", "wide"]
    x = torch.randn(100, 64, generator=g)
    torch.testing.assert_close(m(x), x @ m.dequantize().T, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("other_kernels")
def test_int8_route_off_under_an_isa_cap_gives_exact_sums_end_to_end():
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from pagedkv.model.quant import Int8Linear\n"
        "g = torch.Generator().manual_seed(7)\n"
        "m = Int8Linear.from_float(torch.randn(96, 128, generator=g)).prepare('fast')\n"
        "x = torch.rand(100, 128, generator=g) * 4\n"  # all positive: the saturating case
        "ref = x.double() @ m.dequantize().double().T\n"
        "err = ((m(x).double() - ref).abs().max() / ref.abs().max()).item()\n"
        "print(m.int8_rows, m.kernel(100), err < 1e-2)\n"
    )
    env = dict(__import__("os").environ, ONEDNN_MAX_CPU_ISA="AVX2", PAGEDKV_QMM="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0", "wide", "True"]


@pytest.mark.usefixtures("other_kernels")
def test_a_copied_quantised_linear_has_its_own_int8_weights():
    import copy
    import gc

    g = torch.Generator().manual_seed(8)
    a = Int4Linear.from_float(torch.randn(48, 64, generator=g), torch.randn(48, generator=g)).prepare("fast")
    b = copy.deepcopy(a)
    assert isinstance(b, Int4Linear) and b.route == a.route
    if int8_here():
        assert b.int8_key != a.int8_key
    else:  # AVX2: neither has int8 weights; the copy runs the same kernels
        assert_int8_refused(a)
        assert_int8_refused(b)
    assert torch.equal(b.qcodes, a.qcodes) and b.qcodes.data_ptr() != a.qcodes.data_ptr()
    x = torch.randn(16, 64, generator=g)
    want = a(x)
    del a
    gc.collect()
    assert torch.equal(b(x), want)  # its own prepacked weights, the original gone


@pytest.mark.usefixtures("other_kernels")
@pytest.mark.parametrize("features", ["vnni", "profile"])
def test_released_int8_weights_leave_the_layer_on_its_other_kernels(monkeypatch, features):
    # what the exit hook does to every registered layer before the interpreter tears down.
    # "vnni": a VNNI host's layer on any CPU (prepacked, released before any int8 matmul runs);
    # "profile": this process's CPU (an AVX2 profile never had int8 weights: nothing to release)
    monkeypatch.delenv("PAGEDKV_INT8_ROWS", raising=False)
    if features == "vnni":
        monkeypatch.setattr(quant, "cpu_features", lambda: VNNI)
    g = torch.Generator().manual_seed(9)
    m = Int8Linear.from_float(torch.randn(48, 64, generator=g)).prepare("fast")
    x = torch.randn(100, 64, generator=g)
    if features == "vnni" or int8_here():
        assert m.kernel(100) == "int8" and (m._w8_packed is not None) == quant.onednn_int8()
    else:
        assert_int8_refused(m)
    m.release_int8()
    assert m.int8_rows == 0 and m._w8_packed is None and m._w8_scale is None
    assert m.kernel(100) == "wide" and m.kernel(8) == "bf16"
    ref = x @ m.dequantize().T  # the wide route: bf16 on a CPU with native bf16, else fp32
    assert (m(x) - ref).abs().max().item() < 0.01 * ref.abs().max().item()
    with pytest.raises(RuntimeError, match="route is off"):
        m.int8_matmul(torch.zeros(2, 64, dtype=torch.uint8))


def test_bf16_weights_prepacked_for_onednn_keep_their_bits_and_their_plain_copy(monkeypatch):
    """Without ``qmm`` (``PAGEDKV_QMM=0``; with it, ``test_qmm_bf16.py``), where the CPU
    multiplies bf16 natively, a prepared bf16 layer holds its weights once, in
    oneDNN's blocked layout (the plain buffer freed), and multiplies with the same bits as the
    plain bf16 ``F.linear``; the plain weights come back bit for bit for ``state_dict``,
    ``dequantize``, a deep copy and deterministic mode, and a loaded state replaces the packed
    copy. Elsewhere (an AVX2 host, where bf16 is emulated: one fp32 matmul) and under
    ``PAGEDKV_BF16_PREPACK=0`` nothing is packed."""
    import copy

    import torch.nn.functional as F

    from pagedkv.model import invariant
    from pagedkv.model.quant import cpu_features

    monkeypatch.setenv("PAGEDKV_QMM", "0")
    native = cpu_features().bf16_fast

    def lin(xx, ww, det=False):
        f = invariant.linear if det else F.linear
        return f(xx.to(torch.bfloat16), ww).float() if native else f(xx, ww.float())

    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(96, 64, generator=g), torch.randn(9, 64, generator=g)
    wb = w.to(torch.bfloat16)
    want = [lin(x[:r], wb) for r in (1, 5, 9)]
    m = BF16Linear(w).prepare("fast")
    packed = m.weight is None
    assert packed == cpu_features().bf16_fast  # AVX512-BF16 / AMX: packed; AVX2: plain F.linear
    assert [torch.equal(m(x[:r]), v) for r, v in zip((1, 5, 9), want)] == [True] * 3
    assert torch.equal(m.state_dict()["weight"], wb) and torch.equal(m.dequantize(), wb.float())
    assert (m.weight is None) == packed  # state_dict made the plain copy for that call only
    c = copy.deepcopy(m)
    assert (c.weight is None) == packed and torch.equal(c(x[:5]), want[1])
    c.keep_plain()
    assert torch.equal(c.weight, wb) and torch.equal(copy.deepcopy(c).prepare("fast").weight, wb)
    m.set_deterministic(True)
    assert torch.equal(m.weight, wb) and torch.equal(m(x[:1]), want[0] if native else lin(x[:1], wb, det=True))
    m.set_deterministic(False)
    assert (m.weight is None) == packed
    m.load_state_dict({}, strict=False)  # a state without this layer's weights (a model's other parts)
    assert (m.weight is None) == packed and torch.equal(m(x[:5]), want[1])
    w2 = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    m.load_state_dict({"weight": w2, "bias": None}, strict=False)
    assert torch.equal(m(x[:5]), lin(x[:5], w2))
    monkeypatch.setenv("PAGEDKV_BF16_PREPACK", "0")
    assert torch.equal(BF16Linear(w).prepare("fast").weight, wb)


def test_a_bf16_model_runs_the_native_step_on_its_weights_held_once(bundled_gguf, monkeypatch):
    """Through the loader every bf16 layer runs ``qmm``'s bf16 kernel on its own weight (no
    second copy), so the native step takes the model, and its greedy tokens equal those of the
    same kernels driven from Python (``PAGEDKV_NATIVE_STEP=0``)."""
    from pagedkv.model.loader import load_model

    lm = load_model(bundled_gguf, weights="bf16")
    layers = [m for m in lm.model.modules() if isinstance(m, BF16Linear)]
    assert len(layers) == 121  # 30 x (qkv, o, gate_up, down) + the LM head
    assert all(m._qmm is not None and m._qmm.codes.data_ptr() == m.weight.data_ptr() for m in layers)
    native = _greedy(lm)
    assert lm.model.native_state == "on"  # set by the first forward
    monkeypatch.setenv("PAGEDKV_NATIVE_STEP", "0")
    python = load_model(bundled_gguf, weights="bf16")
    assert native == _greedy(python) and python.model.native_state.startswith("off")


def test_a_bf16_model_holds_its_weights_once_prepacked_and_greedy_tokens_match_plain(bundled_gguf, monkeypatch):
    """Without ``qmm`` (``PAGEDKV_QMM=0``), through the loader (which loads the model's other
    tensors after the linears are prepared) every bf16 layer stays prepacked where the CPU
    multiplies bf16 natively, and the engine's greedy tokens equal those of the plain
    ``F.linear`` layers (``PAGEDKV_BF16_PREPACK=0``)."""
    from pagedkv.model.loader import load_model
    from pagedkv.model.quant import cpu_features

    monkeypatch.setenv("PAGEDKV_QMM", "0")
    lm = load_model(bundled_gguf, weights="bf16")
    layers = [m for m in lm.model.modules() if isinstance(m, BF16Linear)]
    assert len(layers) == 121  # 30 x (qkv, o, gate_up, down) + the LM head
    assert sum(m.weight is None for m in layers) == (121 if cpu_features().bf16_fast else 0)
    packed = _greedy(lm)
    monkeypatch.setenv("PAGEDKV_BF16_PREPACK", "0")
    plain = load_model(bundled_gguf, weights="bf16")
    assert all(m.weight is not None for m in plain.model.modules() if isinstance(m, BF16Linear))
    assert packed == _greedy(plain)
    # compiled steps keep plain weights (inductor's freezing packs them; the packed tensor does
    # not trace), also through a later prepare
    from pagedkv.model.compiled import CompiledDecode

    CompiledDecode(lm.model)
    assert all(m.weight is not None and m.prepare("fast").weight is not None for m in layers)
