"""The engine with a quantised KV cache (``kv_cache_dtype``): the bytes it allocates against
KVCacheSpec and the planner (every dtype), blocks from a fixed budget, chunked prefill,
preemption, prefix hits and copy-on-write forks on int8 blocks, the prefix-cache identity,
bad input and the CLI flags."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.cli import main
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.errors import ConfigError
from pagedkv.examples.capacity_plan import plan
from pagedkv.kv import CacheKeys, check_invariants, hash_blocks

TEXT = (
    "The history of computing is a story of memory. Early machines stored programs on punched "
    "cards and paper tape; later, magnetic cores and then semiconductor memory made random "
    "access cheap. Operating systems introduced virtual memory, splitting address spaces into "
    "fixed-size pages so that programs could use more memory than the machine physically had."
)
L, HKV, D = 30, 3, 64  # the bundled SmolLM2-135M: layers, KV heads, head dim


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
    """int8 holds 2x the blocks of bf16 and 4x of fp32, less its scales: one bf16 scale per
    64-element head vector is 3% (2 * 64 / 66 = 1.94x, 3.88x)."""
    blocks = {d: LLMEngine(loaded_model, kv_cache_dtype=d, kv_cache_memory="64MiB").num_blocks
              for d in ("float32", "bfloat16", "int8", "fp8_e4m3")}
    assert blocks == {"float32": 91, "bfloat16": 182, "int8": 353, "fp8_e4m3": 353}
    assert blocks["int8"] / blocks["bfloat16"] == pytest.approx(2 * 64 / 66, rel=0.01)
    assert blocks["int8"] / blocks["float32"] == pytest.approx(4 * 64 / 66, rel=0.01)


# ------------------------------------------------------------------ the engine on quantised blocks
def _run(loaded_model, prompts, params, **kw):
    kw.setdefault("num_blocks", 256)
    llm = LLM(loaded_model, kv_cache_dtype="int8", debug_invariants=True, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    assert eng.kv.num_used_blocks == 0, "blocks leaked"
    check_invariants(eng.kv)
    return outs, eng


def test_chunked_prefill_writes_the_same_codes(loaded_model):
    """Quantisation is per token and head: a prompt prefilled in chunks of 4 or token by token
    stores the codes and scales of one whole prefill in the first layers (before float
    rounding differences between batch shapes can reach a code boundary: at most one step,
    in a handful of elements), at the right slots."""
    from pagedkv.attention import layouts

    ids = LLM(loaded_model, num_blocks=8).engine.tokenize(TEXT)[:40]
    caches = {}
    for chunk in (40, 4, 1):
        eng = LLMEngine(loaded_model, kv_cache_dtype="int8", num_blocks=16, max_num_batched_tokens=chunk,
                        shuffle_blocks=chunk)
        eng.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=2))  # still running after the prefill
        eng.step() if chunk == 40 else [eng.step() for _ in range(40 // chunk)]
        table = eng.kv.get_block_ids("r")
        slots = torch.tensor([table[t // 16] * 16 + t % 16 for t in range(40)])
        caches[chunk] = [layouts.gather_raw(eng.runner.kv_caches[layer], slots) for layer in (0, 1)]
    for chunk in (4, 1):
        for got, want in zip(caches[chunk], caches[40]):
            for g, w in zip(got, want):  # K codes, V codes, K scales, V scales
                if g.dtype == torch.int8:
                    diff = (g.int() - w.int()).abs()
                    assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= g.numel() // 200
                else:
                    assert torch.allclose(g.float(), w.float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_every_write_stores_quantize_of_its_own_tokens_in_any_chunking(loaded_model, kv_dtype):
    """In the engine, one-shot and with max_num_batched_tokens 4 and 16: every K/V write of
    every layer stores exactly ``quantize`` of the rows it was given (codes and bf16 scales bit
    for bit, read back from the slots), so quantisation adds no dependence on chunking of its
    own; the greedy tokens agree. The logprobs may still differ in the 2nd-3rd decimal: the
    float32 K/V fed to it differ by an ulp between batch shapes (GEMM and attention routes)
    and a code or a bf16-rounded scale can flip (docs/backends.md)."""
    from pagedkv.attention import layouts
    from pagedkv.attention.quant import FORMATS, quantize

    ids = LLM(loaded_model, num_blocks=8).engine.tokenize(TEXT)[:23]
    fmt = FORMATS[kv_dtype]
    runs = {}
    for chunk in (None, 4, 16):
        kw = {} if chunk is None else {"max_num_batched_tokens": chunk}
        llm = LLM(loaded_model, kv_cache_dtype=kv_dtype, num_blocks=16, block_size=16, enable_prefix_caching=False, **kw)
        be = llm.engine.backend
        real_write, checked = be.write_kv, []

        def write_kv(cache, key, value, slots, real_write=real_write, checked=checked):
            real_write(cache, key, value, slots)
            keep = slots >= 0
            k, v, ks, vs = layouts.gather_raw(cache, slots[keep])
            for got_c, got_s, x in ((k, ks, key[keep]), (v, vs, value[keep])):
                want_c, want_s = quantize(x, fmt, x.shape[-1])
                checked.append(torch.equal(got_c, want_c) and torch.equal(got_s.view(torch.int16), want_s.view(torch.int16)))

        be.write_kv = write_kv
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(checked) >= 2 * L * (1 + 3) and all(checked), (chunk, checked.count(False))
        runs[chunk] = out
    for chunk in (4, 16):
        assert runs[chunk].token_ids == runs[None].token_ids
        for a, b, t in zip(runs[chunk].logprobs, runs[None].logprobs, runs[None].token_ids):
            assert abs(a[t] - b[t]) < 0.1


def test_int8_schedules_preemption_prefix_hits_and_forks(loaded_model, agreement):
    """The same requests under other schedules, on int8 blocks: shuffled physical blocks (the
    same arithmetic) give the very same tokens; chunked prefill, preemption (blocks freed and
    recomputed), prefix hits (blocks written by an earlier request) and n=2 forks (CoW copies
    of codes and scales) agree on every completion's first tokens and on most completions
    (see ``agreement`` in conftest for why not all)."""
    ids = LLM(loaded_model, num_blocks=8).engine.tokenize(TEXT)
    prompts = [ids[i : i + n] for i, n in enumerate([13, 30, 17, 33, 40, 9])]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want, _ = _run(loaded_model, prompts, greedy)
    shuffled, _ = _run(loaded_model, prompts, greedy, shuffle_blocks=7)
    assert [o.token_ids for o in shuffled] == [o.token_ids for o in want]
    runs = {"chunked": _run(loaded_model, prompts, greedy, max_num_batched_tokens=16),
            "preempted": _run(loaded_model, prompts, greedy, block_size=4, num_blocks=40),
            "forks": _run(loaded_model, prompts[:3], SamplingParams(n=2, temperature=0.0, max_tokens=16,
                                                                    ignore_eos=True))}
    assert runs["preempted"][1].scheduler.stats.num_preemptions > 0
    assert sum(o.metrics.num_cow_copies for o in runs["forks"][0]) > 0
    # prefix caching: the shared 32-token prefix is served from int8 blocks written before
    shared = [ids[:32] + ids[40 + 3 * i : 43 + 3 * i] for i in range(3)]
    plain, _ = _run(loaded_model, shared, greedy)
    llm = LLM(loaded_model, kv_cache_dtype="int8", num_blocks=256, enable_prefix_caching=True, debug_invariants=True)
    llm.generate([shared[0]], greedy, use_tqdm=False)
    hits = llm.generate(shared, greedy, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in hits)
    same = total = 0
    for got, ref in [(runs[k][0], want) for k in runs] + [(hits, plain)]:
        s, t, shortest = agreement(got, ref)
        assert shortest >= 4, (s, t, shortest)
        same, total = same + s, total + t
    assert same >= 0.75 * total, (same, total)  # 21 completions


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


def test_kv_cache_dtype_spellings_and_torch_dtypes():
    """Case and whitespace variants, ``torch.``-prefixed names and torch dtypes themselves
    (as ``dtype=`` takes them) name a format; torch dtypes used to be 'unknown'."""
    from pagedkv.utils import kv_cache_dtype

    said = {n: kv_cache_dtype(n) for n in ("INT8", " Fp8 ", "torch.int8", "FP8_E5M2", "BF16", "Auto")}
    assert said == {"INT8": "int8", " Fp8 ": "fp8_e4m3", "torch.int8": "int8", "FP8_E5M2": "fp8_e5m2",
                    "BF16": "bfloat16", "Auto": "float32"}
    dtypes = (torch.int8, torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
    assert [kv_cache_dtype(t) for t in dtypes] == ["int8", "bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"]
    assert EngineConfig.from_kwargs({"kv_cache_dtype": torch.int8, "kv_quant_group_size": 16}).kv_quant_group_size == 16
    for bad in (torch.uint8, None, 8, "", "int4", "fp8_e4m3fnuz"):
        with pytest.raises(ConfigError, match=r"kv_cache_dtype: unknown .* \(valid: auto, float32,"):
            kv_cache_dtype(bad)


def test_group_size_with_a_plain_format_fails_before_any_model_loads(capsys):
    """A group size needs int8/fp8: EngineConfig says so (it used to pass, and the engine
    raised only after loading the model), for ``auto`` too (it is the model dtype)."""
    msg = "kv_quant_group_size applies to a quantised kv_cache_dtype (int8, fp8_e4m3, fp8_e5m2), not "
    for kv, dtype, name in (("float32", "float32", "float32"), ("auto", "bf16", "bfloat16"), ("FP16", "fp32", "float16")):
        with pytest.raises(ConfigError) as e:
            EngineConfig.from_kwargs({"kv_cache_dtype": kv, "dtype": dtype, "kv_quant_group_size": 16})
        assert str(e.value) == msg + name
    # the CLI: exit 2 and the message, not the missing model's error (nothing was loaded)
    for cmd in (["generate", "--model", "/nonexistent.gguf", "--kv-cache-dtype", "float32",
                 "--kv-quant-group-size", "16", "hi"],
                ["serve", "--model", "/nonexistent.gguf", "--kv-cache-dtype", "BF16", "--kv-quant-group-size", "16"]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and "nonexistent" not in err


def test_an_fp8_format_torch_lacks_is_a_config_error(monkeypatch):
    import torch

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
    p = json.loads(capsys.readouterr().out)
    assert p["bytes_per_token"] == L * 2 * HKV * 66 == 11_880 and p["num_blocks"] == 2**30 // (16 * 11_880)
    assert main(["plan", "--kv-cache-dtype", "int9"]) == 2
    assert "valid: auto, float32" in capsys.readouterr().err
    assert main(["generate", "--kv-cache-dtype", "int8", "--kv-quant-group-size", "7", "hi"]) == 2
    assert "does not divide head_dim 64" in capsys.readouterr().err


def test_int8_blocks_go_to_a_host_tier_and_come_back_bit_for_bit(loaded_model):
    """kv_offload moves whole blocks through the backend's export/import: int8 codes and
    their scales leave the pool and return unchanged, and the store's identity names the
    format (int8 blocks, bf16 scales)."""
    a = [(11 * i + 5) % 4000 + 200 for i in range(25)]  # 6 full blocks of 4
    b = [(17 * i + 3) % 4000 + 4300 for i in range(37)]  # 10 blocks: evicts most of a's
    block_bytes = 4 * L * 2 * HKV * 66  # 47,520 B: codes + scales of 4 tokens
    llm = LLM(loaded_model, kv_cache_dtype="int8", block_size=4, num_blocks=12, enable_prefix_caching=True,
              kv_offload=[f"host:{8 * block_bytes}"], debug_invariants=True)
    eng = llm.engine
    codec = eng.runner.kv_payload_codec()
    assert codec.nbytes == block_bytes and "int8" in codec.format and "bfloat16" in codec.format
    keys = CacheKeys(model_id=eng.model_id, revision=eng.revision, kv_cache_dtype=eng.kv_format_id)
    hashes = hash_blocks(a, 4, keys)

    def payloads():
        return codec.export([eng.kv.pool.cached[h].block_id for h in hashes])[0].copy()

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = llm.generate([a], params, use_tqdm=False)[0]
    before = payloads()
    llm.generate([b], params, use_tqdm=False)
    again = llm.generate([a], params, use_tqdm=False)[0]
    assert again.num_cached_tokens_by_tier.get("host", 0) >= 8  # blocks came back from the host tier
    assert again.token_ids == first.token_ids
    assert (payloads() == before).all()  # codes and scales, bit for bit
    check_invariants(eng.kv)


def test_aborts_and_cow_forks_on_int8_blocks(loaded_model):
    """Aborting mid-prefill and mid-decode frees every int8 block (invariants hold); an n=2
    fork's copy-on-write copies the partial prompt block's codes AND scales: the copy
    equals its source by value in every layer, and its scales are real (nonzero)."""
    from pagedkv.attention import layouts

    ids = LLM(loaded_model, num_blocks=8).engine.tokenize(TEXT)
    eng = LLMEngine(loaded_model, kv_cache_dtype="int8", block_size=4, num_blocks=16,
                    max_num_batched_tokens=8, debug_invariants=True)
    eng.add_request("p", ids[:30], SamplingParams(temperature=0.0, max_tokens=4))
    eng.step()  # 8 of 30 prompt tokens
    assert eng.kv.get_block_ids("p") == [0, 1]
    eng.abort_request("p")  # mid-prefill
    assert eng.kv.num_used_blocks == 0 and check_invariants(eng.kv) == 16
    copies: list[tuple[int, int]] = []
    snap: list[bool] = []
    run_copy = eng.runner.copy_blocks

    def checked_copy(pairs):
        run_copy(pairs)
        copies.extend(pairs)
        for cache in eng.runner.kv_caches:
            for s, d in pairs:
                k, v, ks, vs = (t[d] for t in cache.block_tensors())
                sk, sv, sks, svs = (t[s] for t in cache.block_tensors())
                snap.append(torch.equal(k, sk) and torch.equal(v, sv) and torch.equal(ks, sks)
                            and torch.equal(vs, svs) and bool((ks.float()[:2] > 0).all()))

    eng.runner.copy_blocks = checked_copy
    eng.add_request("f", ids[:10], SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True))
    eng.add_request("d", ids[12:18], SamplingParams(temperature=0.0, max_tokens=30))
    for _ in range(4):  # f's and d's prefills, then decodes: f's two sequences share block 3 of 10 tokens
        eng.step()
    assert len(copies) == 1 and len(snap) == 30 and all(snap)
    src, dst = copies[0]
    # the two prompt tokens in the partial block read back the same in both sequences
    slots = torch.tensor([[src * 4, src * 4 + 1], [dst * 4, dst * 4 + 1]])
    got = [layouts.gather_raw(eng.runner.kv_caches[5], s) for s in slots]
    assert all(torch.equal(a, b) for a, b in zip(*got))
    assert len(eng.kv.get_block_ids("d")) == 2  # 6 prompt tokens + 2 decoded: still running
    eng.abort_request("d")  # mid-decode
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv.num_used_blocks == 0 and check_invariants(eng.kv) == 16
