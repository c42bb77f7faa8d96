"""``pagedkv bench attention --tiny`` runs in seconds and writes json/md/png with sane numbers."""

import json

from pagedkv.cli import main


def test_attention_bench_tiny(tmp_path):
    assert main(["bench", "attention", "--tiny", "--out-dir", str(tmp_path), "--threads", "1"]) == 0
    data = json.loads((tmp_path / "attention.json").read_text())
    assert (tmp_path / "attention.md").read_text().startswith("# Attention")
    assert (tmp_path / "attention.png").stat().st_size > 1000
    assert data["bandwidth"]["read_GBps"] > 0
    assert {r["dtype"] for r in data["decode"]} == {"float32", "bfloat16"}
    for r in data["decode"] + data["prefill"]:
        # the paged result equals contiguous SDPA on the same data
        assert r["max_abs_err"] < (1e-4 if r["dtype"] == "float32" else 3e-2)
        assert r["paged_ms"] > 0 and r["contiguous_ms"] > 0
    assert all(0 < r["paged_bw_fraction"] for r in data["decode"])
