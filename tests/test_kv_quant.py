"""Quantised KV cache (int8, fp8_e4m3, fp8_e5m2): the formats and their error bound, the bytes
the engine allocates against KVCacheSpec and the planner (every dtype), blocks from a fixed
budget, the engine on quantised blocks (chunked prefill, preemption, prefix caching,
copy-on-write forks give the tokens of the plain run with the same cache format), the
prefix-cache identity, bad input, the CPU kernel built without -march=native, CLI, metrics
and /ui."""

from __future__ import annotations

import httpx
import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import cpu_kernel
from pagedkv.attention import layouts
from pagedkv.attention.cpu import CPUBackend
from pagedkv.attention.quant import FORMATS, dequantize, error_bound, quantize
from pagedkv.attention.reference import ReferenceBackend
from pagedkv.cli import main
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.errors import ConfigError
from pagedkv.kv import CacheKeys, check_invariants, hash_blocks
from pagedkv.kv.example import plan
from pagedkv.testing import check_backend, quantized_cases

TEXT = (
    "The history of computing is a story of memory. Early machines stored programs on punched "
    "cards and paper tape; later, magnetic cores and then semiconductor memory made random "
    "access cheap. Operating systems introduced virtual memory, splitting address spaces into "
    "fixed-size pages so that programs could use more memory than the machine physically had."
)
L, HKV, D = 30, 3, 64  # the bundled SmolLM2-135M: layers, KV heads, head dim


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
    # the largest element of each group maps to (nearly) the top code
    top = vals.double().reshape(40, 3, -1, group).abs().amax(-1)
    assert bool((top >= fmt.qmax * (1 - 2.0 ** -8)).all())


def test_int8_codes_and_scales_of_two_groups():
    x = torch.tensor([[[1.0, -0.5, 0.25, 0.0, 127.0, 3.0, -2.0, 1.0]]])
    codes, scales = quantize(x, FORMATS["int8"], 4)
    assert scales.float().flatten().tolist() == pytest.approx([1 / 127, 1.0], rel=1e-3)
    assert codes.flatten().tolist() == [127, -64, 32, 0, 127, 3, -2, 1]
    assert dequantize(codes, scales, FORMATS["int8"]).flatten()[4:].tolist() == [127.0, 3.0, -2.0, 1.0]


def test_zero_and_nan_groups():
    x = torch.zeros(2, 1, 8)
    x[1, 0, 3] = float("nan")
    for fmt in FORMATS.values():
        codes, scales = quantize(x, fmt, 8)
        assert scales[0].item() == 0 and torch.equal(dequantize(codes, scales, fmt)[0], torch.zeros(1, 8))
        assert torch.isnan(scales[1]).all()  # a poisoned slot reads back as NaN (conformance kit)


# ------------------------------------------------------------------ sizes
PER_VECTOR = {"float32": 4 * D, "bfloat16": 2 * D, "float16": 2 * D}


@pytest.mark.parametrize("kv_dtype,group", [
    ("auto", None), ("float32", None), ("bfloat16", None), ("float16", None),
    ("int8", None), ("int8", 16), ("fp8_e4m3", None), ("fp8_e5m2", 8),
])
def test_engine_allocates_the_bytes_the_spec_and_planner_promise(loaded_model, kv_dtype, group):
    eng = LLMEngine(loaded_model, kv_cache_dtype=kv_dtype, kv_quant_group_size=group,
                    kv_cache_memory="8MiB", block_size=16)
    name = "float32" if kv_dtype == "auto" else kv_dtype
    per_vector = PER_VECTOR.get(name) or D + 2 * (D // (group or D))  # codes + bf16 scales
    assert eng.kv_spec.bytes_per_token == L * 2 * HKV * per_vector
    allocated = sum(c.nbytes for c in eng.runner.kv_caches)
    assert allocated == eng.num_blocks * 16 * eng.kv_spec.bytes_per_token
    assert eng.num_blocks == 8 * 2**20 // (16 * eng.kv_spec.bytes_per_token)
    p = plan(None, "8MiB", block_size=16, kv_cache_dtype=kv_dtype, quant_group_size=group)
    assert (p["bytes_per_token"], p["num_blocks"]) == (eng.kv_spec.bytes_per_token, eng.num_blocks)
    assert eng.kv_summary()["kv_cache_dtype"] == name
    assert all(c.kv_cache_dtype == name for c in eng.runner.kv_caches)


def test_blocks_from_a_fixed_budget_int8_vs_bf16_vs_fp32(loaded_model):
    """int8 holds 2x the blocks of bf16 and 4x of fp32, less its scales: one fp16 scale per
    64-element head vector is 3% (2 * 64 / 66 = 1.94x, 3.88x)."""
    blocks = {d: LLMEngine(loaded_model, kv_cache_dtype=d, kv_cache_memory="64MiB").num_blocks
              for d in ("float32", "bfloat16", "int8", "fp8_e4m3")}
    assert blocks == {"float32": 91, "bfloat16": 182, "int8": 353, "fp8_e4m3": 353}
    assert blocks["int8"] / blocks["bfloat16"] == pytest.approx(2 * 64 / 66, rel=0.01)
    assert blocks["int8"] / blocks["float32"] == pytest.approx(4 * 64 / 66, rel=0.01)


# ------------------------------------------------------------------ the engine on quantised blocks
NEAR_TIE = 0.02  # nats between the top two log-probabilities


def _run(loaded_model, prompts, params, **kw):
    kw.setdefault("num_blocks", 256)
    llm = LLM(loaded_model, kv_cache_dtype="int8", debug_invariants=True, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    assert eng.kv.num_used_blocks == 0, "blocks leaked"
    check_invariants(eng.kv)
    return outs, eng


def _same_up_to_near_ties(got, want) -> int:
    """Each completion of ``got`` equals ``want``'s (the same prompt's plain int8 run), or
    first differs where ``want`` had a near tie (its top two tokens within ``NEAR_TIE``):
    float rounding differs between schedules (batch shapes, kernel vs torch path), and a
    value that close to a code boundary can round to the neighbouring int8 code. Returns how
    many completions differ."""
    differ = 0
    for g, w in zip(got, want):
        for c in g.outputs:
            ref = w.outputs[0]
            k = next((i for i, (a, b) in enumerate(zip(c.token_ids, ref.token_ids)) if a != b), None)
            if k is None:
                continue
            top = sorted(ref.logprobs[k].values(), reverse=True)
            assert top[0] - top[1] < NEAR_TIE, (k, c.token_ids, ref.token_ids, ref.logprobs[k])
            differ += 1
    return differ


def test_int8_tokens_survive_chunking_preemption_prefix_hits_and_forks(loaded_model):
    """Quantisation is per token and head, so the cache holds the same codes however the
    tokens got there (up to float rounding): every schedule gives the plain int8 run's greedy
    tokens, or departs from them only at a near tie."""
    ids = LLM(loaded_model, num_blocks=8).engine.tokenize(TEXT)
    prompts = [ids[i : i + n] for i, n in enumerate([13, 30, 17, 33, 40, 9])]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    want, _ = _run(loaded_model, prompts, greedy)
    shuffled, _ = _run(loaded_model, prompts, greedy, shuffle_blocks=7)  # same arithmetic, other blocks
    assert [o.token_ids for o in shuffled] == [o.token_ids for o in want]
    differ = 0
    chunked, _ = _run(loaded_model, prompts, greedy, max_num_batched_tokens=16)
    differ += _same_up_to_near_ties(chunked, want)
    pre, eng = _run(loaded_model, prompts, greedy, block_size=4, num_blocks=40)
    assert eng.scheduler.stats.num_preemptions > 0
    differ += _same_up_to_near_ties(pre, want)
    # n=2 greedy forks share the prompt's blocks; the partial last block is copied (CoW)
    forks, _ = _run(loaded_model, prompts[:3], SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True))
    assert sum(o.metrics.num_cow_copies for o in forks) > 0
    differ += _same_up_to_near_ties(forks, want[:3])
    assert differ <= 2, differ  # of 18 completions
    # prefix caching: the shared 32-token prefix is served from int8 blocks written before
    shared = [ids[:32] + ids[40 + 3 * i : 43 + 3 * i] for i in range(3)]
    plain, _ = _run(loaded_model, shared, greedy)
    llm = LLM(loaded_model, kv_cache_dtype="int8", num_blocks=256, enable_prefix_caching=True, debug_invariants=True)
    llm.generate([shared[0]], greedy, use_tqdm=False)
    outs = llm.generate(shared, greedy, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in outs)
    assert _same_up_to_near_ties(outs, plain) <= 1


def test_tensor_parallel_ranks_hold_int8_blocks(loaded_model, monkeypatch):
    """tensor_parallel_size 3: each rank allocates int8 codes + scales for its one KV head
    (a third of the size-1 bytes per token, as KVCacheSpec says) and the greedy tokens, with a
    pool small enough to preempt and prefix caching on, are the size-1 int8 engine's."""
    monkeypatch.setenv("PAGEDKV_TP_THREADS", "1")
    monkeypatch.setenv("PAGEDKV_TP_TIMEOUT", "60")
    kw = dict(kv_cache_dtype="int8", block_size=4, num_blocks=40, enable_prefix_caching=True,
              max_num_batched_tokens=64, debug_invariants=True)
    tp3 = LLM(loaded_model, tensor_parallel_size=3, **kw)
    try:
        infos = tp3.engine.runner.query_workers()
        assert [i["kv_bytes_per_token"] for i in infos] == [L * 2 * 1 * 66] * 3 == [tp3.engine.kv_spec.bytes_per_token] * 3
        ids = tp3.engine.tokenize(TEXT)
        tp1 = LLM(loaded_model, **kw)
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
        shared = [ids[:20] + ids[30 + 2 * i : 32 + 2 * i] for i in range(3)]  # prefix hits
        long = [ids[i : i + n] for i, n in enumerate([1, 15, 16, 17, 33, 47])]  # ~55 blocks of 4: preempts
        differ = 0
        for batch in (shared[:1], shared, long):
            want = tp1.generate(batch, greedy, use_tqdm=False)
            got = tp3.generate(batch, greedy, use_tqdm=False)
            differ += _same_up_to_near_ties(got, want)
        assert differ <= 1
        assert tp3.engine.scheduler.stats.num_preemptions > 0
        assert tp3.engine.get_stats().kv_prefix_hits >= 3 * 16  # the shared prefix's 4 full blocks, 3 times
        check_invariants(tp3.engine.kv)
    finally:
        tp3.engine.close()


def test_int8_and_fp8_caches_still_say_paris(loaded_model):
    for kv_dtype in ("int8", "fp8_e4m3"):
        llm = LLM(loaded_model, kv_cache_dtype=kv_dtype, num_blocks=64)
        out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                       SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
        assert "Paris" in out.text, (kv_dtype, out.text)


def test_prefix_cache_identity_includes_the_kv_format(loaded_model):
    ids = list(range(100, 132))
    h = {k: hash_blocks(ids, 16, CacheKeys(model_id="m", kv_cache_dtype=k)) for k in ("float32", "int8/g64", "int8/g16")}
    assert len({tuple(v) for v in h.values()}) == 3  # no two formats share a block hash
    assert hash_blocks(ids, 16, CacheKeys(model_id="m")) not in h.values()
    assert LLMEngine(loaded_model, num_blocks=8, kv_cache_dtype="int8").kv_format_id == "int8/g64"
    assert LLMEngine(loaded_model, num_blocks=8, kv_cache_dtype="int8", kv_quant_group_size=16).kv_format_id == "int8/g16"
    assert LLMEngine(loaded_model, num_blocks=8).kv_format_id == "float32"


# ------------------------------------------------------------------ bad input
def test_unknown_kv_cache_dtype_names_the_valid_values():
    with pytest.raises(ConfigError, match="valid: auto, float32, bfloat16, float16, int8, fp8_e4m3, fp8_e5m2"):
        EngineConfig.from_kwargs({"kv_cache_dtype": "fp4"})
    for bad in (0, -8, 2.5, True):
        with pytest.raises(ConfigError, match="kv_quant_group_size"):
            EngineConfig.from_kwargs({"kv_cache_dtype": "int8", "kv_quant_group_size": bad})


def test_an_fp8_format_torch_lacks_is_a_config_error(monkeypatch):
    monkeypatch.delattr(torch, "float8_e5m2")
    with pytest.raises(ConfigError, match=r"needs torch.float8_e5m2.*valid here: auto, float32, bfloat16, float16, int8, fp8_e4m3\)"):
        EngineConfig.from_kwargs({"kv_cache_dtype": "fp8_e5m2"})
    EngineConfig.from_kwargs({"kv_cache_dtype": "fp8_e4m3"})  # still fine


def test_group_size_must_divide_head_dim(loaded_model):
    with pytest.raises(ConfigError, match=r"48 does not divide head_dim 64 \(valid: 1, 2, 4, 8, 16, 32, 64\)"):
        LLMEngine(loaded_model, num_blocks=8, kv_cache_dtype="int8", kv_quant_group_size=48)
    with pytest.raises(ConfigError, match="applies to a quantised kv_cache_dtype"):
        LLMEngine(loaded_model, num_blocks=8, kv_quant_group_size=16)
    with pytest.raises(ConfigError, match="does not divide"):
        plan(None, "1GiB", kv_cache_dtype="fp8_e4m3", quant_group_size=5)


def test_cli_flags(capsys):
    assert main(["plan", "--kv-budget", "1GiB", "--kv-cache-dtype", "int8", "--json"]) == 0
    import json

    p = json.loads(capsys.readouterr().out)
    assert p["bytes_per_token"] == L * 2 * HKV * 66 == 11_880 and p["num_blocks"] == 2**30 // (16 * 11_880)
    assert main(["plan", "--kv-cache-dtype", "int9"]) == 2
    assert "valid: auto, float32" in capsys.readouterr().err
    assert main(["generate", "--kv-cache-dtype", "int8", "--kv-quant-group-size", "7", "hi"]) == 2
    assert "does not divide head_dim 64" in capsys.readouterr().err


# ------------------------------------------------------------------ kernel portability
def test_cpu_kernel_without_native_flags_passes_the_quantised_cases(monkeypatch):
    """The kernel's int8/fp8/fp16 decoding is portable C (GCC vector extensions, integer bit
    manipulation): built for baseline x86-64 (SSE2 only) it gives the same answers."""
    if cpu_kernel.get() is None:
        pytest.skip(f"no C compiler here: {cpu_kernel.build_error()}")
    import platform

    march = "-march=x86-64" if platform.machine() in ("x86_64", "AMD64") else "-march=armv8-a"
    monkeypatch.setattr(cpu_kernel, "_FLAGS", [march if f == "-march=native" else f for f in cpu_kernel._FLAGS])
    monkeypatch.setattr(cpu_kernel, "_state", {})
    kernel = cpu_kernel.get()
    assert kernel is not None, cpu_kernel.build_error()
    cases = [c for c in quantized_cases() if "group" not in c.tags or c.quant_group_size % 8 == 0]
    report = check_backend(CPUBackend(), cases=cases)
    assert report.ok, report.summary()


def test_torch_path_alone_passes_the_quantised_cases():
    report = check_backend(CPUBackend(use_kernel=False), cases=quantized_cases())
    assert report.ok, report.summary()


# ------------------------------------------------------------------ metrics and /ui
def test_metrics_and_ui_show_the_kv_format(loaded_model):
    from pagedkv.server.app import build_app
    from pagedkv.server.threaded import ThreadedServer

    engine = LLMEngine(loaded_model, num_blocks=32, kv_cache_dtype="fp8_e4m3", kv_quant_group_size=32)
    srv = ThreadedServer(build_app(engine))
    try:
        text = httpx.get(srv.url + "/metrics").text
        assert 'kv_cache_dtype="fp8_e4m3"' in text and 'quant_group_size="32"' in text
        assert "pagedkv_kv_cache_bytes_per_token" in text and " 12240.0" in text  # 30*2*3*(64+4)
        state = httpx.get(srv.url + "/ui/state").json()
        assert (state["kv_cache_dtype"], state["kv_quant_group_size"], state["kv_bytes_per_token"]) == ("fp8_e4m3", 32, 12_240)
        assert 'id="kvdtype"' in httpx.get(srv.url + "/ui").text
    finally:
        srv.stop()


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
