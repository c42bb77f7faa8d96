"""`pagedkv bench models`: the random-GGUF maker (on a tiny shape), the RSS guard, the llama.cpp
tool runs (with stand-in scripts) and the report on fake measurements; no llama.cpp build needed."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pagedkv.bench.models import run as bench_models
from pagedkv.bench.models import make as mm
from pagedkv.bench.models.guard import run_guarded
from pagedkv.bench.models.report import render_markdown, spread, summarize_model
from pagedkv.bench.variants import read_variants
from pagedkv.gguf_header import read_gguf_header

TINY = mm.SHAPES["tiny"]  # hidden 64, 2 layers, 4 heads, 2 KV heads, ffn 128, vocab 49,152 + 16


@pytest.fixture(scope="module")
def tokenizer():
    return mm.tokenizer_fields()


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("models")
    return {q: (d / f"tiny-{q}.gguf", mm.write_random_gguf(d / f"tiny-{q}.gguf", TINY, q, tokenizer=tokenizer))
            for q in ("f16", "q8_0", "q4_0")}


def test_tiny_shape_tensors():
    names = [n for n, _ in TINY.tensors()]
    assert len(names) == 1 + 2 * 9 + 1  # embedding, 9 per layer, final norm; tied: no output.weight
    assert TINY.head_dim == 16 and TINY.num_params() == 49168 * 64 + 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64 + 2 * 64) + 64
    assert [n for n, _ in mm.SHAPES["8b"].tensors()][-1] == "output.weight"  # Llama-3.1-8B is not tied
    assert mm.SHAPES["8b"].num_params() == pytest.approx(8.03e9, rel=0.01)
    assert mm.SHAPES["3b"].num_params() == pytest.approx(3.21e9, rel=0.01)


@pytest.mark.parametrize("qtype,ggml_type,bytes_per_32", [("f16", 1, 64), ("q8_0", 8, 34), ("q4_0", 2, 18)])
def test_written_gguf_has_the_shapes_types_and_bytes(tiny_files, qtype, ggml_type, bytes_per_32):
    path, facts = tiny_files[qtype]
    h = read_gguf_header(path)
    assert facts["tensors"] == len(h.tensors) == 20 and facts["bytes"] == path.stat().st_size
    assert [(t.name, t.shape) for t in h.tensors] == [(n, s) for n, s in TINY.tensors()]
    assert {t.ggml_type for t in h.tensors if len(t.shape) == 1} == {0}  # norms F32
    assert {t.ggml_type for t in h.tensors if len(t.shape) == 2} == {ggml_type}
    md = h.metadata
    assert md["general.architecture"] == "llama" and md["llama.block_count"] == 2
    assert md["llama.embedding_length"] == 64 and md["llama.attention.head_count_kv"] == 2
    assert md["llama.vocab_size"] == 49168 and len(md["tokenizer.ggml.tokens"]) == 49168
    assert len(md["tokenizer.ggml.token_type"]) == 49168 and int(md["tokenizer.ggml.token_type"][-1]) == 1  # NORMAL
    # each tensor's bytes: the offsets step by the aligned size of the one before
    offs = [t.offset for t in h.tensors]
    for t, nxt in zip(h.tensors[:-1], offs[1:]):
        n = int(np.prod(t.shape))
        want = 4 * n if len(t.shape) == 1 else n // 32 * bytes_per_32
        assert nxt - t.offset == -(-want // 32) * 32, t.name
    last = h.tensors[-1]  # output_norm: 64 F32 ones at the end of the file
    assert path.stat().st_size == last.offset + 256
    if qtype == "f16":
        emb = np.memmap(path, dtype=np.float16, mode="r", offset=h.tensors[0].offset, shape=(49168, 64))
        assert abs(float(emb[:4096].astype(np.float32).std()) - mm.STD) < 0.001
        norm = np.memmap(path, dtype=np.float32, mode="r", offset=last.offset, shape=(64,))
        assert np.all(norm == 1.0)


def test_padded_tokenizer(tokenizer):
    out = mm.padded_tokenizer(tokenizer, 49152 + 3)
    toks = out["tokenizer.ggml.tokens"][0]
    assert len(toks) == 49155 and toks[-3:] == ["<|extra_0|>", "<|extra_1|>", "<|extra_2|>"]
    assert out["tokenizer.ggml.token_type"][0][-1] == 1 and len(out["tokenizer.ggml.token_type"][0]) == 49155
    assert out["tokenizer.ggml.merges"] == tokenizer["tokenizer.ggml.merges"]
    with pytest.raises(ValueError, match="vocab 1000"):
        mm.padded_tokenizer(tokenizer, 1000)


def test_pagedkv_loads_and_generates_the_tiny_gguf(tiny_files, tmp_path, monkeypatch):
    from pagedkv import LLM, SamplingParams

    cache = tmp_path / "cache"
    cache.mkdir()
    bench_models.seed_kernels(cache)  # the compiled kernels linked in: no compiling here
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(cache))
    llm = LLM(model=str(tiny_files["q4_0"][0]), max_model_len=128, kv_cache_memory="16MiB")
    assert llm.engine.loaded.config.vocab_size == 49168 and llm.engine.loaded.config.num_layers == 2
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 5 and all(0 <= t < 49168 for t in out.token_ids)
    assert llm.tokenizer.encode("hello world") == [28120, 905]  # SmolLM2's own ids
    assert bench_models.dir_bytes(cache) > 0  # the weight cache entry (the linked kernels are not counted)


TINY_MOE = mm.SHAPES["tiny-moe"]  # qwen3moe: hidden 64, 2 layers, 8 experts of 64, 2 per token


def test_moe_shapes_tensors_and_parameters():
    names = dict(TINY_MOE.tensors())
    assert TINY_MOE.arch == "qwen3moe" and TINY.arch == "llama" and TINY_MOE.head_dim == 32
    assert names["blk.1.ffn_gate_inp.weight"] == (8, 64) and names["blk.1.ffn_gate_exps.weight"] == (8, 64, 64)
    assert names["blk.0.ffn_down_exps.weight"] == (8, 64, 64) and names["blk.0.attn_q.weight"] == (128, 64)
    assert names["blk.0.attn_q_norm.weight"] == (32,) and "blk.0.ffn_gate.weight" not in names
    assert names["output.weight"] == (49168, 64)
    big = mm.SHAPES["moe-4b"]  # Qwen3-30B-A3B at half width and depth: 8 of 128 experts of 384
    experts, attn, embed = 24 * 128 * 3 * 1024 * 384, 24 * (2 * 1024 * 2048 + 2 * 1024 * 512), 2 * 151936 * 1024
    norms = 24 * (2 * 1024 + 2 * 128 + 128 * 1024) + 1024  # two norms, q/k norms and the F32 router per layer
    assert big.num_params() == experts + attn + embed + norms == 4_064_074_752
    assert mm.model_file("moe-4b", "q4_0", "gguf-py").name == "random-qwen3moe-moe-4b-q4_0-ggufpy.gguf"


def test_tiny_moe_gguf_loads_generates_and_counts_routed_bytes(tmp_path, tokenizer, monkeypatch):
    from pagedkv import LLM, SamplingParams

    path = tmp_path / "tiny-moe-q8_0.gguf"
    facts = mm.write_random_gguf(path, TINY_MOE, "q8_0", tokenizer=tokenizer)
    h = read_gguf_header(path)
    types = {t.name: t.ggml_type for t in h.tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == 0 and types["blk.0.ffn_up_exps.weight"] == 8  # router F32, experts Q8_0
    md = h.metadata
    assert (md["general.architecture"], md["qwen3moe.expert_count"], md["qwen3moe.expert_used_count"]) == ("qwen3moe", 8, 2)
    assert md["qwen3moe.expert_feed_forward_length"] == 64 and md["qwen3moe.attention.key_length"] == 32
    # bytes read per token: each expert tensor (8 x 64 x 64 Q8_0 = 8 x 64 x 2 blocks of 34 B) at
    # 2/8, and the untied embedding (49168 x 64 Q8_0) at one row
    wb = mm.weight_bytes_per_token(str(path))
    exps, embd = 2 * 3 * 8 * 64 * 2 * 34, 49168 * 2 * 34
    assert "output.weight" in types and types["token_embd.weight"] == 8
    assert wb["all"] - wb["per_token"] == exps - exps * 2 // 8 + embd - 2 * 34 and wb["all"] <= facts["bytes"]
    cache = tmp_path / "cache"
    cache.mkdir()
    bench_models.seed_kernels(cache)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(cache))
    llm = LLM(model=str(path), max_model_len=128, kv_cache_memory="16MiB")
    cfg = llm.engine.loaded.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 64)
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 5 and all(0 <= t < 49168 for t in out.token_ids)


TINY_MLA = mm.SHAPES["tiny-mla"]  # deepseek2: hidden 64, 4 heads, rank 32, nope/rope/v 32/16/32, 1 dense + 1 MoE layer


@pytest.fixture(scope="module")
def tiny_mla_files(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("mla")
    return {q: (d / f"tiny-mla-{q}.gguf", mm.write_random_gguf(d / f"tiny-mla-{q}.gguf", TINY_MLA, q, tokenizer=tokenizer))
            for q in ("f16", "q8_0")}


def test_mla_shapes_tensors_and_parameters():
    names = dict(TINY_MLA.tensors())
    assert TINY_MLA.arch == "deepseek2" and TINY_MLA.head_dim == 48 and len(names) == 29
    # layer 0 dense, layer 1 routed + shared; the absorbed MLA split (numpy order)
    assert names["blk.0.attn_q.weight"] == (4 * 48, 64) and names["blk.0.attn_kv_a_mqa.weight"] == (32 + 16, 64)
    assert names["blk.0.attn_kv_a_norm.weight"] == (32,) and names["blk.0.attn_k_b.weight"] == (4, 32, 32)
    assert names["blk.0.attn_v_b.weight"] == (4, 32, 32) and names["blk.0.attn_output.weight"] == (64, 4 * 32)
    assert names["blk.0.ffn_gate.weight"] == (128, 64) and "blk.0.ffn_gate_inp.weight" not in names
    assert names["blk.1.ffn_gate_inp.weight"] == (8, 64) and names["blk.1.ffn_up_exps.weight"] == (8, 64, 64)
    assert names["blk.1.ffn_down_exps.weight"] == (8, 64, 64) and names["blk.1.ffn_gate_shexp.weight"] == (64, 64)
    assert names["blk.1.ffn_down_shexp.weight"] == (64, 64) and "blk.1.ffn_gate.weight" not in names
    assert not any(n.endswith(("attn_q_a.weight", "attn_kv_b.weight", "attn_k.weight")) for n in names)
    assert names["output.weight"] == (49168, 64)
    ql = dict(replace(TINY_MLA, q_lora_rank=96).tensors())  # the V2 (not Lite) query: a_proj, norm, b_proj
    assert (ql["blk.0.attn_q_a.weight"], ql["blk.0.attn_q_a_norm.weight"], ql["blk.0.attn_q_b.weight"]) == \
        ((96, 64), (96,), (192, 96)) and "blk.0.attn_q.weight" not in ql
    lite = mm.SHAPES["dsv2-lite"]  # DeepSeek-V2-Lite at 9 of its 27 layers: 1 dense + 8 MoE
    attn = 16 * 192 * 2048 + 576 * 2048 + 2 * 16 * 512 * 128 + 2048 * 2048 + 2 * 2048 + 512
    moe = 64 * 2048 + 3 * 64 * 1408 * 2048 + 3 * 2 * 1408 * 2048
    assert lite.num_params() == 2 * 102400 * 2048 + 9 * attn + 3 * 10944 * 2048 + 8 * moe + 2048 == 5_179_222_528
    assert mm.model_file("dsv2-lite", "q4_k_m", "llama-quantize").name == "random-deepseek2-dsv2-lite-q4_k_m.gguf"


@pytest.mark.parametrize("qtype,ggml_type", [("f16", 1), ("q8_0", 8)])
def test_tiny_mla_gguf_tensors_metadata_and_routed_bytes(tiny_mla_files, qtype, ggml_type):
    path, facts = tiny_mla_files[qtype]
    h = read_gguf_header(path)
    assert [(t.name, t.shape) for t in h.tensors] == TINY_MLA.tensors() and facts["tensors"] == 29
    types = {t.name: t.ggml_type for t in h.tensors}
    f32 = {n for n, t in types.items() if t == 0}  # norms and the router
    assert f32 == {n for n, s in TINY_MLA.tensors() if len(s) == 1 or n.endswith("ffn_gate_inp.weight")} and len(f32) == 8
    assert {t for n, t in types.items() if n not in f32} == {ggml_type}  # attn_k_b / attn_v_b / *_exps too
    md = {k.removeprefix("deepseek2."): v for k, v in h.metadata.items() if k.startswith("deepseek2.")}
    assert h.metadata["general.architecture"] == "deepseek2"
    assert md == {"context_length": 8192, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
                  "attention.head_count": 4, "attention.head_count_kv": 1, "rope.freq_base": 10000.0,
                  "attention.layer_norm_rms_epsilon": pytest.approx(1e-5), "vocab_size": 49168,
                  "rope.dimension_count": 16, "leading_dense_block_count": 1, "attention.q_lora_rank": 0,
                  "attention.kv_lora_rank": 32, "attention.key_length": 32 + 16, "attention.value_length": 32,
                  "attention.key_length_mla": 32 + 16, "attention.value_length_mla": 32,
                  "expert_feed_forward_length": 64, "expert_count": 8, "expert_used_count": 2, "expert_group_count": 1,
                  "expert_group_used_count": 1, "expert_gating_func": 1, "expert_shared_count": 1,
                  "expert_weights_scale": 1.0}
    wb = mm.weight_bytes_per_token(str(path))
    if qtype == "q8_0":
        # 2-D/3-D Q8_0: 34 B per 32 values; F32 4 B. The three 8 x 64 x 64 *_exps (34,816 B each) count
        # 2/8; the untied embedding (49168 x 64: 3,343,424 B) one row (68 B); attn_k_b / attn_v_b
        # (4,352 B each), the shared expert (3 x 4,352 B) and the dense layer's MLP count whole
        assert wb == {"all": 6_901_504, "per_token": 6_901_504 - 3 * (34_816 - 8_704) - (3_343_424 - 68)} \
            and wb["per_token"] == 3_479_812
    else:
        assert wb == {"all": 12_987_904, "per_token": 6_547_072}
    assert wb["all"] <= facts["bytes"]


def test_pagedkv_loads_and_generates_the_tiny_mla_gguf(tiny_mla_files, tmp_path, monkeypatch):
    from pagedkv import LLM
    from pagedkv.bench.common import greedy

    cache = tmp_path / "cache"
    cache.mkdir()
    bench_models.seed_kernels(cache)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(cache))
    llm = LLM(model=str(tiny_mla_files["q8_0"][0]), max_model_len=128, kv_cache_memory=64 << 20)
    cfg = llm.engine.loaded.config
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (32, None, 32, 16, 32)  # q_lora_rank 0 in the file: one attn_q
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.num_shared_experts) == (8, 2, 64, 1)
    assert cfg.moe_layers == [1] and cfg.moe_routing == "softmax" and cfg.intermediate_size == 128
    outs = [llm.generate([[5, 6, 7, 8]], greedy(6), use_tqdm=False)[0].token_ids for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 6 and all(0 <= t < 49168 for t in outs[0])


def test_llama_bench_runs_the_tiny_mla_gguf(tiny_mla_files):
    """llama.cpp loads and runs the file (it needs ``q_lora_rank`` for a lite model of other than
    26/27 layers); skipped without ``make peers``."""
    import subprocess

    tool = mm.find_tool("llama-bench")
    if tool is None:
        pytest.skip("llama-bench not built (make peers)")
    r = subprocess.run([tool, "-m", str(tiny_mla_files["f16"][0]), "-p", "16", "-n", "8", "-t", "2", "-r", "1",
                        "-o", "json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert [(x["n_prompt"], x["n_gen"]) for x in rows] == [(16, 0), (0, 8)] and all(x["avg_ts"] > 0 for x in rows)


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_ensure_models_caches_and_says_what_it_cannot_make(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setattr(mm, "find_tool", lambda name, bin_dir=None: None)
    monkeypatch.setattr(mm, "tokenizer_fields", lambda source=None: tokenizer)
    made = mm.ensure_models(["tiny"], ["q8_0", "q4_k_m"], root=tmp_path, log=lambda m: None)
    q8 = made[("tiny", "q8_0")]
    assert q8["maker"] == "gguf-py" and not q8["cached"] and q8["path"].endswith("random-llama-tiny-q8_0-ggufpy.gguf")
    assert "llama-quantize not built" in made[("tiny", "q4_k_m")]["error"]
    again = mm.ensure_models(["tiny"], ["q8_0"], root=tmp_path, log=lambda m: None)
    assert again[("tiny", "q8_0")]["cached"] and again[("tiny", "q8_0")]["bytes"] == q8["bytes"]
    Path(q8["path"]).write_bytes(b"truncated")  # a damaged file is remade
    assert not mm.ensure_models(["tiny"], ["q8_0"], root=tmp_path, log=lambda m: None)[("tiny", "q8_0")]["cached"]


def test_ensure_models_with_llama_quantize_deletes_the_f16(tmp_path, monkeypatch, tokenizer):
    calls = tmp_path / "calls"
    fake = _script(tmp_path / "llama-quantize", f'echo "$3" >> {calls}; cp "$1" "$2"\n')
    monkeypatch.setattr(mm, "find_tool", lambda name, bin_dir=None: fake if name == "llama-quantize" else None)
    monkeypatch.setattr(mm, "tokenizer_fields", lambda source=None: tokenizer)
    root = tmp_path / "models"
    made = mm.ensure_models(["tiny"], ["q4_k_m", "q8_0", "f16"], root=root, log=lambda m: None)
    assert calls.read_text().split() == ["Q4_K_M", "Q8_0"]  # one f16 file quantised twice; f16 itself never
    assert made[("tiny", "q4_k_m")]["maker"] == "llama-quantize" and made[("tiny", "q4_k_m")]["quantize_seconds"] >= 0
    assert made[("tiny", "f16")]["maker"] == "gguf-py" and made[("tiny", "f16")]["quantize_seconds"] is None
    assert not (root / "random-llama-tiny-f16.gguf").exists()  # the intermediate
    assert sorted(p.name for p in root.glob("*.gguf")) == ["random-llama-tiny-f16-ggufpy.gguf",
                                                           "random-llama-tiny-q4_k_m.gguf", "random-llama-tiny-q8_0.gguf"]


def test_rss_guard_kills_a_process_above_the_limit():
    grow = "import time\nx = bytearray(400 * 1024 * 1024)\nfor i in range(0, len(x), 4096): x[i] = 1\ntime.sleep(30)"
    res = run_guarded([sys.executable, "-c", grow], timeout_s=60, rss_limit_bytes=200e6, poll_s=0.05)
    assert res["status"] == "killed_rss" and res["killed_at_bytes"] > 200e6
    assert res["reason"].startswith("killed at 0.") and res["wall_s"] < 20
    slow = run_guarded([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=1, rss_limit_bytes=1e12)
    assert slow["status"] == "timeout" and slow["wall_s"] < 10
    ok = run_guarded([sys.executable, "-c", "x = bytearray(50 * 1024 * 1024)"], timeout_s=60, rss_limit_bytes=1e12)
    assert ok["status"] == "ok" and ok["ru_maxrss"] > 50 * 1024 * 1024
    bad = run_guarded([sys.executable, "-c", "import sys; sys.exit('boom')"], timeout_s=60, rss_limit_bytes=1e12)
    assert bad["status"] == "failed" and "exit 1" in bad["reason"] and "boom" in bad["reason"]
    marks = iter([False, False, True])
    srv = run_guarded([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=60, rss_limit_bytes=1e12,
                      poll_s=0.05, ready=lambda: next(marks))
    assert srv["status"] == "ready" and srv["ready_s"] is not None and srv["wall_s"] < 10


def test_llama_bench_output_is_parsed(tmp_path):
    rows = [{"build_commit": "abc", "cpu_info": "AMD EPYC", "n_threads": 2, "n_prompt": 512, "n_gen": 0, "avg_ts": 150.5},
            {"build_commit": "abc", "cpu_info": "AMD EPYC", "n_threads": 2, "n_prompt": 0, "n_gen": 64, "avg_ts": 20.25}]
    seen = tmp_path / "tunables"
    fake = _script(tmp_path / "llama-bench", f"echo \"$GLIBC_TUNABLES\" > {seen}\ncat <<'EOF'\n{json.dumps(rows)}\nEOF\n")
    args = argparse.Namespace(threads=2, timeout_s=60, rss_limit_gb=100.0)
    res = bench_models.llama_bench_run(fake, "/m.gguf", args, {"prefill_tokens": 512, "decode_tokens": 64})
    assert res["status"] == "ok" and res["prefill_tokens_per_s"] == 150.5 and res["decode_tokens_per_s"] == 20.25
    assert res["system_info"]["cpu_info"] == "AMD EPYC" and res["command"].endswith("-p 512 -n 64 -r 1 -o json")
    # llama.cpp's buffers on 2 MiB pages, as pagedkv's weights (its best on a THP-madvise host)
    assert seen.read_text().strip() == res["glibc_tunables"] == "glibc.malloc.hugetlb=1"


def test_llama_cpp_env_adds_the_huge_page_tunable_to_the_users(monkeypatch):
    from pagedkv.bench.common import llama_cpp_env

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert llama_cpp_env()["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    env = llama_cpp_env()
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"} == {k: v for k, v in os.environ.items()
                                                                        if k != "GLIBC_TUNABLES"}


def test_spread_median_and_iqr():
    s = spread([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median"] == 3.0 and s["q1"] == 2.0 and s["q3"] == 4.0 and s["iqr"] == 2.0 and s["n"] == 5
    assert spread([5.0])["q1"] == spread([5.0])["q3"] == 5.0
    assert spread([None, None]) is None


def _ours(load, warm, decode, prefill, rss=2e9):
    meas = {"decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill}
    return {"cache_bytes": 3e9, "cold": {"status": "ok", "load_s": load, "ru_maxrss": 5e9},
            "warm": {"status": "ok", "load_s": warm, "ru_maxrss": rss, "child": {"measure": meas, "weights": "int4"}}}


def _fake_data(peer: dict) -> dict:
    ok = {"size": "0.5b", "type": "q4_0", "file": {"bytes": 1e9, "maker": "gguf-py", "make_seconds": 20.0,
                                                   "tensor_types": {"F32": 49, "Q4_0": 169}},
          "systems": {"pagedkv": {"status": "ok", "reason": None,
                                  "runs": [_ours(10, 2, 20, 100), _ours(12, 3, 30, 200), _ours(11, 4, 25, 300)]},
                      "llama.cpp": peer}}
    killed = {"size": "3b", "type": "q8_0", "file": {"bytes": 3.4e9, "maker": "llama-quantize", "make_seconds": 90.0},
              "systems": {"pagedkv": {"status": "killed", "reason": "killed at 14.2 GB (RSS limit 14 GB)", "runs": [
                  {"cache_bytes": 0, "cold": {"status": "killed_rss", "reason": "killed at 14.2 GB (RSS limit 14 GB)"},
                   "warm": {"status": "not measured", "reason": "the cold load ended killed_rss"}}]},
                          "llama.cpp": peer}}
    bw = 10e9
    for e in (ok, killed):
        e["summary"] = summarize_model(e, bw)
    return {"config": {"command": "pagedkv bench models", "rounds": 3, "threads": 2, "weights": "auto",
                       "kv_cache_memory": "1GiB", "max_model_len": 1024, "rss_limit_gb": 14.0},
            "read_bandwidth": {"bytes_per_s": bw, "method": "torch.sum"}, "cpu_model": "AMD EPYC", "method": "m",
            "machine": {"commit": "abc", "dirty": True, "cpu_isa": {"isa": "avx512"}, "cpu_count": 2},
            "llama_cpp": {"tools": {}, "stamp": None, "not_measured": peer["reason"]}, "models": [ok, killed]}


def test_report_medians_iqr_and_not_measured_rows():
    data = _fake_data({"status": "not measured", "reason": bench_models.NOT_BUILT, "runs": []})
    s = data["models"][0]["summary"]
    assert s["pagedkv"]["decode_tokens_per_s"]["median"] == 25.0
    assert s["pagedkv"]["decode_tokens_per_s"]["q1"] == 22.5 and s["pagedkv"]["decode_tokens_per_s"]["q3"] == 27.5
    assert s["weight_read_limit_tokens_per_s"] == 10.0  # 10 GB/s over a 1 GB file
    assert s["pagedkv"]["decode_fraction_of_limit"]["median"] == 2.5
    assert s["decode_tokens_per_s_ratio"] is None
    md = render_markdown(data, {})
    assert "| 0.5b | q4_0 | 1.00 | pagedkv (int4) | 11.0 [10.5-11.5] | 5.00 [5.00-5.00] | 3.0 [2.5-3.5] | 2.00 [2.00-2.00] | 3.00 [3.00-3.00] | " \
           "25.0 [22.5-27.5] | 200.0 [150.0-250.0] | 2.50 [2.25-2.75] |" in md
    assert "| 0.5b | q4_0 | 1.00 | llama.cpp | not measured: llama.cpp tools not built (make peers) |" in md
    assert "| 3b | q8_0 | 3.40 | pagedkv | killed at 14.2 GB (RSS limit 14 GB): in the cold load of round 1 (no later round tried) |" in md
    assert "(dirty)" in md and "avx512" in md


def test_report_ratios_with_llama_cpp():
    run = {"cold": {"status": "ok", "load_s": 1.0, "ru_maxrss": 0.9e9}, "warm": {"status": "ok", "load_s": 0.5},
           "bench": {"status": "ok", "decode_tokens_per_s": 50.0, "prefill_tokens_per_s": 400.0, "ru_maxrss": 1e9}}
    data = _fake_data({"status": "ok", "reason": None, "runs": [run, run]})
    s = data["models"][0]["summary"]
    assert s["decode_tokens_per_s_ratio"] == 0.5 and s["prefill_tokens_per_s_ratio"] == 0.5
    assert s["llama.cpp"]["cache_bytes"]["median"] == 0
    md = render_markdown(data, {})
    assert "| 0.5b | q4_0 | 0.50x | 0.50x |" in md
    assert "| 0.5b | q4_0 | 1.00 | llama.cpp | 1.0 [1.0-1.0] | 0.90 [0.90-0.90] | 0.5 [0.5-0.5] | 1.00 [1.00-1.00] | 0.00 [0.00-0.00] | " \
           "50.0 [50.0-50.0] | 400.0 [400.0-400.0] | 5.00 [5.00-5.00] |" in md


def test_each_round_is_set_against_the_bandwidth_probed_around_it():
    """A shared host's bandwidth moves between levels: each round's decode is divided by the
    limit from the mean of its before/after probes (10 and 30 GB/s: 20 GB/s, a 1 GB file: 20
    tok/s), beside the run-wide limit; runs without probes say so instead of a number."""
    runs = []
    for decode, (before, after) in ((20, (10e9, 30e9)), (30, (30e9, 30e9)), (25, (50e9, None))):
        r = _ours(10, 2, decode, 100)
        r["bandwidth"] = {"before": before, "after": after}
        runs.append(r)
    entry = {"size": "1.7b", "type": "q4_0", "file": {"bytes": 1e9},
             "systems": {"pagedkv": {"status": "ok", "reason": None, "runs": runs},
                         "llama.cpp": {"status": "not measured", "reason": "x", "runs": []}}}
    s = summarize_model(entry, 40e9)["pagedkv"]
    assert [s["round_bandwidth_bytes_per_s"][k] for k in ("q1", "median", "q3")] == [25e9, 30e9, 40e9]
    # per round: 20 / 20, 30 / 30, 25 / 50 tok/s
    assert [s["decode_fraction_of_round_limit"][k] for k in ("q1", "median", "q3")] == [0.75, 1.0, 1.0]
    assert s["decode_fraction_of_limit"]["median"] == 25 / 40  # the run-wide limit: 40 tok/s
    data = _fake_data({"status": "not measured", "reason": "x", "runs": []})
    old = data["models"][0]["summary"]["pagedkv"]
    assert old["round_bandwidth_bytes_per_s"] is None
    assert old["missing"]["decode_fraction_of_round_limit"] == "not probed (a run from before the per-round probes)"
    data["models"] = [entry]
    entry["summary"] = summarize_model(entry, 40e9)
    md = render_markdown(data, {})
    assert "| 0.62 [0.56-0.69] | 30.0 [25.0-40.0] | 1.00 [0.75-1.00] |" in md


def test_a_load_only_run_reports_start_up_only():
    """``--load-only``: cold and warm loads of both systems; no run peak RSS, prefill or decode,
    each saying why, and the table and plot keep the load columns only."""
    skip = bench_models.LOAD_ONLY
    ours = {**_ours(10, 2, None, None, rss=1.5e9), "skipped": skip}
    ours["warm"]["child"] = {"weights": "gguf"}  # no measure in a --load-only warm child
    peer = {"cold": {"status": "ok", "load_s": 4.0, "ru_maxrss": 2e9}, "warm": {"status": "ok", "load_s": 1.0},
            "bench": {"status": "not measured", "reason": skip}, "skipped": skip}
    entry = {"size": "1.7b", "type": "q4_0", "file": {"bytes": 1e9},
             "systems": {"pagedkv": {"status": "ok", "reason": None, "runs": [ours, ours]},
                         "llama.cpp": {"status": "ok", "reason": None, "runs": [peer, peer]}}}
    entry["summary"] = s = summarize_model(entry, 10e9)
    assert s["pagedkv"]["warm_load_s"]["median"] == 2 and s["llama.cpp"]["warm_load_s"]["median"] == 1.0
    assert s["pagedkv"]["peak_rss_bytes"] is None and s["pagedkv"]["missing"]["peak_rss_bytes"] == f"not measured: {skip}"
    assert s["llama.cpp"]["missing"]["decode_tokens_per_s"] == f"not measured: {skip}"
    data = _fake_data({"status": "not measured", "reason": "x", "runs": []})
    data["config"]["load_only"] = True
    data["models"] = [entry]
    md = render_markdown(data, {})
    assert "| model | type | file GB | system | cold load s | cold-load peak RSS GB | warm load s | cache GB |" in md
    assert "| 1.7b | q4_0 | 1.00 | pagedkv (gguf) | 10.0 [10.0-10.0] | 5.00 [5.00-5.00] | 2.0 [2.0-2.0] | 3.00 [3.00-3.00] |" in md
    assert "| 1.7b | q4_0 | 1.00 | llama.cpp | 4.0 [4.0-4.0] | 2.00 [2.00-2.00] | 1.0 [1.0-1.0] | 0.00 [0.00-0.00] |" in md
    assert "decode" not in md.split("| model | type | file GB |")[1].split("\n")[0]


def test_bad_size_is_a_config_error():
    from pagedkv.errors import ConfigError

    with pytest.raises(ConfigError, match="--sizes"):
        bench_models._split("0.5b,13b", mm.SHAPES, "sizes")
    assert os.path.basename(str(mm.model_file("8b", "q4_k_m", "llama-quantize", Path("/r")))) == "random-llama-8b-q4_k_m.gguf"


def test_from_json_re_renders_an_earlier_run(tmp_path):
    data = _fake_data({"status": "not measured", "reason": bench_models.NOT_BUILT, "runs": []})
    for e in data["models"]:
        e["summary"] = None  # re-summarised from the runs
    data["machine"].update({"machine": "x86_64", "torch_threads": 2, "packages": {"torch": "x"}, "time_utc": "t"})
    src = tmp_path / "old.json"  # a result set: --variant names the run to re-render (and where it goes)
    src.write_text(json.dumps({"benchmark": "models", "variants": {"avx2": data, "avx512": {"models": []}}}))
    args = argparse.Namespace(from_json=str(src), variant="avx2", out_dir=str(tmp_path / "out"), json=False,
                              no_plot=True, note="shared machine")
    assert bench_models.run(args) == 0
    ((variant, out),) = read_variants(tmp_path / "out" / "models.json").items()
    assert variant == "avx2"
    assert out["models"][0]["summary"]["pagedkv"]["decode_tokens_per_s"]["median"] == 25.0
    assert "Note: shared machine" in (tmp_path / "out" / "models.md").read_text()
    assert "| 0.5b | q4_0 | 1.00 | llama.cpp | not measured: llama.cpp tools not built (make peers) |" in \
        (tmp_path / "out" / "models.md").read_text()


def test_a_source_change_during_a_run_stops_it(tmp_path):
    """Benchmarks start pagedkv from the checkout: an edit mid-run (a kernel, a module) would make
    later rounds measure other code, so the run checks the sources' digest before each round."""
    from pagedkv.bench.protocol import SourcesChanged, check_sources, source_digest

    pkg = tmp_path / "pagedkv"
    (pkg / "csrc").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "csrc" / "k.c").write_text("int f(void) { return 1; }\n")
    (pkg / "notes.txt").write_text("not a source")
    start = source_digest(pkg)
    assert len(start) == 16
    check_sources(start, "round 1", pkg)  # unchanged: no error
    (pkg / "notes.txt").write_text("edited")  # not a source: no change
    check_sources(start, "round 2", pkg)
    (pkg / "csrc" / "k.c").write_text("int f(void) { return 2; }\n")
    with pytest.raises(SourcesChanged, match="before 1.7b q4_0 round 3"):
        check_sources(start, "1.7b q4_0 round 3", pkg)
    (pkg / "csrc" / "k.c").write_text("int f(void) { return 1; }\n")
    (pkg / "b.py").write_text("")  # a new module
    assert source_digest(pkg) != start
    assert len(source_digest()) == 16  # the real package
