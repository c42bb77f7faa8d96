"""Scheduler semantics as vLLM's (no model): the priority policy preempts the least
important running request even when it was already scheduled this step, and the
prefix-cache counters count a request's first computation only."""

from __future__ import annotations

from pagedkv.engine.request import RequestStatus
from pagedkv.kv import check_invariants

from tests.engine.test_scheduler import make_request, make_scheduler, plan, step


def _two_running(prefix_caching: bool):
    """A (priority 10, admitted first, 5-token prompt) and B (priority 0, 8-token prompt) in a
    4-block pool of 4-token blocks: after two steps A holds 2 blocks, B 2, none free."""
    s = make_scheduler(num_blocks=4, policy="priority", enable_prefix_caching=prefix_caching)
    a = make_request("a", 5, max_tokens=4, first=0, t=0.0)
    a.priority = 10
    b = make_request("b", 8, max_tokens=3, first=100, t=1.0)
    b.priority = 0
    s.add_request(a)
    out, _ = step(s)
    assert plan(out) == [("a", 5)]
    s.add_request(b)
    out, _ = step(s)
    assert plan(out) == [("a", 1), ("b", 8)]
    assert s.kv.num_free_blocks == 0
    return s, a, b


def test_priority_preempts_the_lowest_priority_even_if_already_scheduled():
    s, a, b = _two_running(prefix_caching=False)
    # A's decode (position 6) fits its block and is scheduled first; B's (position 8) needs a
    # new block: the victim is A (priority 10 > 0), taken back out of this step
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["a"]
    assert plan(out) == [("b", 1)]
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0 and a.num_preemptions == 1
    assert b.num_preemptions == 0
    assert s.kv.num_free_blocks == 1  # A's 2 blocks back, B took 1
    assert out.block_ids == [s.kv.get_block_ids("b")] and len(out.block_ids[0]) == 3
    s.update(out, {"b": (200, None)})
    check_invariants(s.kv)
    while s.has_unfinished():
        step(s)
        check_invariants(s.kv)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == 4 and b.num_output_tokens == 3 and b.num_preemptions == 0
    assert s.kv.num_free_blocks == s.kv.num_blocks == 4


def test_fcfs_still_preempts_the_latest_admitted():
    s = make_scheduler(num_blocks=4, policy="fcfs")
    a = make_request("a", 5, max_tokens=4, first=0, t=0.0)
    b = make_request("b", 8, max_tokens=3, first=100, t=1.0)
    s.add_request(a)
    step(s)
    s.add_request(b)
    step(s)
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["b"] and plan(out) == [("a", 1)]
    s.update(out, {"a": (300, None)})
    while s.has_unfinished():
        step(s)
    assert s.kv.num_free_blocks == 4


def test_prefix_counters_count_the_first_computation_only():
    s = make_scheduler(num_blocks=4, policy="fcfs", enable_prefix_caching=True)
    a = make_request("a", 5, max_tokens=4, first=0, t=0.0)
    b = make_request("b", 8, max_tokens=3, first=100, t=1.0)
    s.add_request(a)
    step(s)
    s.add_request(b)
    step(s)
    out = s.schedule()  # B (latest) is preempted; its recompute hits its own 2 published blocks
    assert [r.request_id for r in out.preempted] == ["b"]
    s.update(out, {"a": (300, None)})
    resumed = []
    while s.has_unfinished():
        o, _ = step(s)
        resumed += [(r.request_id, n) for r, n in o.scheduled if r is b]
    assert resumed[0] == ("b", 1)  # the recompute skipped its 2 cached blocks (8 tokens) ...
    st = s.kv.stats
    # ... but the counters hold the first admissions only: 5 + 8 prompt tokens looked up, no
    # shared prefix, so no hit (the old count: 13 + 9 queries, 8 hits)
    assert (st.prefix_queries, st.prefix_hits) == (13, 0)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    assert st.prefix_hits == a.num_cached_tokens + b.num_cached_tokens
    assert a.num_prefix_query_tokens == 5 and b.num_prefix_query_tokens == 8
    assert s.kv.num_free_blocks == 4
