"""`pagedkv bench structured`: the mask cost beside the decode step, on the real model."""

from __future__ import annotations

import argparse
import json

from pagedkv.bench import structured as bench_structured


def test_bench_structured_tiny(loaded_model, tmp_path):
    p = argparse.ArgumentParser()
    bench_structured.add_arguments(p)
    p.add_argument("--threads", type=int)  # the common options `pagedkv bench` adds to every command
    p.add_argument("--out-dir")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(["--batch", "2", "--steps", "2", "--threads", "1", "--weights", "fp32",
                         "--out-dir", str(tmp_path)])
    assert bench_structured.run(args, loaded_model) == 0
    data = json.loads((tmp_path / "structured.json").read_text())
    assert data["config"]["batch"] == 2 and data["config"]["weights"] == "fp32" and data["config"]["vocab"] == 49152
    ours = data["engines"][0]
    assert ours["engine"].startswith("llguidance") and min(ours["fill_ms"], ours["mask_ms"]) > 0 <= ours["apply_ms"]
    assert abs(ours["share_of_decode_step"] - ours["mask_ms"] / data["decode_step_ms"]) < 0.01
    assert data["goal_met"] == (ours["mask_ms"] <= 0.10 * data["decode_step_ms"])
    assert "llguidance" in (tmp_path / "structured.md").read_text()
