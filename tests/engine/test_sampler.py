"""Sampler arithmetic on hand-made logits: filters, penalties, logit_bias, seeds, logprobs, and
the guard that turns a non-finite logit or logprob into a typed error."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.ops import sample_ops
from pagedkv.engine.request import Request, SamplingParams
from pagedkv.engine.sampler import (_PICK_BLOCK, Sampler, SamplingError, _filter_probs, _inverse_cdf_pick, _uniforms,
                                    apply_logit_bias, apply_penalties)
from pagedkv.errors import InvalidRequestError

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
    others[1] = req(SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=9))  # a filtered neighbour
    batch = s(logits.repeat(6, 1), others[:3] + [r] + others[3:])
    assert batch.token_ids[3] == alone[0]
    # the draw follows the distribution: with top_k=1 only the argmax can come out
    t = s(logits, [req(SamplingParams(temperature=5.0, top_k=1, seed=1))]).token_ids[0]
    assert t == int(logits.argmax())


# ---- logit_bias, parameter bounds and the non-finite guard ------------------
def test_logit_bias_exact_and_changes_the_pick():
    logits = torch.log(P)
    r = req(SamplingParams(temperature=0, logit_bias={4: 3.0, 0: -1.5}))
    got = apply_logit_bias(logits.clone(), r)
    assert torch.allclose(got, logits + torch.tensor([-1.5, 0, 0, 0, 3.0]))
    out = Sampler()(logits.unsqueeze(0), [r])
    assert out.token_ids == [4]  # log 0.05 + 3 > log 0.5 - 1.5
    with pytest.raises(SamplingError) as e:  # an id outside the vocabulary, caught at the sampler
        Sampler()(logits.unsqueeze(0), [req(SamplingParams(logit_bias={5: 1.0}))])
    assert e.value.request_ids == ["r"]


def test_validate_bounds_what_could_overflow():
    for bad in (dict(repetition_penalty=1e-300), dict(repetition_penalty=101.0), dict(repetition_penalty=float("nan")),
                dict(logit_bias={1: 100.5}), dict(logit_bias={1: float("inf")}), dict(logit_bias={-1: 1.0}),
                dict(logit_bias={True: 1.0}), dict(logit_bias={i: 1.0 for i in range(301)}),
                dict(logit_bias=[(1, 1.0)]), dict(beam_width=2, logit_bias={1: 1.0})):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad).validate()
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).validate(vocab_size=100)
    SamplingParams(repetition_penalty=0.01, logit_bias={99: -100, 0: 100}).validate(vocab_size=100)


def test_guard_turns_non_finite_logits_into_a_typed_error_for_those_rows_only():
    logits = torch.log(P).repeat(3, 1)
    logits[1, 2] = float("nan")
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=0.5, logprobs=1), 0.0) for i in range(3)]
    with pytest.raises(SamplingError) as e:
        Sampler()(logits, reqs)
    assert e.value.request_ids == ["r1"]
    logits[1, 2] = float("inf")
    logits[2] = float("-inf")  # no token left at all
    with pytest.raises(SamplingError) as e:
        Sampler()(logits, reqs)
    assert e.value.request_ids == ["r1", "r2"]


def test_masked_tokens_are_left_out_of_logprobs():
    logits = torch.log(P).unsqueeze(0)
    logits[0, 3:] = float("-inf")  # e.g. vocabulary padding
    out = Sampler()(logits, [req(SamplingParams(temperature=0, logprobs=5))])
    assert set(out.logprobs[0]) == {0, 1, 2} and all(math.isfinite(v) for v in out.logprobs[0].values())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rep=st.sampled_from([0.01, 0.5, 1.0, 2.0, 100.0]), temp=st.sampled_from([0.0, 1e-5, 0.7, 2.0]),
       freq=st.floats(-2, 2), pres=st.floats(-2, 2), bias=st.floats(-100, 100), scale=st.sampled_from([1.0, 30.0, 1e4]),
       top_p=st.floats(0.01, 1.0), seed=st.integers(0, 2**63 - 1))
def test_no_allowed_parameters_give_a_non_finite_logprob(rep, temp, freq, pres, bias, scale, top_p, seed):
    """Every value validate() accepts, over logits as large as 1e4: finite logprobs."""
    V = 64
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed % 1000)) * scale
    params = SamplingParams(temperature=temp, top_p=top_p, repetition_penalty=rep, frequency_penalty=freq,
                            presence_penalty=pres, logit_bias={3: bias, 7: -bias}, seed=seed, logprobs=5)
    params.validate(vocab_size=V)
    out = Sampler()(logits, [req(params, prompt=tuple(range(0, V, 2)), out=(1, 1, 5, 9))])
    assert 0 <= out.token_ids[0] < V
    assert all(math.isfinite(v) and v <= 0 for v in out.logprobs[0].values())


def test_greedy_takes_the_first_maximum_in_all_greedy_and_mixed_batches():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, -1.0, 0.0], [5.0, 0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0)
    assert Sampler()(logits, [req(greedy)] * 3).token_ids == [1, 0, 0]
    # a sampled row between greedy ones: the greedy rows still get their own first maxima
    one_hot = SamplingParams(temperature=1.0, top_k=1)
    out = Sampler()(logits, [req(greedy), req(one_hot), req(greedy)])
    assert out.token_ids[0] == 1 and out.token_ids[1] in (0, 1) and out.token_ids[2] == 0


# ---- inverse-CDF sampling (one uniform per token instead of vocab exponentials) ----
def _c_pick(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    ops = sample_ops.get()
    assert ops is not None, sample_ops.build_error()  # a C compiler is part of the set-up
    return ops.inverse_cdf_pick(probs, u, _PICK_BLOCK)


PICKS = [pytest.param(_inverse_cdf_pick, id="torch"), pytest.param(_c_pick, id="c")]


@pytest.mark.parametrize("pick_rows", PICKS)
def test_inverse_cdf_picks_at_the_cumulative_boundaries(pick_rows):
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]])  # cumsum 0, .5, .5, .75, 1, 1
    pick = lambda u: pick_rows(probs, torch.tensor([u], dtype=torch.float64))[0]
    assert [pick(u) for u in (0.0, 0.25, 0.4999, 0.5, 0.74, 0.75, 0.99)] == [1, 1, 1, 3, 3, 4, 4]
    # the largest double below 1 (u * total rounds up to total in fp32): still the last kept token
    assert pick(1.0 - 2.0 ** -53) == 4
    # unnormalised rows (filters leave them so): u scales by the row total
    assert pick_rows(torch.tensor([[2.0, 0.0, 6.0]]), torch.tensor([0.2499], dtype=torch.float64)) == [0]
    assert pick_rows(torch.tensor([[2.0, 0.0, 6.0]]), torch.tensor([0.25], dtype=torch.float64)) == [2]


@pytest.mark.parametrize("pick_rows", PICKS)
def test_inverse_cdf_follows_the_distribution_and_never_picks_a_masked_token(pick_rows):
    """20,000 seeded draws over 6 tokens (two masked): Pearson's chi-square over the four kept
    tokens below 16.27 (3 degrees of freedom, p = 0.001), no masked token ever."""
    p = torch.tensor([0.0, 0.4, 0.3, 0.0, 0.2, 0.1])
    n = 20_000
    g = torch.Generator().manual_seed(7)
    picks = pick_rows(p.expand(n, 6).contiguous(), _uniforms([g] * n))
    counts = torch.bincount(torch.tensor(picks), minlength=6).double()
    assert counts[0] == 0 and counts[3] == 0 and counts.sum() == n
    kept = p > 0
    expected = p[kept].double() * n
    chi2 = float((((counts[kept] - expected) ** 2) / expected).sum())
    assert chi2 < 16.27, (counts.tolist(), chi2)


@pytest.mark.parametrize("pick_rows", PICKS)
def test_a_full_vocabulary_row_keeps_its_tail_mass(pick_rows):
    """49,152 tokens, three heads (0.5, 0.3, 0.1) and a flat tail of 0.1: each share within
    4 standard deviations over 20,000 draws; the tail is spread, not lost to rounding."""
    V, n = 49_152, 20_000
    p = torch.full((V,), 0.1 / (V - 3))
    p[[100, 20_000, V - 1]] = torch.tensor([0.5, 0.3, 0.1])
    g = torch.Generator().manual_seed(3)
    # in chunks of 2,000 rows: one 20,000 x 49,152 batch takes ~12 GB in the torch path, enough
    # to get a test worker killed by the OOM killer on a 24 GB host that runs anything else
    chunk = 2_000
    picks = torch.cat([torch.tensor(pick_rows(p.expand(chunk, V).contiguous(), _uniforms([g] * chunk)))
                       for _ in range(n // chunk)])
    for tok, share in ((100, 0.5), (20_000, 0.3), (V - 1, 0.1)):
        got = float((picks == tok).double().mean())
        assert abs(got - share) < 4 * math.sqrt(share * (1 - share) / n), (tok, got)
    tail = ~((picks == 100) | (picks == 20_000) | (picks == V - 1))
    assert abs(float(tail.double().mean()) - 0.1) < 4 * math.sqrt(0.09 / n)
    assert int(torch.unique(picks[tail]).numel()) > 1500  # ~2,000 tail draws over 49,149 tokens


@pytest.mark.parametrize("pick_rows", PICKS)
def test_every_positive_token_is_reachable_at_its_fp64_share(pick_rows):
    """Rows of 600 tokens (three blocks of the two-level search, the last padded) with shares
    down to 1e-12 next to 0.5, zeros between, some across block boundaries: a target in the
    middle of each token's fp64 interval picks exactly that token (an fp32 cumulative sum
    rounded 1e-8 away entirely and doubled 3e-8)."""
    V = 600
    p = torch.zeros(V)
    p[[0, 1, 2, 255, 256, 257, 300, 511, 512, 599]] = torch.tensor(
        [0.5, 1e-8, 3e-8, 1e-12, 2e-12, 0.25, 1e-9, 0.125, 3e-10, 0.125 - 4e-8])
    cum = torch.cumsum(p.double(), 0)
    total = float(cum[-1])
    for k in p.nonzero().flatten().tolist():
        lo = float(cum[k - 1]) if k else 0.0
        u = torch.tensor([(lo + float(cum[k])) / 2 / total], dtype=torch.float64)
        assert pick_rows(p[None], u) == [k]
    assert pick_rows(p[None], torch.tensor([1.0 - 2.0 ** -53], dtype=torch.float64)) == [599]


def test_the_c_picks_return_the_torch_tokens():
    """300 seeded batches of 1-5 rows (vocab 1 to 49,152, the last block partial, -inf logits,
    masked probabilities, ties) and 8-row batches of 49,152 (the OpenMP path): the C first
    maximum is torch's max(dim).indices and the C inverse-CDF pick is _inverse_cdf_pick, token
    for token (they may differ only where a target is within an fp64 rounding of a boundary,
    about one draw in 2^52: none here)."""
    ops = sample_ops.get()
    assert ops is not None, sample_ops.build_error()
    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        R, V = 1 + trial % 5, (49_152, 600, 257, 7, 1)[trial % 5]
        x = torch.randn(R, V, generator=g) * (trial % 7 + 0.1)
        if trial % 3 == 0:
            x[:, ::5] = float("-inf")
            x[:, V // 2] = 9.0
            x[:, -1] = 9.0  # a tie: the first one wins
        p = torch.softmax(x, -1)
        if trial % 4 == 0:
            p[:, 1::2] = 0.0
            p[:, 0] += 1e-3
        u = _uniforms([g] * R)
        assert ops.argmax_rows(x) == x.max(dim=-1).indices.tolist(), trial
        assert ops.inverse_cdf_pick(p, u, _PICK_BLOCK) == _inverse_cdf_pick(p, u), trial
    for trial in range(5):  # 8 rows: one per thread
        x = torch.randn(8, 49_152, generator=g) * 3
        x[3, 7] = x[3, 40_000] = 50.0  # a tie across blocks: the first one
        p = torch.softmax(x, -1)
        u = _uniforms([g] * 8)
        assert ops.argmax_rows(x) == x.max(dim=-1).indices.tolist() and ops.argmax_rows(x)[3] == 7
        assert ops.inverse_cdf_pick(p, u, _PICK_BLOCK) == _inverse_cdf_pick(p, u), trial
    with pytest.raises(ValueError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit column stride"):
        ops.argmax_rows(torch.zeros(4, 2).t())
    with pytest.raises(ValueError, match="float64"):
        ops.inverse_cdf_pick(torch.ones(2, 4), torch.zeros(2), _PICK_BLOCK)
    with pytest.raises(ValueError, match="block"):
        ops.inverse_cdf_pick(torch.ones(2, 4), torch.zeros(2, dtype=torch.float64), 0)


def test_the_sampler_gives_the_same_tokens_with_and_without_the_c_picks(monkeypatch):
    """A mixed batch (greedy rows gathered between sampled ones, temperature, top-k, top-p,
    seeded and not) through the Sampler, with the C picks and with torch's (``sample_ops.get``
    -> None): the same tokens."""
    assert sample_ops.get() is not None, sample_ops.build_error()  # else both runs are torch's
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(7, 49_152, generator=g) * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.7, seed=2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=50, seed=3), SamplingParams(temperature=1.3, top_p=0.9, seed=4),
              SamplingParams(temperature=1.0)]

    def run() -> list[list[int]]:
        reqs = [req(p) for p in params]
        sampler = Sampler(torch.Generator().manual_seed(0))
        return [sampler(logits, reqs).token_ids for _ in range(20)]

    with_c = run()
    assert [step[0] for step in with_c] == [int(logits[0].argmax())] * 20
    assert [step[3] for step in with_c] == [int(logits[3].argmax())] * 20
    monkeypatch.setattr(sample_ops, "get", lambda: None)
    assert run() == with_c
    assert len({tuple(step) for step in with_c}) > 1  # the sampled rows did move


def test_top_p_one_cuts_nothing_so_a_neighbours_filter_cannot_move_a_row():
    """fp32 rows can sum a little above 1: top_p = 1.0 once dropped the tokens whose mass before
    them reached 1, so an unfiltered row lost its tail whenever another row of the batch had a
    filter (and its seeded tokens then depended on the batch)."""
    row = torch.tensor([[0.5, 0.50000006, 1e-7, 2e-7]])
    assert torch.equal(_filter_probs(row, [SamplingParams()]), row)
    probs = torch.softmax(torch.randn(1, 200_000, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    both = _filter_probs(torch.cat([probs, probs]), [SamplingParams(), SamplingParams(top_k=40)])
    assert torch.equal(both[0], probs[0]) and int((both[1] > 0).sum()) == 40


def test_a_sampled_token_consumes_one_random_number_of_its_requests_generator():
    logits = torch.randn(1, 4096, generator=torch.Generator().manual_seed(1))
    r = req(SamplingParams(temperature=0.8, top_p=0.9, seed=123))
    s = Sampler()
    for _ in range(3):
        s(logits, [r])
    ref = torch.Generator().manual_seed(123)
    torch.rand(3, dtype=torch.float64, generator=ref)
    assert torch.equal(r.generator.get_state(), ref.get_state())
