"""The router without Ray: prefix index, policies, the load rule, tenants, replica up/down,
the merged /metrics, and KV events from a real engine feeding a replica's index."""

from __future__ import annotations

import subprocess
import sys
import time

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.kv.prefix_cache import CacheKeys, hash_blocks
from pagedkv.serving.replicas.index import PrefixIndex, prompt_hashes
from pagedkv.serving.replicas.ingress_metrics import merge_metrics, router_metrics
from pagedkv.serving.replicas.router import NoReplicaError, ReplicaView, Router

BS = 4


def _views(n: int = 2) -> list[ReplicaView]:
    return [ReplicaView(rank=i, url=f"http://r{i}", healthy=True, pid=100 + i) for i in range(n)]


def _h(ids, tenant=None, salt=None):
    return prompt_hashes(ids, BS, model_id="m", revision="r", tenant=tenant, cache_salt=salt, kv_format="float32")


def test_prompt_hashes_are_the_engines_block_hashes():
    ids = list(range(10, 23))  # 13 tokens: 3 full blocks of 4
    keys = CacheKeys(model_id="m", revision="r", cache_salt="s", tenant="t", kv_cache_dtype="float32")
    assert _h(ids, "t", "s") == hash_blocks(ids, BS, keys)
    assert _h(ids, "t", "s") != prompt_hashes(ids, BS, model_id="m", revision="r", tenant="t", cache_salt="s",
                                              kv_format="int8/g64")  # another cache format: other bytes
    assert len(_h(ids)) == 3
    assert _h(ids, "a") != _h(ids, "b") and _h(ids, "a")[0] != _h(ids)[0]


def test_index_matches_leading_blocks_and_evicts_least_recent():
    a, b = _h(list(range(16))), _h(list(range(100, 116)))
    idx = PrefixIndex(capacity=6)
    idx.insert(a)
    assert idx.match(a) == 4 and idx.match(a[:2] + b[2:]) == 2 and idx.match(b) == 0
    idx.remove([a[1]])
    assert idx.match(a) == 1  # a chain is usable only up to its first missing block
    idx.insert(b)  # 3 + 4 = 7 > 6: the oldest (a[0]) goes
    assert len(idx) == 6 and a[0] not in idx and idx.match(b) == 4
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)


def test_round_robin_takes_turns_and_least_loaded_counts_in_flight():
    rr = Router(_views(3), "round-robin")
    assert [rr.choose().replica.rank for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    views = _views(3)
    ll = Router(views, "least-loaded")
    views[0].in_flight, views[1].in_flight, views[2].in_flight = 3, 1, 2
    d = ll.choose()
    assert (d.replica.rank, d.reason, views[1].in_flight) == (1, "least-loaded", 2)
    views[2].kv_usage = 0.5  # equal in-flight (2, 2): the lower KV usage wins
    assert ll.choose().replica.rank == 1
    ll.release(views[1], failed=True)
    assert (views[1].in_flight, views[1].failures) == (2, 1)


def test_prefix_aware_follows_the_longest_cached_prefix():
    views = _views(2)
    r = Router(views, "prefix-aware")
    user = _h(list(range(40)))  # 10 blocks
    first = r.choose(user)
    assert (first.reason, first.matched_blocks) == ("least-loaded", 0)
    other = views[1 - first.replica.rank]
    other.index.insert(user[:3])  # the other replica holds a shorter prefix
    r.release(first.replica)
    for _ in range(3):
        d = r.choose(user)
        assert (d.replica.rank, d.reason, d.matched_blocks) == (first.replica.rank, "prefix", 10)
    assert first.replica.routed == 4 and first.replica.matched_blocks == 30


def test_prefix_aware_load_rule_falls_back_past_the_gap():
    views = _views(2)
    r = Router(views, "prefix-aware", load_gap=4)
    user = _h(list(range(40)))
    views[0].index.insert(user)
    views[0].in_flight, views[1].in_flight = 4, 0  # gap 4: still the prefix replica
    assert r.choose(user).reason == "prefix"
    d = r.choose(user)  # now 5 vs 0: the gap is exceeded
    assert (d.replica.rank, d.reason, d.matched_blocks) == (1, "load-gap", 0)
    with pytest.raises(ValueError):
        Router(views, "prefix-aware", load_gap=-1)
    with pytest.raises(ValueError):
        Router(views, "random")


def test_a_tenants_prefix_never_guides_another_tenant():
    views = _views(2)
    r = Router(views, "prefix-aware")
    ids = list(range(40))
    views[0].index.insert(_h(ids, tenant="a"))
    views[0].in_flight = 1  # so that the unguided choice is replica 1
    d = r.choose(_h(ids, tenant="b"))
    assert (d.replica.rank, d.reason, d.matched_blocks) == (1, "least-loaded", 0)
    assert r.choose(_h(ids, tenant="a")).replica.rank == 0
    assert r.choose(_h(ids, tenant="a", salt="x")).matched_blocks == 0


def test_unhealthy_replicas_are_skipped_and_restarts_start_cold():
    views = _views(2)
    r = Router(views, "prefix-aware")
    user = _h(list(range(16)))
    views[0].index.insert(user)
    r.mark_down(views[0])
    assert r.choose(user).replica.rank == 1
    assert r.choose(user, exclude=[0]).replica.rank == 1
    with pytest.raises(NoReplicaError):
        r.choose(user, exclude=[1])
    r.mark_up(views[0], "http://r0-new", pid=999)  # a new process: its cache is empty
    assert (views[0].healthy, views[0].url, views[0].restarts, len(views[0].index)) == (True, "http://r0-new", 1, 0)
    r.mark_up(views[1], "http://r1", pid=101)  # the same process: index kept
    assert views[1].restarts == 0 and views[1].index.match(user) == 4


_TEXT = """# HELP pagedkv_prefix_cache_hits_tokens_total Prompt tokens served from the prefix cache.
# TYPE pagedkv_prefix_cache_hits_tokens_total counter
pagedkv_prefix_cache_hits_tokens_total{{model_name="m"}} {hits}
# HELP pagedkv_kv_cache_usage_percent Used KV blocks, percent of the pool (0-100).
# TYPE pagedkv_kv_cache_usage_percent gauge
pagedkv_kv_cache_usage_percent{{model_name="m"}} {usage}
# HELP pagedkv_time_to_first_token_seconds TTFT.
# TYPE pagedkv_time_to_first_token_seconds histogram
pagedkv_time_to_first_token_seconds_bucket{{le="0.1",model_name="m"}} {b}
pagedkv_time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {b}
pagedkv_time_to_first_token_seconds_count{{model_name="m"}} {b}
pagedkv_time_to_first_token_seconds_sum{{model_name="m"}} 0.5
"""


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_merged_metrics_label_each_replica_and_sum_them():
    text = merge_metrics({0: _TEXT.format(hits=40, usage=20, b=3), 1: _TEXT.format(hits=120, usage=60, b=5)})
    s = _samples(text)
    hit = "pagedkv_prefix_cache_hits_tokens_total"
    assert s[(hit, (("model_name", "m"), ("replica", "0")))] == 40
    assert s[(hit, (("model_name", "m"), ("replica", "1")))] == 120
    assert s[(hit, (("model_name", "m"), ("replica", "all")))] == 160
    assert s[("pagedkv_kv_cache_usage_percent", (("model_name", "m"), ("replica", "all")))] == 40  # a mean
    assert s[("pagedkv_time_to_first_token_seconds_count", (("model_name", "m"), ("replica", "all")))] == 8
    assert s[("pagedkv_time_to_first_token_seconds_sum", (("model_name", "m"), ("replica", "all")))] == 1.0
    views = _views(2)
    views[1].healthy, views[0].routed = False, 7
    s = _samples(router_metrics(views, "prefix-aware", retries=2))
    assert s[("pagedkv_router_replica_up", (("replica", "1"),))] == 0
    assert s[("pagedkv_router_routed_total", (("policy", "prefix-aware"), ("replica", "0")))] == 7
    assert s[("pagedkv_router_retries_total", ())] == 2


def test_kv_events_of_an_engine_feed_the_replica_index(loaded_model):
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.request import SamplingParams
    from pagedkv.serving.replicas.events import EventFeed
    from pagedkv.testing.tiny import tiny_random_model
    from pagedkv.utils import free_port_pair

    tiny = tiny_random_model(loaded_model)
    engine = LLMEngine(tiny, num_blocks=32, block_size=BS, max_model_len=64,  # replay at port + 1
                       kv_events=f"tcp://127.0.0.1:{free_port_pair()}")
    views = _views(1)
    router = Router(views, "prefix-aware")
    feed = EventFeed(router, views[0], engine.config.kv_events)
    try:
        ids = list(range(300, 318))  # 18 tokens: 4 full prompt blocks
        ident = {"model_id": engine.model_id, "revision": engine.revision, "kv_format": engine.kv_format_id}
        want = prompt_hashes(ids, BS, tenant="t", cache_salt=None, **ident)
        deadline = time.monotonic() + 30
        while views[0].index.match(want) < 4:  # the SUB socket joins asynchronously: send until seen
            assert time.monotonic() < deadline, "no BlockStored event reached the index"
            engine.reset_prefix_cache()
            engine.add_request(None, ids, SamplingParams(max_tokens=1, temperature=0), tenant="t")
            while engine.has_unfinished_requests():
                engine.step()
            time.sleep(0.05)
        assert feed.batches >= 1
        other = prompt_hashes(ids, BS, tenant="u", cache_salt=None, **ident)
        assert views[0].index.match(other) == 0
        feed.apply(msgpack.packb([0.0, [["BlockRemoved", want[2:], "pool"]]]))
        assert views[0].index.match(want) == 2
        feed.apply(msgpack.packb([0.0, [["AllBlocksCleared"]]]))
        assert len(views[0].index) == 0
    finally:
        feed.close()
        engine.close()


def test_pagedkv_and_the_one_engine_server_import_no_ray():
    code = ("import sys, pagedkv, pagedkv.serving.app, pagedkv.cli, pagedkv.serving.replicas.ingress; "
            "pagedkv.cli.build_parser(); assert 'ray' not in sys.modules, 'ray imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_ingress_hashes_prompts_as_the_replica_tokenizes_them(loaded_model):
    import json

    from pagedkv.serving.replicas.ingress import Ingress

    tok = loaded_model.tokenizer
    ing = Ingress(Router(_views(2)), None, tok, {"model_id": "m", "revision": "r", "kv_format": "float32",
                                                 "block_size": BS})
    msgs = [{"role": "developer", "content": "Answer briefly, please."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    raw = json.dumps({"model": "x", "messages": msgs, "cache_salt": "s"}).encode()
    ids = tok.apply_chat_template([{"role": "system", "content": "Answer briefly, please."},
                                   {"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    got = ing.hashes("/v1/chat/completions", raw, "a")
    assert len(got) == len(ids) // BS > 3 and got == _h(ids, "a", "s")
    text = "Once upon a time, in a land far away, there lived a small dragon."
    want = _h(list(tok(text, add_special_tokens=False)["input_ids"]))
    assert ing.hashes("/v1/completions", json.dumps({"prompt": [text, "other"]}).encode(), None) == want
    assert ing.hashes("/v1/completions", json.dumps({"prompt": [[5, 6, 7, 8, 9]]}).encode(), None) == _h([5, 6, 7, 8, 9])
    assert ing.hashes("/v1/completions", b"{not json", None) == []
    assert ing.hashes("/v1/chat/completions", b'{"messages": 3}', None) == []


def test_serve_refuses_bad_replica_options_before_starting_anything(capsys):
    from pagedkv.cli import main

    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "-dp", "2", "--kv-events", "tcp://127.0.0.1:5557"]) == 2
    assert "--kv-events names one endpoint" in capsys.readouterr().err
    assert main(["serve", "-dp", "2", "--route-load-gap", "-1"]) == 2
    assert "--route-load-gap must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "-dp", "2", "--routing", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err
