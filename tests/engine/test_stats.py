"""EngineStats / collect_stats (pagedkv/engine/stats.py) from hand-made KV and scheduler
counters: each field comes from its source, and the pool's own prefix hits exclude the tiers'."""

import json
from dataclasses import FrozenInstanceError, fields
from types import SimpleNamespace

import pytest

from pagedkv.engine.stats import EngineStats, collect_stats


def _kv(tiers):
    kvs = SimpleNamespace(prefix_queries=64, prefix_hits=48, prefix_hit_rate=0.75, cow_copies=3, evictions=5,
                          allocated_blocks=40, deferred_frees=2)
    return SimpleNamespace(stats=kvs, tier_stats=lambda: tiers, num_blocks=32, num_used_blocks=8,
                           num_free_blocks=24, usage=0.25, pool=SimpleNamespace(num_shared=4))


ST = SimpleNamespace(num_preemptions=1, num_steps=11, num_batched_tokens_total=300, peak_running=6,
                     num_generated_tokens=90, num_prompt_tokens=210, num_finished_requests=7,
                     peak_shared_blocks=9, peak_used_blocks=20, num_spec_rows=4, num_draft_tokens=16,
                     num_accepted_tokens=6, grammar_failures={"parser_limit": 2})


def test_collect_stats_copies_each_counter():
    s = collect_stats(_kv({}), ST, num_running=2, num_waiting=3)
    assert (s.num_running, s.num_waiting, s.num_blocks, s.num_used_blocks, s.num_free_blocks) == (2, 3, 32, 8, 24)
    assert (s.kv_usage, s.num_preemptions, s.num_steps, s.num_batched_tokens, s.peak_running) == (0.25, 1, 11, 300, 6)
    assert (s.num_generated_tokens, s.num_prompt_tokens, s.num_finished_requests) == (90, 210, 7)
    assert (s.num_shared_blocks, s.peak_shared_blocks, s.peak_used_blocks) == (4, 9, 20)
    assert (s.kv_prefix_queries, s.kv_prefix_hits, s.kv_prefix_hit_rate) == (64, 48, 0.75)
    assert s.grammar_failures == {"parser_limit": 2} and s.grammar_failures is not ST.grammar_failures
    assert (s.kv_cow_copies, s.kv_evictions, s.kv_allocated_blocks, s.kv_deferred_frees) == (3, 5, 40, 2)
    assert s.kv_tiers == {} and s.kv_pool_hit_tokens == 48  # no tiers: every hit is the pool's
    assert (s.num_spec_rows, s.num_draft_tokens, s.num_accepted_tokens) == (4, 16, 6)
    assert (s.spec_acceptance_rate, s.spec_mean_accepted_length) == (6 / 16, (6 + 4) / 4)


def test_pool_hits_exclude_the_tiers_hits():
    tiers = {"tiers": {"host": {"hit_tokens": 16}, "disk": {"hit_tokens": 8}}, "transfer": {}}
    s = collect_stats(_kv(tiers), ST, 0, 0)
    assert s.kv_pool_hit_tokens == 48 - 16 - 8
    assert s.kv_tiers is tiers


def test_as_dict_is_json_ready_and_the_snapshot_frozen():
    s = collect_stats(_kv({}), ST, 1, 0)
    d = s.as_dict()
    assert list(d) == [f.name for f in fields(EngineStats)]
    assert json.loads(json.dumps(d))["num_steps"] == 11
    with pytest.raises(FrozenInstanceError):
        s.num_steps = 12
