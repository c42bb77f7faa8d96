"""Sampler arithmetic on hand-made logits: filters, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import torch

from pagedkv.engine.request import Request, SamplingParams
from pagedkv.engine.sampler import Sampler, _filter_probs, apply_penalties

P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])


def req(params, prompt=(1, 2), out=()):
    r = Request("r", list(prompt), params, 0.0)
    for t in out:
        r.append_output_token(t)
    return r


def test_filters_exact():
    rows = P.expand(3, 5).clone()
    got = _filter_probs(rows, [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(min_p=0.3)])
    assert torch.equal(got[0], torch.tensor([0.5, 0.2, 0.0, 0.0, 0.0]))
    assert torch.equal(got[1], torch.tensor([0.5, 0.2, 0.0, 0.0, 0.0]))  # 0.5 + 0.2 reaches 0.7
    assert torch.allclose(got[2], torch.tensor([0.5, 0.2, 0.15, 0.0, 0.0]))  # >= 0.3 * 0.5


def test_top_p_always_keeps_top_token_and_handles_unsorted_rows():
    row = torch.tensor([[0.05, 0.1, 0.5, 0.2, 0.15]])
    assert torch.equal(_filter_probs(row, [SamplingParams(top_p=0.01)])[0], torch.tensor([0, 0, 0.5, 0, 0]))
    assert torch.allclose(_filter_probs(row, [SamplingParams(top_p=0.75)])[0], torch.tensor([0, 0, 0.5, 0.2, 0.15]))


def test_penalties_exact():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    r = req(SamplingParams(repetition_penalty=2.0), prompt=(0, 1), out=())
    assert torch.equal(apply_penalties(logits.clone(), r), torch.tensor([1.0, -4.0, 1.0, 0.5]))
    r = req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(0,), out=(2, 2, 3))
    assert torch.equal(apply_penalties(logits.clone(), r), torch.tensor([2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]))


def test_greedy_and_logprobs():
    logits = torch.log(P).unsqueeze(0).repeat(2, 1)
    s = Sampler()
    out = s(logits, [req(SamplingParams(temperature=0, logprobs=2)), req(SamplingParams(temperature=0))])
    assert out.token_ids == [0, 0]
    assert set(out.logprobs[0]) == {0, 1}
    assert math.isclose(out.logprobs[0][0], math.log(0.5), rel_tol=1e-5)
    assert out.logprobs[1] is None


def test_seeded_rows_independent_of_batch_and_position():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    s = Sampler()
    alone = [s(logits, [req(SamplingParams(temperature=1.0, seed=42))]).token_ids[0] for _ in range(1)]
    r = req(SamplingParams(temperature=1.0, seed=42))
    others = [req(SamplingParams(temperature=0.7, seed=i)) for i in range(5)]
    batch = s(logits.repeat(6, 1), others[:3] + [r] + others[3:])
    assert batch.token_ids[3] == alone[0]
    # the draw follows the distribution: with top_k=1 only the argmax can come out
    t = s(logits, [req(SamplingParams(temperature=5.0, top_k=1, seed=1))]).token_ids[0]
    assert t == int(logits.argmax())
