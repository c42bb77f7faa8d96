"""Speculative decoding by prompt lookup: the registry (pagedkv.worker.proposer; the n-gram
proposer itself: tests/worker/test_ngram_proposer.py), the verification rule (pagedkv.engine.spec_decode), the KV bookkeeping of lookahead slots (hand-made requests, no model) and
the rejection rule's distribution; the model tests are in test_spec_engine.py."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.request import Request, SamplingParams
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.spec_decode import can_speculate, draft_budget, sample_with_drafts, split_extra_rows
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigError
from pagedkv.kv import check_invariants
from pagedkv.worker.ngram_proposer import NgramProposer
from pagedkv.worker.proposer import DraftRequest, build_proposer, parse_speculative


def test_engine_config_speculative_options():
    assert build_proposer(EngineConfig(), None, "m") is None
    assert build_proposer(EngineConfig(speculative="ngram", num_speculative_tokens=6), None, "m") == NgramProposer(6, 2, 3)
    with pytest.raises(ConfigError, match="'ngram' \\(prompt lookup\\) or 'draft:<model>'"):
        EngineConfig.from_kwargs({"speculative": "eagle"})
    with pytest.raises(ConfigError, match="'ngram' takes no argument"):
        EngineConfig.from_kwargs({"speculative": "ngram:3"})
    cls, arg = parse_speculative("draft: tiny ")  # the registry names the class; the engine loads it
    assert (cls.__name__, cls.__module__, arg) == ("DraftModelProposer", "pagedkv.worker.draft_proposer", "tiny")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig.from_kwargs({"speculative": "ngram", "num_speculative_tokens": -1})


def _req(rid, prompt, **params):
    return Request(rid, list(prompt), SamplingParams(**params), arrival_time=0.0, max_total_tokens=10_000)


def test_who_speculates_and_how_many_drafts():
    assert can_speculate(_req("a", [1, 2], max_tokens=8, temperature=0.7, logprobs=2, stop=["x"]))
    assert not can_speculate(_req("b", [1, 2], max_tokens=8, repetition_penalty=1.1))
    assert not can_speculate(_req("c", [1, 2], max_tokens=8, presence_penalty=0.5))
    assert not can_speculate(_req("d", [1, 2], max_tokens=8, beam_width=2, temperature=0.0))
    r = _req("e", [1, 2, 3], max_tokens=5)
    r.append_output_token(4)
    assert draft_budget(r, max_model_len=100) == 3  # 4 outputs left: 3 drafts + 1 sampled
    assert draft_budget(r, max_model_len=6) == 2  # positions 3 .. 5 only
    r.max_total_tokens = 6
    assert draft_budget(r, max_model_len=100) == 1


# ---- verification -------------------------------------------------------------------------

def _logits(rows, vocab=8):
    """fp32 [len(rows), vocab] with row i's maximum at token rows[i]."""
    x = torch.zeros(len(rows), vocab)
    for i, t in enumerate(rows):
        x[i, t] = 5.0
    return x


def test_greedy_keeps_the_agreeing_drafts_and_one_sampled_token():
    a, b = _req("a", [1, 2], max_tokens=9, temperature=0.0), _req("b", [1], max_tokens=9, temperature=0.0)
    drafts = {"a": [3, 4, 5]}
    # a's positions: argmax 3, 4, 7 (rejects draft 5), then the last position 6
    sampled, runs = sample_with_drafts(Sampler(), _logits([6, 2]), [a, b], {"a": _logits([3, 4, 7])}, drafts)
    assert sampled == {"b": (2, None)}
    assert runs == {"a": [(3, None), (4, None), (7, None)]}
    # every draft accepted: the last position's token is the bonus
    _, runs = sample_with_drafts(Sampler(), _logits([6]), [a], {"a": _logits([3, 4, 5])}, drafts)
    assert [t for t, _ in runs["a"]] == [3, 4, 5, 6]
    # the first draft rejected: one token, as plain decoding
    _, runs = sample_with_drafts(Sampler(), _logits([6]), [a], {"a": _logits([0, 4, 5])}, drafts)
    assert runs["a"] == [(0, None)]


def test_split_extra_rows_keeps_prompt_rows_in_order():
    a, b, c = _req("a", [1] * 5), _req("b", [1]), _req("c", [1] * 4)
    extra = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 3)
    prompt, drafts = split_extra_rows([(a, 5), (b, 3), (c, 4)], [2, 0, 1], {"b": [7, 8]}, extra)
    assert prompt[:, 0].tolist() == [0.0, 1.0, 4.0]
    assert list(drafts) == ["b"] and drafts["b"][:, 0].tolist() == [2.0, 3.0]


def test_rejection_rule_gives_the_plain_sampling_distribution():
    """Draw y ~ p and keep the draft when y equals it: the first kept token of 4,000 seeded
    requests follows p (chi-square, 5 categories, 4 dof: 18.47 is the 0.1% critical value),
    and so does the second token given an accepted first one."""
    vocab = 5
    p0 = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    p1 = torch.tensor([0.1, 0.1, 0.5, 0.2, 0.1])
    draft = [1, 2]  # the proposal: token 1, then 2
    row0, row1, last = p0.log(), p1.log(), torch.full((vocab,), -1.0)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    n = 4000
    for seed in range(n):
        r = _req(f"r{seed}", [0], max_tokens=9, temperature=1.0, seed=seed)
        _, runs = sample_with_drafts(Sampler(), last[None], [r], {r.request_id: torch.stack([row0, row1])},
                                     {r.request_id: draft})
        run = [t for t, _ in runs[r.request_id]]
        first[run[0]] += 1
        if run[0] == draft[0]:
            second[run[1]] += 1

    def chi2(counts, p):
        e = p * counts.sum()
        return float(((counts - e) ** 2 / e).sum())

    assert chi2(first, p0) < 18.47, first
    assert second.sum() > 800  # about p0[1] * n = 1000 rows reached position 1
    assert chi2(second, p1) < 18.47, second
    # reproducible: the same seed keeps the same run
    r1, r2 = (_req(x, [0], max_tokens=9, temperature=1.0, seed=7) for x in "xy")
    runs = [sample_with_drafts(Sampler(), last[None], [r], {r.request_id: torch.stack([row0, row1])},
                               {r.request_id: draft})[1][r.request_id] for r in (r1, r2)]
    assert runs[0] == runs[1]


# ---- the scheduler and the KV manager (no model) ---------------------------------------------

def _sched(num_blocks=16, prefix=False):
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64,
                                     max_model_len=128, enable_prefix_caching=prefix, num_speculative_tokens=3))


def _propose(s, k=3):
    """What the worker does after a step: the n-gram proposer's drafts for the scheduler's rows."""
    s.set_drafts(NgramProposer(k=k).propose([DraftRequest(*row) for row in s.draft_rows()[0]]))


def _decode_ready(s, prompt, first, rid="r", max_tokens=20):
    r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_time=0.0,
                max_total_tokens=128)
    s.add_request(r)
    out = s.schedule()  # the prefill
    s.update(out, {rid: (first, None)})
    _propose(s)
    return r


def test_lookahead_slots_then_rejected_blocks_return():
    """Prompt 1 2 3 4 1 2 (6 tokens, blocks of 4) + sampled 3: drafts 4 1 2 (after the
    earlier 1 2 3). The row computes positions 6 .. 9, so a third block is allocated; with one
    draft accepted 8 positions are computed: 2 blocks kept, the third released."""
    s = _sched()
    r = _decode_ready(s, [1, 2, 3, 4, 1, 2], 3)
    out = s.schedule()
    assert out.drafts == {"r": [4, 1, 2]} and out.scheduled == [(r, 4)]
    toks, starts, tables, sample = out.model_inputs()
    assert toks == [[3, 4, 1, 2]] and starts == [6] and sample == [True]
    assert out.extra_rows([0]) == [3]
    assert len(tables[0]) == 3
    third = tables[0][2]
    s.update(out, {}, (), {"r": [(4, None), (9, None)]})  # draft 4 accepted, then 9
    assert r.output_token_ids == [3, 4, 9] and r.num_computed_tokens == 8
    assert s.kv.get_block_ids("r") == tables[0][:2]
    assert s.kv.pool.blocks[third].ref_cnt == 0  # behind the closed fence: back in the pool
    st = s.stats
    assert (st.num_spec_rows, st.num_draft_tokens, st.num_accepted_tokens) == (1, 3, 1)
    check_invariants(s.kv)


def test_a_stop_inside_the_kept_run_ends_there():
    s = _sched()
    r = _decode_ready(s, [5, 6, 7, 5, 6], 7, max_tokens=3)
    out = s.schedule()
    assert out.drafts["r"] == [5]  # max_tokens 3, 1 output so far: 1 draft + 1 sampled
    s.update(out, {}, (), {"r": [(5, None), (8, None)]})
    assert r.output_token_ids == [7, 5, 8] and r.status.finished
    assert s.kv.num_used_blocks == 0


def test_no_room_for_lookahead_is_a_plain_decode():
    s = _sched(num_blocks=2)  # 8 slots: prompt 7 + 1 output fill them
    r = _decode_ready(s, [1, 2, 3, 1, 2, 3, 1], 2)
    out = s.schedule()
    assert out.drafts == {} and out.scheduled == [(r, 1)]


def test_prefix_cache_publishes_only_confirmed_blocks():
    s = _sched(prefix=True)
    r = _decode_ready(s, [1, 2, 3, 4, 1, 2, 3], 4)  # 1 2 3 4 again: drafts 1 2 3
    out = s.schedule()
    assert out.drafts["r"] == [1, 2, 3]
    table = list(out.block_ids[0])
    s.update(out, {}, (), {"r": [(9, None)]})  # the first draft rejected
    assert r.num_computed_tokens == 8
    hashed = [s.kv.pool.blocks[b].block_hash is not None for b in s.kv.get_block_ids("r")]
    assert hashed == [True, True]  # blocks 0-1 hold positions 0..7, all confirmed
    assert len(table) == 3 and s.kv.pool.blocks[table[2]].block_hash is None
