"""The scheduler alone, driven by hand-made requests: no model, no runner, no tokenizer.

A step is ``schedule()`` -> (the model would run here) -> ``update(out, sampled, forks)`` ->
``apply(decisions)``; the tests play the model by choosing the sampled token ids. Pools are
tiny (block_size 4) so every block id, free-block count and computed-token count is exact.
"""

from __future__ import annotations

import pytest

from pagedkv.engine.decisions import Decisions, Finish, Fork
from pagedkv.engine.request import Request, RequestStatus, SamplingParams
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.kv import CacheKeys

BS = 4


def make_scheduler(num_blocks: int = 16, **kw) -> Scheduler:
    cfg = dict(num_blocks=num_blocks, block_size=BS, max_num_seqs=8, max_num_batched_tokens=16,
               max_model_len=64, watermark=0.0)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def make_request(rid: str, num_prompt: int, max_tokens: int = 8, first: int = 0, t: float = 0.0,
                 **params) -> Request:
    """A request of prompt tokens ``first, first + 1, ...`` (distinct per ``first``)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(
        request_id=rid, prompt_token_ids=list(range(first, first + num_prompt)), sampling_params=sp,
        arrival_time=t, cache_keys=CacheKeys(model_id="m"), max_total_tokens=num_prompt + max_tokens,
        parent_id=rid,
    )


def plan(out) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def step(sched: Scheduler, tokens: dict[str, int] | None = None, forks=()):
    """One step with no model: every sequence that completes its known tokens samples
    ``tokens[id]`` (default 100 + its output count)."""
    out = sched.schedule()
    tokens = tokens or {}
    sampled = {r.request_id: (tokens.get(r.request_id, 100 + r.num_output_tokens), None)
               for r in out.sampling_requests()}
    finished = sched.update(out, sampled, forks)
    return out, finished


def test_admission_stops_at_the_token_budget_without_chunking():
    s = make_scheduler(enable_chunked_prefill=False)
    a, b = make_request("a", 10), make_request("b", 10, first=50)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert plan(out) == [("a", 10)]  # b's 10 tokens exceed the 6 left of the budget of 16
    assert out.num_batched_tokens == 10 and out.block_ids == [[0, 1, 2]]
    assert [r.request_id for r in s.waiting] == ["b"] and s.kv.num_free_blocks == 13
    assert s.stats.num_prompt_tokens == 20


def test_chunked_admission_fills_the_budget():
    s = make_scheduler()
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10, first=50))
    out = s.schedule()
    assert plan(out) == [("a", 10), ("b", 6)]  # b's first chunk takes the rest of the 16
    assert out.num_batched_tokens == 16
    assert out.block_ids == [[0, 1, 2], [3, 4]]
    assert [r.request_id for r in out.sampling_requests()] == ["a"]  # b's prompt is unfinished
    s.update(out, {"a": (7, None)})
    assert s.requests["a"].num_computed_tokens == 10 and s.requests["a"].output_token_ids == [7]
    assert s.requests["b"].num_computed_tokens == 6
    out = s.schedule()  # a decodes 1, b's last chunk 4 tokens: 10 computed tokens, no new block
    assert plan(out) == [("a", 1), ("b", 4)] and out.block_ids == [[0, 1, 2], [3, 4, 5]]


def test_chunked_prefill_splits_a_long_prompt():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("a", 20))
    computed, tables, samples = [], [], []
    for _ in range(3):
        out = s.schedule()
        samples.append([r.request_id for r in out.sampling_requests()])
        s.update(out, {r.request_id: (100, None) for r in out.sampling_requests()})
        computed.append(s.requests["a"].num_computed_tokens)
        tables.append(out.block_ids[0])
    assert computed == [8, 16, 20]
    assert tables == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert samples == [[], [], ["a"]]  # only the chunk that ends the prompt is sampled
    assert s.requests["a"].output_token_ids == [100]
    assert s.kv.num_free_blocks == 11


def test_decode_steps_batch_every_running_request():
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    s.add_request(make_request("b", 3, first=50))
    step(s, {"a": 11, "b": 22})
    out = s.schedule()
    assert plan(out) == [("a", 1), ("b", 1)] and out.num_batched_tokens == 2
    toks, starts, tables, sample = out.model_inputs()
    assert toks == [[11], [22]] and starts == [5, 3] and sample == [True, True]
    assert tables == [[0, 1], [2]]  # b's 4th token still fits its first block
    s.update(out, {"a": (12, None), "b": (23, None)})
    out = s.schedule()  # b's 5th token needs a second block
    assert out.block_ids == [[0, 1], [2, 3]]
    assert s.stats.num_generated_tokens == 4


def test_preemption_takes_the_latest_admitted_and_returns_its_blocks():
    s = make_scheduler(num_blocks=4)
    a, b = make_request("a", 7), make_request("b", 7, first=50, t=1.0)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert out.block_ids == [[0, 1], [2, 3]] and s.kv.num_free_blocks == 0
    out, _ = step(s)  # each writes its 8th token into its second block
    assert plan(out) == [("a", 1), ("b", 1)]
    out = s.schedule()  # a's 9th token needs a block: none free, b (admitted last) goes
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(s.waiting) == [b] and s.running == [a]
    assert out.block_ids == [[0, 1, 3]]  # b's blocks came back (tail first) and a took one
    assert s.kv.num_free_blocks == 1 and not s.kv.has_request("b")
    assert s.stats.num_preemptions == 1
    s.update(out, {"a": (9, None)})
    assert b.output_token_ids == [100, 101]  # kept: it recomputes prompt + outputs on resume


def test_abort_frees_running_and_waiting_requests():
    s = make_scheduler(num_blocks=4, max_num_seqs=1)
    a, b = make_request("a", 7), make_request("b", 3, first=50)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert s.running == [a] and list(s.waiting) == [b] and s.kv.num_free_blocks == 2
    assert s.abort(["b", "nope"]) == [b]
    assert b.status == RequestStatus.FINISHED_ABORTED and list(s.waiting) == []
    assert s.abort(["a"]) == [a] and s.running == []
    assert s.kv.num_free_blocks == 4 and s.requests == {}
    assert s.abort(["a"]) == []  # twice: freed once


def test_abort_during_a_step_waits_for_the_fence():
    s = make_scheduler(num_blocks=4)
    a = make_request("a", 7)
    s.add_request(a)
    out = s.schedule()
    s.abort(["a"])  # lands while the step (the model) is in flight
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == 2  # blocks 0, 1 held: the step still writes them
    s.update(out, {"a": (5, None)})
    assert a.output_token_ids == [] and s.kv.num_free_blocks == 4


def test_finish_decision_frees_the_request():
    s = make_scheduler(num_blocks=4)
    a = make_request("a", 7)
    s.add_request(a)
    step(s)
    s.apply(Decisions(finishes=[Finish(a, RequestStatus.FINISHED_STOPPED)]))
    assert a.status == RequestStatus.FINISHED_STOPPED and a.finish_reason == "stop"
    assert s.running == [] and s.kv.num_free_blocks == 4 and "a" not in s.requests


def test_finish_decision_relabels_a_length_finish_only():
    s = make_scheduler()
    a, b = make_request("a", 3, max_tokens=1), make_request("b", 3, max_tokens=1, first=50)
    s.add_request(a)
    s.add_request(b)
    _, finished = step(s)
    assert finished == [a, b] and a.status == RequestStatus.FINISHED_LENGTH
    b.status = RequestStatus.FINISHED_ABORTED  # as if aborted
    s.apply(Decisions(finishes=[Finish(a, RequestStatus.FINISHED_STOPPED),
                                Finish(b, RequestStatus.FINISHED_STOPPED)]))
    assert a.status == RequestStatus.FINISHED_STOPPED  # a stop string in its final text
    assert b.status == RequestStatus.FINISHED_ABORTED


def test_stop_token_finishes_in_update():
    s = make_scheduler()
    a = make_request("a", 3, stop_token_ids=[42])
    s.add_request(a)
    _, finished = step(s, {"a": 42})
    assert finished == [a] and a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 42
    assert s.kv.num_free_blocks == 16


def test_fork_for_n_siblings_shares_the_prompt_blocks():
    s = make_scheduler()
    a = make_request("a", 6)
    s.add_request(a)
    out = s.schedule()
    child = make_request("a#1", 6)
    child.parent_id, child.index = "a", 1
    s.update(out, {"a": (7, None), "a#1": (8, None)}, [Fork(a, child, 6)])
    assert plan(out) == [("a", 6), ("a#1", 0)]  # the sibling joined the step
    assert child.status == RequestStatus.RUNNING and s.running == [a, child]
    assert a.output_token_ids == [7] and child.output_token_ids == [8]
    assert child.num_computed_tokens == 6
    assert s.kv.get_block_ids("a#1") == s.kv.get_block_ids("a") == [0, 1]
    assert [s.kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2] and s.num_shared_blocks() == 2
    assert s.kv.num_free_blocks == 14
    out = s.schedule()  # both write position 6 into the shared, partly filled block 1
    assert plan(out) == [("a", 1), ("a#1", 1)]
    assert out.copies == [(1, 2)] and out.block_ids == [[0, 2], [0, 1]]  # the first writer copies
    assert [s.kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]


def test_beam_fork_and_free_decisions():
    s = make_scheduler()
    a = make_request("b", 5)
    s.add_request(a, gang=True)
    out = s.schedule()
    s.update(out, {})
    assert a.num_computed_tokens == 5 and s.gangs.ids == {"b"}
    child = make_request("b#beam1", 5)
    child.parent_id = "b"
    s.apply(Decisions(forks=[Fork(a, child, 5)], generated_tokens=2))
    assert s.kv.get_block_ids("b#beam1") == [0, 1] and s.stats.num_generated_tokens == 2
    assert s.stats.peak_shared_blocks == 2
    s.apply(Decisions(finishes=[Finish(a, RequestStatus.FINISHED_STOPPED)]))
    assert s.gangs.ids == {"b"}  # one beam lives on
    assert [s.kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]
    s.apply(Decisions(finishes=[Finish(child, RequestStatus.FINISHED_STOPPED)]))
    assert s.gangs.ids == set() and s.kv.num_free_blocks == 16  # the gang's last sequence


def test_empty_pool_step_stalls_loudly():
    from pagedkv.engine.scheduler import SchedulerStallError

    s = make_scheduler(num_blocks=2, enable_chunked_prefill=False)
    s.add_request(make_request("a", 12))  # 3 blocks: never fits (the engine refuses it first)
    out = s.schedule()
    assert out.is_empty
    s.end_step(out)
    with pytest.raises(SchedulerStallError, match="scheduler stalled"):
        s.check_stall(out)
