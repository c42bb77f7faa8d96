"""``pagedkv bench peers``: its arithmetic on hand-made timings and a tiny end-to-end run."""

from __future__ import annotations

import json
import math

import pytest

from pagedkv.bench import peers, peers_systems
from pagedkv.bench.workload import BenchRequest


def test_result_row_arithmetic_exact():
    reqs = [BenchRequest([1, 2, 3], 3), BenchRequest([4, 5], 5)]
    # request 0: first token at 1 s, its 3rd (last) at 2 s; request 1: first at 1 s, 5th at 3 s.
    # request 1 produced 6 tokens (a static batch runs past it): only 5 count.
    row = peers_systems.result_row("x", reqs, elapsed=4.0, cpu_s=2.0, first=[1.0, 1.0], finish=[2.0, 3.0], n_out=[3, 6])
    assert row["output_tokens"] == 8 and row["output_tokens_per_s"] == 2.0
    assert row["output_tokens_per_cpu_s"] == 4.0
    assert row["requests_per_s"] == 0.5 and row["completed"] == 2
    assert row["ttft_s"]["p50"] == 1.0
    assert row["tpot_s"]["p50"] == pytest.approx(0.5)  # both (2-1)/2 and (3-1)/4
    agree = peers.agreement([[1, 2, 3], [1, 2]], [[1, 2, 3], [1, 9]])
    assert agree["identical_requests"] == 1 and agree["mean_common_prefix_fraction"] == pytest.approx(0.75)


@pytest.mark.slow
def test_bench_peers_tiny(loaded_model, hf_model, tmp_path):
    from pagedkv.cli import build_parser

    args = build_parser().parse_args(["bench", "peers", "--tiny", "--out-dir", str(tmp_path)])
    attn = hf_model.config._attn_implementation
    assert peers.run(args, loaded=loaded_model, hf_model=hf_model) == 0
    assert hf_model.config._attn_implementation == attn  # the shared fixture is left as it was
    data = json.loads((tmp_path / "peers.json").read_text())
    for key in ("benchmark", "config", "workload", "systems", "ratios", "goal", "machine"):
        assert key in data and data[key] not in (None, [], {}), key
    by = {r["name"]: r for r in data["systems"]}
    assert set(by) == {peers.PAGEDKV, peers.HF_GENERATE.format(bs=2), peers.HF_CB, peers.LLAMA_CPP,
                       peers.PAGEDKV_REPEAT}
    for name in (peers.PAGEDKV, peers.PAGEDKV_REPEAT, peers.HF_GENERATE.format(bs=2)):
        r = by[name]
        assert r["status"] == "ok", r
        assert r["completed"] == 4 and r["output_tokens"] == data["workload"]["output_tokens"]
        for k in ("output_tokens_per_s", "requests_per_s", "elapsed_s"):
            assert math.isfinite(r[k]) and r[k] > 0
        for k in ("ttft_s", "tpot_s"):
            assert all(math.isfinite(r[k][q]) and r[k][q] >= 0 for q in ("p50", "p90", "p99"))
    for name in (peers.HF_CB, peers.LLAMA_CPP):  # may fail or be absent, but never silently
        r = by[name]
        assert r["status"] in ("ok", "failed", "not installed")
        assert r["status"] == "ok" or r["reason"]
    for ratio in data["ratios"]:
        assert all(math.isfinite(ratio[k]) and ratio[k] > 0 for k in ("output_tok_s_ratio", "ttft_p50_ratio"))
    assert data["goal"]["ratio"] is not None and math.isfinite(data["goal"]["ratio"])
    # greedy fp32: pagedkv and transformers agree token for token on these tiny requests
    agree = data["greedy_agreement_with_pagedkv"][peers.HF_GENERATE.format(bs=2)]
    assert agree["requests"] == 4 and agree["identical_requests"] >= 3  # padding may flip a rare near-tie
    assert (tmp_path / "peers.md").read_text().startswith("# Peers")
    assert (tmp_path / "peers.png").stat().st_size > 1000
