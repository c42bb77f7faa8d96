"""``pagedkv bench serve``: the latency arithmetic on hand-made timings, and a tiny end-to-end run."""

from __future__ import annotations

import json
import math

import pytest

from pagedkv.bench.serve import run as serve
from pagedkv.bench.workload import (
    LengthScaling,
    RequestRecord,
    RunStats,
    meets_target,
    percentile,
    poisson_arrivals,
    summarize,
    summarize_run,
    synth_prompts,
    tpot,
    ttft,
)


def test_percentile_matches_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0, 5.0]  # sorted: 1 2 3 4 5
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 100) == 5.0
    assert percentile(xs, 90) == pytest.approx(4.6)  # pos 3.6 -> 4 + 0.6 * (5 - 4)
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([7.0], 90) == 7.0
    assert math.isnan(percentile([], 50))
    s = summarize([10.0, 20.0])
    assert s["p50"] == 15.0 and s["p90"] == pytest.approx(19.0) and s["mean"] == 15.0 and s["max"] == 20.0


def test_ttft_tpot_and_run_summary_exact():
    assert ttft(100.0, 100.5) == 0.5
    assert tpot(10.0, 12.0, 5) == 0.5  # 2 s over the 4 tokens after the first
    assert tpot(10.0, 10.0, 1) is None
    R = RequestRecord
    recs = [
        R(arrival_time=0.0, first_token_time=1.0, finish_time=3.0, output_tokens=5, status="ok"),   # ttft 1, tpot .5
        R(arrival_time=1.0, first_token_time=1.5, finish_time=2.5, output_tokens=3, status="ok"),   # ttft .5, tpot .5
        R(arrival_time=2.0, first_token_time=4.0, finish_time=4.0, output_tokens=1, status="ok"),   # ttft 2, no tpot
        R(arrival_time=3.0, status="rejected"),
    ]
    st = RunStats(preemptions=2, running_samples=[1, 3], peak_running=3)
    s = summarize_run(recs, st)
    assert (s["requests"], s["completed"], s["rejected"], s["unfinished"]) == (4, 3, 1, 0)
    assert s["duration_s"] == 4.0  # first arrival 0 -> last finish 4
    assert s["requests_per_s"] == 0.75
    assert s["output_tokens"] == 9 and s["output_tokens_per_s"] == 2.25
    assert s["ttft_s"]["p50"] == 1.0 and s["ttft_s"]["p90"] == pytest.approx(1.8)  # [0.5, 1, 2]
    assert s["tpot_s"]["p50"] == 0.5 and s["tpot_s"]["p99"] == 0.5
    assert s["e2e_latency_s"]["max"] == 3.0
    assert s["mean_running"] == 2.0 and s["preemptions"] == 2
    # one rejection fails the target whatever the latencies
    assert not meets_target(s, 10.0, 10.0)
    s2 = summarize_run(recs[:3], st)
    assert meets_target(s2, 2.0, 0.5)
    assert not meets_target(s2, 1.5, 0.5)   # p90 TTFT 1.8 > 1.5
    assert not meets_target(s2, 2.0, 0.4)   # p90 TPOT 0.5 > 0.4


def test_workload_helpers():
    sc = LengthScaling(prompt_divisor=8, output_divisor=4, min_prompt=4, max_prompt=100, min_output=2, max_output=10)
    assert sc.prompt(1000) == 100 and sc.prompt(80) == 10 and sc.prompt(2) == 4
    assert sc.output(20) == 5 and sc.output(1000) == 10 and sc.output(1) == 2
    ps = synth_prompts([5, 20, 1], vocab_size=1000, seed=1, shared_prefix_len=8)
    assert [len(p) for p in ps] == [5, 20, 1]
    assert ps[0][:4] == ps[1][:4] and ps[1][:8] != ps[0] and all(256 <= t < 1000 for p in ps for t in p)
    a = poisson_arrivals(1000, 4.0, seed=0)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert 200 < a[-1] < 300  # 1000 arrivals at 4/s ~ 250 s


def _strict_json(text: str):
    """The JSON, failing the test on NaN or Infinity (result files must hold finite numbers)."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the results"))


@pytest.mark.slow
def test_bench_serve_tiny(loaded_model, tmp_path):
    from pagedkv.cli import build_parser

    args = build_parser().parse_args([
        "bench", "serve", "--tiny", "--out-dir", str(tmp_path), "--rate", "50", "--rates", "50",
        "--num-requests", "3", "--http", "--http-server", "thread",
    ])
    assert serve.run(args, loaded=loaded_model) == 0
    data = _strict_json((tmp_path / "serving.json").read_text())["variants"]["paging"]
    for key in ("benchmark", "config", "workload", "cells", "sweep", "sustainable_rate", "http", "machine"):
        assert key in data and data[key] not in (None, [], {}), key
    assert [c["cell"] for c in data["cells"]] == [c["name"] for c in serve.CELLS]
    for row in data["cells"] + data["http"]:
        assert "error" not in row, row.get("error")
        assert row["completed"] == 3 and row["rejected"] == 0
        for k in ("requests_per_s", "output_tokens_per_s", "preemptions"):
            assert math.isfinite(row[k]) and row[k] >= 0
        for k in ("ttft_s", "tpot_s"):
            assert all(math.isfinite(row[k][q]) and row[k][q] >= 0 for q in ("p50", "p90", "p99"))
    assert set(data["sweep"]) == {"paging on", "paging off"}
    assert data["config"]["kv_budget_tokens"] == data["config"]["num_blocks"] * data["config"]["block_size"]
    # prefix caching found the shared system prompt (a full block of it)
    assert data["cells"][2]["cached_prompt_tokens"] > 0
    assert "## paging\n\n### Serving" in (tmp_path / "serving.md").read_text()
    assert (tmp_path / "serving.png").stat().st_size > 1000


def test_sweep_weights_and_compiled_steps_reach_both_engines():
    """--weights / --compile-decode reach the in-process engines and the `pagedkv serve` flags."""
    from pagedkv.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--weights", "int4", "--compile-decode"])
    assert (args.weights, args.compile_decode) == ("int4", True)
    flags = serve.serve_flags(serve.CELLS[1], args)
    assert flags[flags.index("--weights") + 1] == "int4" and "--compile-decode" in flags
    assert "--disable-paging" in flags
    plain = serve.serve_flags(serve.CELLS[0], build_parser().parse_args(["bench", "serve"]))
    assert "--weights" not in plain and "--compile-decode" not in plain and "--disable-paging" not in plain


def test_sweep_model_reaches_the_server_flags_and_a_sliding_window_model_is_refused(gemma3_gguf, tmp_path, capsys):
    """--model reaches `pagedkv serve`'s flags; a model with sliding-window layers (Gemma-3)
    is refused before anything runs: the sweep's paging-off cells cannot hold it."""
    from pagedkv.cli import build_parser, main

    args = build_parser().parse_args(["bench", "serve", "--model", "gemma-3-270m"])
    flags = serve.serve_flags(serve.CELLS[0], args)
    assert flags[flags.index("--model") + 1] == "gemma-3-270m"
    assert "--model" not in serve.serve_flags(serve.CELLS[0], build_parser().parse_args(["bench", "serve"]))
    assert main(["bench", "serve", "--tiny", "--model", "gemma-3-270m", "--out-dir", str(tmp_path)]) == 2
    assert "has sliding-window layers" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
