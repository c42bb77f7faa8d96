"""`pagedkv bench offload` on the real model, test-sized: every cell gives the same outputs,
tiers recompute less of the history, the restart part serves the prefix from disk."""

from __future__ import annotations

import argparse
import json

from pagedkv.bench.offload import run as bench_offload


def test_bench_offload_small(loaded_model, tmp_path):
    args = argparse.Namespace(
        conversations=3, turns=2, first_user_tokens=20, user_tokens=20, answer_tokens=2, block_size=4, pool_fraction=0.125,
        host_fraction=0.25, prefix_len=24, trials=1, seed=0, cells="none,host+disk", model=None, tiny=False,
        note=None, no_plot=True, threads=2, json=False, out_dir=str(tmp_path))
    assert bench_offload.run(args, loaded=loaded_model) == 0
    data = json.loads((tmp_path / "offload.json").read_text())
    conv = data["conversations"]
    assert conv["same_outputs"] and list(conv["cells"]) == ["none", "host+disk"]
    # turn 2 resends 22 history tokens per chat; a 13-block pool loses some meanwhile
    none, tiered = conv["cells"]["none"], conv["cells"]["host+disk"]
    assert none["history_tokens"] == tiered["history_tokens"] == 66
    assert tiered["prefix_tokens_recomputed"] == 3 * (22 - 20)  # only each history's partial block
    assert none["prefix_tokens_recomputed"] > tiered["prefix_tokens_recomputed"]
    assert tiered["pool_hit_tokens"] + sum(t["hit_tokens"] for t in tiered["tiers"].values()) == 60
    assert sum(t["hit_tokens"] for t in tiered["tiers"].values()) > 0
    rs = data["restart"]
    assert rs["same_outputs"] and rs["cached_tokens_by_tier"] == [{"disk": 24}]
    assert "TTFT after a restart" in (tmp_path / "offload.md").read_text()
