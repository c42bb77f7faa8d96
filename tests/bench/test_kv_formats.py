"""The KV-format benchmarks at test size: ``bench attention --kv-cache-dtypes``,
``bench kv_quality`` and ``bench kv_serving`` (``--tiny``) write json/md with real values."""

import argparse
import json

from pagedkv.bench import kv_quality, kv_serving
from pagedkv.bench.attention import run as attention
from pagedkv.bench.variants import read_variant


def _args(module, argv):
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    module.add_arguments(p)
    return p.parse_args(argv)


def test_attention_by_kv_format(tmp_path):
    args = _args(attention, ["--tiny", "--out-dir", str(tmp_path), "--threads", "1", "--dtypes", "float32",
                             "--kv-cache-dtypes", "int8,fp8_e4m3", "--no-plot", "--no-naive"])
    assert attention.run(args) == 0
    rows = read_variant(tmp_path / "attention.json", "kv_formats")["decode_by_kv_format"]
    assert [(r["kv_cache_dtype"], r["context"]) for r in rows] == [
        (n, c) for c in (64, 256) for n in ("float32", "int8", "fp8_e4m3")]
    for r in rows:
        # bytes read per call: codes + one bf16 scale per 64-element head vector (66/256 of float32)
        assert r["bytes_vs_float32"] == (1.0 if r["kv_cache_dtype"] == "float32" else 66 / 256)
        assert r["kv_bytes"] == 2 * 2 * r["context"] * 3 * (256 if r["kv_cache_dtype"] == "float32" else 66)
        assert r["ms"] > 0 and r["max_abs_diff_vs_float32"] < (1e-6 if r["kv_cache_dtype"] == "float32" else 0.2)
    assert "## kv_formats" in (tmp_path / "attention.md").read_text()
    assert "Decode by KV cache format" in (tmp_path / "attention.md").read_text()


def test_kv_quality_tiny(tmp_path, loaded_model):
    args = _args(kv_quality, ["--tiny", "--out-dir", str(tmp_path), "--kv-cache-dtypes", "int8"])
    data = kv_quality.run_quality(args, loaded_model)
    rows = {r["kv_cache_dtype"]: r for r in data["results"]}
    assert list(rows) == ["float32", "int8"] and data["config"]["text_tokens"] == 200
    assert rows["float32"]["perplexity_vs_float32"] == 0 and rows["float32"]["identical"] == 2
    assert 1 < rows["int8"]["perplexity"] < 1000 and abs(rows["int8"]["perplexity_vs_float32"]) < 0.1
    assert rows["int8"]["bound"] == 0.01 and "within_bound" in rows["int8"]
    assert kv_quality.agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == {
        "identical": 0, "prompts": 1, "mean_prefix_fraction": 0.5, "position_agreement": 0.75}


def test_kv_serving_tiny(tmp_path, loaded_model):
    args = _args(kv_serving, ["--tiny", "--out-dir", str(tmp_path), "--threads", "1", "--no-plot", "--rates", "20,40"])
    assert kv_serving.run(args, loaded_model) == 0
    data = read_variant(tmp_path / "serving.json", "kv_formats")
    blocks = {s["kv_cache_dtype"]: s["num_blocks"] for s in data["summary"]}
    # one byte budget (16 float32 blocks): bf16 twice the blocks, int8 (codes + scales) 3.9x
    assert blocks == {"float32": 16, "bfloat16": 32, "int8": 16 * 46_080 // 11_880}
    assert all(r["completed"] == r["requests"] == 4 for r in data["sweep"] if "skipped" not in r)
    assert "## kv_formats\n\n### KV cache formats under serving load" in (tmp_path / "serving.md").read_text()


def test_capacity_takes_the_engine_kv_names(tmp_path, capsys):
    from pagedkv.cli import main

    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,17,1\n0,33,1\n")
    argv = ["bench", "capacity", "--json", "--threads", "1", "--workload", str(csv), "--model", "qwen2.5-7b",
            "--max-model-len", "64", "--block-sizes", "16", "--kv-budget", "1GiB", "--out-dir", str(tmp_path / "o")]
    assert main([*argv, "--kv-cache-dtype", "int8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["dtype"] == "int8"
    saved = read_variant(tmp_path / "o" / "capacity.json", "paged_vs_contiguous")
    spec = saved["models"][0]["spec"]
    assert spec["bytes_per_token"] == 2 * 28 * 4 * (128 + 2)  # codes + a bf16 scale per head vector
    assert spec["quant_group_size"] == 128
    assert main([*argv, "--kv-cache-dtype", "int3"]) == 2
    assert "valid: auto, float32" in capsys.readouterr().err
