"""``pagedkv bench attention --tiny`` runs in seconds and writes json/md/png with sane numbers."""

import argparse

from pagedkv.bench.attention import run as attention
from pagedkv.bench.variants import read_variant


def test_attention_bench_tiny(tmp_path):
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    attention.add_arguments(p)
    args = p.parse_args(["--tiny", "--out-dir", str(tmp_path), "--threads", "1"])
    assert attention.run(args) == 0
    data = read_variant(tmp_path / "attention.json", "paged_vs_contiguous")
    assert "## paged_vs_contiguous\n\n### Attention" in (tmp_path / "attention.md").read_text()
    assert (tmp_path / "attention.png").stat().st_size > 1000
    assert data["bandwidth"]["read_GBps"] > 0
    assert {r["dtype"] for r in data["decode"]} == {"float32", "bfloat16"}
    for r in data["decode"] + data["prefill"]:
        # the paged result equals contiguous SDPA on the same data
        assert r["max_abs_err"] < (1e-4 if r["dtype"] == "float32" else 3e-2)
        assert r["paged_ms"] > 0 and r["contiguous_ms"] > 0
    assert all(0 < r["paged_bw_fraction"] for r in data["decode"])
    # one thread: CPU-time based columns are reported too
    assert all(r["paged_cpu_GBps"] > 0 and r["paged_cpu_bw_fraction"] > 0 for r in data["decode"])


def test_bench_is_registered():
    from pagedkv.bench.cli import BENCHES

    assert BENCHES["attention"] == "pagedkv.bench.attention.run"
