"""Speculative rows under memory pressure and the lookahead bookkeeping, exact: a row's
lookahead never takes the block a later running request needs for its own decode (no
preemption caused by speculation), and a random accept/reject/abort sequence keeps every
table trimmed to its confirmed tokens, every ref count at one holder, only confirmed blocks
published, and no block leaked (no model)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.engine.request import Request, SamplingParams
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.spec_decode import lookahead_cap
from pagedkv.kv import check_invariants
from pagedkv.utils import cdiv
from pagedkv.worker.ngram_proposer import NgramProposer


def _sched(num_blocks, prefix=False, k=3):
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64,
                                     max_model_len=128, watermark=0.0, enable_prefix_caching=prefix,
                                     num_speculative_tokens=k))


def _propose(s, k=3):
    """After a step, as the worker does: the n-gram proposer's drafts for the scheduler's rows."""
    s.set_drafts(NgramProposer(k=k).propose(s.draft_rows()[0]))


def _req(rid, prompt, max_tokens=20):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_time=0.0,
                   max_total_tokens=128)


def test_lookahead_cap_counts_slots_left_in_the_blocks_it_may_take():
    # 6 computed, the decode token at position 6 (block 1, slots 6..7): 1 draft fits in it
    assert lookahead_cap(6, 0, 4) == 1
    assert lookahead_cap(6, 1, 4) == 5  # one more block: positions 8..11
    assert lookahead_cap(7, 0, 4) == 0  # the decode token fills its block
    assert lookahead_cap(8, 0, 4) == 3  # the decode token opens block 2: 3 slots behind it
    assert lookahead_cap(6, -2, 4) == 1  # no spare block: never below the current block


def test_lookahead_never_preempts_a_later_running_request():
    """A (7 tokens, 6 computed, blocks of 4) would draft 4 1 2 into a third block, the pool's
    last free one, which B (9 tokens, 8 computed) needs for its decode: A drafts only what fits
    in its own block (one token) and nobody is preempted."""
    s = _sched(num_blocks=5)
    a, b = _req("A", [1, 2, 3, 4, 1, 2]), _req("B", [9, 8, 7, 6, 5, 4, 3, 2])
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert out.scheduled == [(a, 6), (b, 8)]
    s.update(out, {"A": (3, None), "B": (1, None)})
    _propose(s)
    assert s.kv.num_free_blocks == 1  # 4 of 5 held (2 each)
    out = s.schedule()
    assert out.preempted == [] and out.drafts == {"A": [4]}
    assert out.scheduled == [(a, 2), (b, 1)]
    assert [len(t) for t in out.block_ids] == [2, 3]
    s.update(out, {"B": (7, None)}, (), {"A": [(4, None), (1, None)]})
    assert a.output_token_ids == [3, 4, 1] and a.num_computed_tokens == 8
    assert s.stats.num_preemptions == 0
    check_invariants(s.kv)


def test_lookahead_takes_a_spare_block_when_the_others_are_covered():
    s = _sched(num_blocks=6)  # 2 free after both prefills: one for B, one for A's drafts
    a, b = _req("A", [1, 2, 3, 4, 1, 2]), _req("B", [9, 8, 7, 6, 5, 4, 3, 2])
    s.add_request(a)
    s.add_request(b)
    s.update(s.schedule(), {"A": (3, None), "B": (1, None)})
    _propose(s)
    out = s.schedule()
    assert out.preempted == [] and out.drafts == {"A": [4, 1, 2]}
    assert [len(t) for t in out.block_ids] == [3, 3] and s.kv.num_free_blocks == 0
    s.update(out, {"B": (7, None)}, (), {"A": [(5, None)]})  # every draft rejected
    assert s.kv.num_free_blocks == 1 and len(s.kv.get_block_ids("A")) == 2
    check_invariants(s.kv)


class ExactLookahead(RuleBasedStateMachine):
    """Random accept-j-of-k, plain decodes, aborts and arrivals with prefix caching on: after
    every step each running table holds exactly the blocks of its computed tokens (rejected
    lookahead gone), each block it holds has one reference per table holding it, a published
    block lies wholly below its holder's computed tokens, and the pool's used count is the
    number of distinct held blocks."""

    BS = 4
    PREFIX = True

    def __init__(self):
        super().__init__()
        self.s = _sched(num_blocks=14, prefix=self.PREFIX, k=4)
        self.n = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def add(self, tokens):
        self.n += 1
        self.s.add_request(_req(f"q{self.n}", tokens, max_tokens=24))

    @precondition(lambda self: self.s.has_unfinished())
    @rule(data=st.data())
    def step(self, data):
        out = self.s.schedule()
        sampled, runs = {}, {}
        for r, n in out.scheduled:
            d = out.drafts.get(r.request_id)
            if d is not None:
                assert n == 1 + len(d) and len(out.block_ids[out.scheduled.index((r, n))]) == cdiv(
                    r.num_computed_tokens + n, self.BS)
                j = data.draw(st.integers(0, len(d)), label="accepted")
                runs[r.request_id] = [(t, None) for t in d[:j]] + [(data.draw(st.integers(0, 2)), None)]
            elif r.num_computed_tokens + n == r.num_tokens:
                sampled[r.request_id] = (data.draw(st.integers(0, 2)), None)
        self.s.update(out, sampled, (), runs)
        _propose(self.s, k=4)

    @precondition(lambda self: self.s.running)
    @rule(i=st.integers(0, 7))
    def abort(self, i):
        self.s.abort([self.s.running[i % len(self.s.running)].request_id])

    @invariant()
    def exact(self):
        kv = self.s.kv
        check_invariants(kv)
        holders: dict[int, int] = {}
        for r in self.s.running:
            ids = kv.get_block_ids(r.request_id)
            assert len(ids) == cdiv(r.num_computed_tokens, self.BS), (r.request_id, ids, r.num_computed_tokens)
            for i, b in enumerate(ids):
                holders[b] = holders.get(b, 0) + 1
                if kv.pool.blocks[b].block_hash is not None:
                    assert (i + 1) * self.BS <= r.num_computed_tokens
        for b, n in holders.items():
            assert kv.pool.blocks[b].ref_cnt == n
        assert kv.num_used_blocks == len(holders)

    def teardown(self):
        self.s.abort(list(self.s.requests))
        assert self.s.kv.num_used_blocks == 0


TestExactLookahead = ExactLookahead.TestCase
TestExactLookahead.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)


class ExactLookaheadNoPrefixCache(ExactLookahead):
    """The same with prefix caching off (nothing published, so only the exact tables and
    reference counts are checked)."""

    PREFIX = False


TestExactLookaheadNoPrefixCache = ExactLookaheadNoPrefixCache.TestCase
TestExactLookaheadNoPrefixCache.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
