"""BeamSearch (pagedkv/engine/beam.py) on hand-made log-probabilities: candidates, forks,
hypotheses at EOS and at the length cap, and how length_penalty reorders them."""

import math

import pytest
import torch

from pagedkv.engine.beam import BeamSearch, beam_stop_ids
from pagedkv.engine.request import Request, RequestStatus, SamplingParams

EOS = 0


def _beam(rid, out):
    r = Request(rid, [9, 9], SamplingParams(beam_width=2), arrival_time=0.0, max_total_tokens=100)
    for t in out:
        r.append_output_token(t)
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = r.num_tokens
    return r


def _row(probs):
    return torch.tensor(probs, dtype=torch.float32).log()


def _offer_step(bs, rows):
    for b, p in zip(bs.beams, rows):
        bs.offer(b, _row(p))
    assert bs.ready()
    return bs.step()


def _search(length_penalty):
    """Vocab of 4, EOS = 0, beam_width 2, at most 3 new tokens."""
    bs = BeamSearch(2, 3, [EOS], length_penalty=length_penalty)
    root = _beam("r", [])
    bs.start(root)
    assert not bs.ready()  # no logits yet
    ch = _offer_step(bs, [[0.05, 0.5, 0.3, 0.15]])
    assert [(c.source.request_id, c.token) for c in ch] == [("r", 1), ("r", 2)]
    assert [float(c.logprob) for c in ch] == pytest.approx([math.log(0.5), math.log(0.3)], rel=1e-6)
    assert bs.hypotheses == [] and not bs.done
    b0, b1 = _beam("r", [1]), _beam("r#beam1", [2])
    bs.advance(ch, [b0, b1])
    # step 2: b0's EOS (0.5 * 0.6 = 0.30) ranks first -> a hypothesis; then b0+1 (0.125), b1+3 (0.12)
    ch = _offer_step(bs, [[0.6, 0.25, 0.1, 0.05], [0.1, 0.2, 0.3, 0.4]])
    assert [(c.source.request_id, c.token) for c in ch] == [("r", 1), ("r#beam1", 3)]
    assert [float(c.logprob) for c in ch] == pytest.approx([math.log(0.125), math.log(0.12)], rel=1e-6)
    assert [(h.token_ids, h.finish_reason) for h in bs.hypotheses] == [([1, EOS], "stop")]
    assert not bs.done
    bs.advance(ch, [_beam("r", [1, 1]), _beam("r#beam1", [2, 3])])
    # step 3 reaches max_new_tokens: the top 2 candidates finish, c1's EOS (0.12 * 0.7) and c0+3 (0.125 * 0.4)
    ch = _offer_step(bs, [[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.15, 0.05]])
    assert ch == [] and bs.done and bs.num_steps == 3
    return bs


def test_hypotheses_scored_by_length_penalty_one():
    res = _search(1.0).result()
    assert [(h.token_ids, h.finish_reason) for h in res] == [([1, EOS], "stop"), ([2, 3, EOS], "stop")]
    assert res[0].cumulative_logprob == pytest.approx(math.log(0.30), rel=1e-5)
    assert res[0].score == pytest.approx(math.log(0.30) / 2, rel=1e-5)
    assert res[1].score == pytest.approx(math.log(0.084) / 3, rel=1e-5)


def test_a_larger_length_penalty_favours_the_longer_hypothesis():
    res = _search(2.0).result()
    assert [h.token_ids for h in res] == [[2, 3, EOS], [1, EOS]]
    assert [h.score for h in res] == pytest.approx([math.log(0.084) / 9, math.log(0.30) / 4], rel=1e-5)


def test_length_cap_without_eos_finishes_with_reason_length():
    bs = BeamSearch(2, 1, [EOS])
    bs.start(_beam("r", []))
    assert _offer_step(bs, [[0.05, 0.5, 0.3, 0.15]]) == []
    assert bs.done
    assert [(h.token_ids, h.finish_reason) for h in bs.result()] == [([1], "length"), ([2], "length")]
    assert [h.score for h in bs.result()] == pytest.approx([math.log(0.5), math.log(0.3)], rel=1e-6)


def test_early_stopping_true_ends_once_beam_width_hypotheses_exist():
    bs = BeamSearch(2, 10, [EOS, 3], early_stopping=True)
    assert bs.candidates_per_step == 6  # (1 + 2 stop ids) * beam_width
    bs.start(_beam("r", []))
    ch = _offer_step(bs, [[0.4, 0.1, 0.15, 0.35]])  # both top candidates are stop tokens
    assert bs.done and [h.token_ids for h in bs.result()] == [[EOS], [3]]
    assert [c.token for c in ch] == [2, 1]  # what would have continued


def test_no_hope_of_improvement_ends_the_search():
    bs = BeamSearch(2, 10, [EOS])
    bs.start(_beam("r", []))
    ch = _offer_step(bs, [[0.5, 0.3, 0.15, 0.05]])  # EOS first: one hypothesis (log 0.5)
    assert not bs.done and [c.token for c in ch] == [1, 2]
    bs.advance(ch, [_beam("r", [1]), _beam("r#beam1", [2])])
    # hypotheses 0.3 * 0.9 = 0.27 and 0.15 * 0.8 = 0.12 (scores log(p) / 2); the best running
    # candidate (0.015, score log(0.015) / 2) cannot beat the worst kept one (log 0.5)
    ch = _offer_step(bs, [[0.9, 0.05, 0.03, 0.02], [0.8, 0.1, 0.06, 0.04]])
    assert bs.done and not bs.improvable
    assert [h.token_ids for h in bs.result()] == [[1, EOS], [EOS]]  # log(0.27)/2 > log(0.5)/1


def test_ready_needs_every_running_beam_computed():
    bs = BeamSearch(2, 5, [EOS])
    a, b = _beam("a", [1]), _beam("b", [2])
    bs.beams = [a, b]
    bs.offer(a, _row([0.25] * 4))
    assert not bs.ready()
    bs.offer(b, _row([0.25] * 4))
    assert bs.ready()
    b.status = RequestStatus.PREEMPTED
    assert not bs.ready()
    b.status, b.num_computed_tokens = RequestStatus.RUNNING, b.num_tokens - 1
    assert not bs.ready()


def test_beam_stop_ids():
    assert beam_stop_ids([2], False, [5, 2, 7]) == [2, 5, 7]
    assert beam_stop_ids([2], True, [5]) == [5]
    assert beam_stop_ids((2, 3), False, None) == [2, 3]
