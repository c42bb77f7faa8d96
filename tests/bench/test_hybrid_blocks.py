"""``bench hybrid_blocks`` at a small scale: the planner's block counts equal a live engine run's,
for the hybrid groups and for the same model all-full."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.bench import hybrid_blocks
from pagedkv.bench.variants import read_variant


def test_planner_equals_live_run(tmp_path):
    p = argparse.ArgumentParser()
    hybrid_blocks.add_arguments(p)
    args = p.parse_args(["--context", "256", "--window", "32", "--chunk", "64"])
    args.threads, args.json, args.out_dir = 1, False, str(tmp_path)
    assert hybrid_blocks.run(args) == 0
    data = read_variant(tmp_path / "hybrid_blocks.json", "1in2")
    h, f = data["results"]
    # 256 tokens / 16 = 16 full blocks; the window group keeps positions 224..255: blocks 14, 15
    assert (h["plan_blocks_end"], h["live_blocks_end"], h["live_blocks_per_group"]) == (18, 18, [16, 2])
    assert (f["plan_blocks_end"], f["live_blocks_end"]) == (16, 16)
    assert h["live_block_bytes"] == h["plan_block_bytes"] == f["live_block_bytes"] // 2 == 2 * 16 * 16 * 4 * 2
    # peak with 64-token chunks: planner bound ceil((32 - 1 + 64) / 16) + 1 = 7 window blocks
    assert h["plan_blocks_peak"] == 16 + 7 and f["live_blocks_peak"] == 16
    assert 16 < h["live_blocks_peak"] <= h["plan_blocks_peak"]
    assert data["bytes_ratio_end"] == data["plan_bytes_ratio_end"] == 18 * 2 / (16 * 4)
    assert data["planner_agrees"] and h["window_freed_blocks"] == 14 and h["leaked_blocks"] == 0


def test_gemma3_shaped_equal_size_groups(tmp_path):
    """6 layers, every 6th full (Gemma-3's mix): one full + five 1-layer window groups; a block id
    spans one layer, so 256 tokens hold 16 + 5 x 2 one-layer block ids vs 16 six-layer ones."""
    p = argparse.ArgumentParser()
    hybrid_blocks.add_arguments(p)
    args = p.parse_args(["--context", "256", "--window", "32", "--chunk", "64", "--layers", "6", "--full-every", "6"])
    args.threads, args.json, args.out_dir = 1, False, str(tmp_path)
    assert hybrid_blocks.run(args) == 0
    data = read_variant(tmp_path / "hybrid_blocks.json", "1in6")  # the Gemma-3 mix: its own variant
    assert [g["layers"] for g in data["config"]["groups"]] == [[5], [0], [1], [2], [3], [4]]
    h, f = data["results"]
    assert (h["plan_blocks_end"], h["live_blocks_end"], h["live_blocks_per_group"]) == (26, 26, [16] + [2] * 5)
    assert h["live_block_bytes"] == h["plan_block_bytes"] == f["live_block_bytes"] // 6
    assert data["bytes_ratio_end"] == data["plan_bytes_ratio_end"] == 26 / (16 * 6)
    assert data["planner_agrees"] and h["leaked_blocks"] == 0


def test_full_every_below_two_is_a_usage_error(capsys):
    from pagedkv.cli import main

    for bad in ("0", "1", "x"):
        with pytest.raises(SystemExit) as e:
            main(["bench", "hybrid_blocks", "--full-every", bad])
        assert e.value.code == 2
        assert "--full-every: must be an integer >= 2" in capsys.readouterr().err
