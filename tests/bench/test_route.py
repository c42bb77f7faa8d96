"""``pagedkv bench route`` without Ray: the workload, the pooled numbers and the report."""

from __future__ import annotations

import argparse

from pagedkv.bench.route.run import LoadSampler, _pool, conversation_requests
from pagedkv.bench.route.report import render_markdown


def _args(**kw) -> argparse.Namespace:
    base = dict(users=3, turns=2, system_tokens=8, question_tokens=2, answer_tokens=1, seed=0)
    return argparse.Namespace(**{**base, **kw})


def test_conversations_share_each_users_system_prompt_turn_by_turn():
    reqs, keys = conversation_requests(_args(), vocab=5000)
    assert len(reqs) == 6 and sorted(keys) == [(u, t) for u in range(3) for t in range(2)]
    assert [t for _, t in keys] == [0, 0, 0, 1, 1, 1]  # turn by turn
    by = dict(zip(keys, reqs))
    for u in range(3):
        assert by[(u, 0)].prompt_token_ids[:8] == by[(u, 1)].prompt_token_ids[:8]
        assert by[(u, 0)].prompt_token_ids[8:] != by[(u, 1)].prompt_token_ids[8:]
        assert by[(u, 0)].prompt_len == 10 and by[(u, 0)].output_len == 1
    assert by[(0, 0)].prompt_token_ids[:8] != by[(1, 0)].prompt_token_ids[:8]
    again, _ = conversation_requests(_args(), vocab=5000)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]


def test_pooled_rounds_and_the_load_ratio():
    runs = [{"completed": 4, "requests": 4, "prompt_tokens": 100, "cached_tokens": 60, "hit_rate": 0.6,
             "ttft_s": [0.1, 0.3], "routed": [2, 2], "wall_s": 1.0},
            {"completed": 4, "requests": 4, "prompt_tokens": 100, "cached_tokens": 20, "hit_rate": 0.2,
             "ttft_s": [0.2, 0.4], "routed": [3, 1], "wall_s": 2.0}]
    p = _pool(runs)
    assert (p["hit_rate"], p["completed"], p["wall_s"]) == (0.4, 8, 3.0)
    assert abs(p["ttft_s"]["p50"] - 0.25) < 1e-12 and p["ttft_p50_per_round"] == [0.2, 0.30000000000000004]
    sampler = LoadSampler.__new__(LoadSampler)  # the arithmetic only: no thread, no replicas
    sampler.svc = argparse.Namespace(handles=[0, 0])
    sampler._stop, sampler._thread = argparse.Namespace(set=lambda: None), argparse.Namespace(join=lambda: None)
    sampler.samples = [[0, 0], [3, 1], [5, 3]]  # idle samples are left out
    out = sampler.stop()
    assert out["mean_per_replica"] == [4.0, 2.0] and out["max_over_mean"] == 4.0 / 3.0 and out["samples"] == 2


def test_report_states_ratios_and_goals():
    pol = {"completed": 8, "requests": 8, "hit_rate": 0.5, "hit_rate_per_round": [0.5],
           "ttft_s": {"p50": 0.2, "mean": 0.25, "p90": 0.4}, "routed_per_replica": [[4, 4]]}
    data = {"tiny": False, "model": "m", "replicas": 2, "weights": "fp32", "replica_threads": 1,
            "num_blocks_per_replica": 99, "block_size": 16,
            "conversations": {"requests": 8, "users": 2, "turns": 4, "system_tokens": 32, "question_tokens": 4,
                              "answer_tokens": 2, "concurrency": 1, "pool_fraction": 0.55,
                              "system_prompt_blocks": 4, "order": ["round-robin", "prefix-aware"]},
            "policies": {"round-robin": pol, "prefix-aware": {**pol, "hit_rate": 1.0}},
            "hit_rate_ratio": 2.0, "ttft_p50_ratio": 0.5, "same_outputs": True, "requests_with_differing_outputs": 0,
            "goals": {"hit_rate_ratio >= 2": True},
            "uniform": {"requests": 4, "prompt_tokens": 8, "answer_tokens": 2, "concurrency": 2,
                        "routed_per_replica": [2, 2], "load": {"mean_per_replica": [1.0, 1.2], "max_over_mean": 1.09,
                                                               "samples": 5}}}
    md = render_markdown(data, {})
    assert "hit rate 2.00x (goal >= 2)" in md and "TTFT p50 0.50x (goal <= 0.6)" in md
    assert "busiest / mean = 1.09" in md and "hit_rate_ratio >= 2: met" in md
