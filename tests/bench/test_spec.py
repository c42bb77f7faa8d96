"""`pagedkv bench spec`: speculative vs plain batch-1 decode, tiny settings, on the real model."""

from __future__ import annotations

import argparse

from pagedkv.bench.spec import run as bench_spec
from pagedkv.bench.variants import read_variant, read_variants


def test_bench_spec_tiny(loaded_model, tmp_path):
    p = argparse.ArgumentParser()
    bench_spec.add_arguments(p)
    p.add_argument("--threads", type=int)  # the common options `pagedkv bench` adds to every command
    p.add_argument("--out-dir")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(["--max-tokens", "12", "--rounds", "1", "--threads", "1", "--no-llama-cpp",
                         "--out-dir", str(tmp_path)])
    assert bench_spec.run(args, loaded_model) == 0
    data = read_variant(tmp_path / "spec.json", "ngram")
    assert [r["workload"] for r in data["rows"]] == ["repetitive", "free chat"]
    for r in data["rows"]:
        assert r["plain_tok_s"] > 0 and r["ngram_tok_s"] > 0
        assert abs(r["speedup"] - r["ngram_tok_s"] / r["plain_tok_s"]) < 0.01
    assert data["goals"]["repetitive >= 2x"] == (data["rows"][0]["speedup"] >= 2.0)
    assert 0 <= data["acceptance_rate"] <= 1 and data["mean_accepted_length"] >= 1.0
    assert data["config"]["weights"] == "fp32" and "Speculative decoding" in (tmp_path / "spec.md").read_text()


def test_bench_spec_draft_model_rows(loaded_model, tmp_path):
    """The documented configuration: an fp32 target drafted by the same model's int4 weights."""
    p = argparse.ArgumentParser()
    bench_spec.add_arguments(p)
    p.add_argument("--threads", type=int)
    p.add_argument("--out-dir")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(["--max-tokens", "12", "--rounds", "1", "--threads", "1", "--no-llama-cpp",
                         "--speculative", "draft:smollm2-135m", "--draft-weights", "int4", "--out-dir", str(tmp_path)])
    assert bench_spec.run(args, loaded_model) == 0
    data = read_variant(tmp_path / "spec.json", "fp32_draft_int4")  # its own variant
    for r in data["rows"]:
        assert r["draft_tok_s"] > 0 and abs(r["draft_speedup"] - r["draft_tok_s"] / r["plain_tok_s"]) < 0.01
    assert (data["config"]["speculative"], data["config"]["draft_weights"]) == ("draft:smollm2-135m", "int4")
    # int4 drafts of the fp32 model's own weights: most agree with the target's argmax
    assert 0.5 < data["draft_acceptance_rate"] <= 1 and data["draft_mean_accepted_length"] > 1.5
    md = (tmp_path / "spec.md").read_text()
    assert (tmp_path / "spec.png").stat().st_size > 1000 and "(spec.png)" in md and "## fp32_draft_int4" in md
    assert list(read_variants(tmp_path / "spec.json")) == ["fp32_draft_int4"]  # not the n-gram variant
    assert "draft_speedup" in md and "Draft model `smollm2-135m` (int4 weights)" in md
