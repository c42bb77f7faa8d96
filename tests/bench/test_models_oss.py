"""`pagedkv bench models`' gpt-oss shapes (:mod:`pagedkv.bench.models.gpt_oss`): llama.cpp's
``gpt-oss`` tensors, keys and MXFP4_MOE types, written without a quantiser pass for the experts."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from pagedkv.bench.models import gpt_oss
from pagedkv.bench.models import make as mm
from pagedkv.gguf_header import read_gguf_header

TINY_OSS = mm.SHAPES["tiny-oss"]  # hidden 64, 2 layers, 4 heads of 16, 2 KV heads, 8 experts of 64, 2 per token


@pytest.fixture(scope="module")
def tiny_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("oss") / "tiny-oss-mxfp4.gguf"
    return path, mm.write_random_gguf(path, TINY_OSS, "mxfp4", tokenizer=mm.tokenizer_fields())


def test_oss_shapes_tensors_and_parameters():
    names = dict(TINY_OSS.tensors())
    assert TINY_OSS.arch == "gpt-oss" and TINY_OSS.head_dim == 16 and len(names) == 2 * 19 + 3
    assert (names["blk.0.attn_q.weight"], names["blk.0.attn_q.bias"], names["blk.0.attn_k.weight"]) == \
        ((64, 64), (64,), (32, 64))
    assert (names["blk.1.attn_output.weight"], names["blk.1.attn_output.bias"], names["blk.1.attn_sinks.weight"]) == \
        ((64, 64), (64,), (4,))
    assert (names["blk.1.ffn_gate_inp.weight"], names["blk.1.ffn_gate_inp.bias"]) == ((8, 64), (8,))
    assert (names["blk.0.ffn_gate_exps.weight"], names["blk.0.ffn_gate_exps.bias"]) == ((8, 64, 64), (8, 64))
    assert (names["blk.0.ffn_down_exps.weight"], names["blk.0.ffn_down_exps.bias"]) == ((8, 64, 64), (8, 64))
    assert "blk.0.post_attention_norm.weight" in names and "blk.0.ffn_norm.weight" not in names
    assert not any("ffn_gate.weight" in n or "ffn_up.weight" in n for n in names)  # every layer routed
    oss = mm.SHAPES["oss-20b"]  # gpt-oss-20b at 12 of its 24 layers
    attn = 2 * 4096 * 2880 + 2 * 512 * 2880 + 4096 + 2 * 512 + 2880 + 64 + 2 * 2880
    moe = 32 * 2880 + 32 + 3 * 32 * 2880 * 2880 + 3 * 32 * 2880
    assert oss.num_params() == 2 * 201088 * 2880 + 12 * (attn + moe) + 2880 == 11_036_513_472
    assert mm.model_file("oss-20b", "mxfp4", "gguf-py").name == "random-gpt-oss-oss-20b-mxfp4-ggufpy.gguf"


def test_tiny_oss_gguf_types_metadata_and_routed_bytes(tiny_oss):
    path, facts = tiny_oss
    h = read_gguf_header(path)
    assert [(t.name, t.shape) for t in h.tensors] == TINY_OSS.tensors() and facts["tensors"] == 41
    types = {t.name: t.ggml_type for t in h.tensors}
    assert {n for n, t in types.items() if t == 39} == {f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 1)
                                                       for p in ("gate", "up", "down")}
    assert {n for n, t in types.items() if t == 8} == {"token_embd.weight", "output.weight"} | {
        f"blk.{i}.attn_{p}.weight" for i in (0, 1) for p in ("q", "k", "v", "output")}
    assert sum(t == 0 for t in types.values()) == 25  # norms, biases, sinks and the routers: F32
    md = {k.removeprefix("gpt-oss."): v for k, v in h.metadata.items() if k.startswith("gpt-oss.")}
    assert h.metadata["general.architecture"] == "gpt-oss" and h.metadata["general.file_type"] == 38
    assert md == {"context_length": 8192, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
                  "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 10000.0,
                  "attention.layer_norm_rms_epsilon": pytest.approx(1e-5), "vocab_size": 49168,
                  "rope.dimension_count": 16, "attention.key_length": 16, "attention.value_length": 16,
                  "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 64,
                  "attention.sliding_window": 8, "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
                  "rope.scaling.original_context_length": 4096, "rope.scaling.yarn_beta_fast": 32.0,
                  "rope.scaling.yarn_beta_slow": 1.0}
    # MXFP4 17 B per 32 values: each 8 x 64 x 64 *_exps 17,408 B, counted 2/8 per token; Q8_0 34 B
    # per 32 (the untied embedding 49168 x 64 = 3,343,424 B, one row of 68 B per token); F32 4 B
    wb = mm.weight_bytes_per_token(str(path))
    assert wb == {"all": 6_836_704, "per_token": 6_836_704 - 6 * (17_408 - 4_352) - (3_343_424 - 68)}
    assert wb["per_token"] == 3_415_012 and wb["all"] <= facts["bytes"]


def test_random_mxfp4_blocks_have_the_shapes_scale_and_spread():
    """Scale byte 120 on every block and uniform codes: gguf's own dequantiser reads values of
    the table times 2^-8 (std ~0.022, as the other tensors' 0.02)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = gpt_oss.random_mxfp4(64, 2880, np.random.default_rng(0))
    assert blocks.shape == (64, 90 * 17) and blocks.dtype == np.uint8
    assert (blocks.reshape(64, 90, 17)[:, :, 0] == 120).all()
    w = dequantize(blocks, GGMLQuantizationType.MXFP4)
    assert w.shape == (64, 2880)
    assert set(np.unique(np.abs(w) * 256)) == {0, 1, 2, 3, 4, 6, 8, 12}
    assert 0.019 < float(w.std()) < 0.025
    with pytest.raises(ValueError, match="multiple of MXFP4's block"):
        gpt_oss.random_mxfp4(2, 48, np.random.default_rng(0))


def test_types_that_do_not_fit_the_shape_are_refused(tmp_path):
    with pytest.raises(ValueError, match="mxfp4 only"):
        mm.write_random_gguf(tmp_path / "x.gguf", TINY_OSS, "q4_0", tokenizer=mm.tokenizer_fields())
    with pytest.raises(ValueError, match="mxfp4 is gpt-oss only"):
        mm.write_random_gguf(tmp_path / "y.gguf", mm.SHAPES["tiny"], "mxfp4", tokenizer=mm.tokenizer_fields())
    assert not list(tmp_path.iterdir())


def test_llama_bench_runs_the_tiny_oss_gguf(tiny_oss):
    """llama.cpp loads and runs the file as a gpt-oss MXFP4 MoE; skipped without ``make peers``."""
    tool = mm.find_tool("llama-bench")
    if tool is None:
        pytest.skip("llama-bench not built (make peers)")
    r = subprocess.run([tool, "-m", str(tiny_oss[0]), "-p", "16", "-n", "8", "-t", "2", "-r", "1", "-o", "json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert [(x["n_prompt"], x["n_gen"]) for x in rows] == [(16, 0), (0, 8)] and all(x["avg_ts"] > 0 for x in rows)
    assert rows[0]["model_type"].startswith("gpt-oss") and "MXFP4" in rows[0]["model_type"]


def test_pagedkv_loads_and_generates_the_tiny_oss_gguf(tiny_oss, tmp_path, monkeypatch):
    """The bench file loads as gpt-oss with its MXFP4 experts as stored (fmt 139, the file's
    bytes plus each row's float32 bias) and generates the same tokens twice."""
    from pagedkv import LLM
    from pagedkv.bench.common import greedy
    from pagedkv.bench.models import run as bench_models

    cache = tmp_path / "cache"
    cache.mkdir()
    bench_models.seed_kernels(cache)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(cache))
    llm = LLM(model=str(tiny_oss[0]), max_model_len=128, kv_cache_memory=64 << 20)
    cfg = llm.engine.loaded.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_routing) == \
        (8, 2, 64, "topk_softmax")
    assert cfg.attention_sinks and cfg.moe_bias and cfg.sliding_window == 8
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    down = llm.engine.loaded.model.layers[1].mlp.experts[7].down_proj
    assert down.types == ("MXFP4",) and down.packed.fmt == 139 and down.packed.nbytes == 64 * (64 // 32 * 17 + 4)
    outs = [llm.generate([[5, 6, 7, 8]], greedy(6), use_tqdm=False)[0].token_ids for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 6 and all(0 <= t < 49168 for t in outs[0])
