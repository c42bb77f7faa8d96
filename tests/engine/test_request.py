"""SamplingParams validation and derived flags, Request token bookkeeping, RequestMetrics and
RequestOutput accessors (pagedkv/engine/request.py), with hand-made values only."""

import math

import pytest
import torch

from pagedkv.engine.request import (CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus,
                                    SamplingParams)
from pagedkv.errors import InvalidRequestError


def _bad(fragment, **kw):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw).validate()
    assert fragment in str(e.value), str(e.value)


def test_defaults_are_valid_and_derived_flags():
    p = SamplingParams()
    p.validate()
    assert (p.n, p.max_tokens, p.temperature, p.top_k) == (1, 16, 1.0, -1)
    assert not p.greedy and not p.use_beam_search and not p.uses_penalties and not p.uses_logit_bias
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(beam_width=2).use_beam_search
    assert SamplingParams(frequency_penalty=0.5).uses_penalties and SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(logit_bias={3: 1.0}).uses_logit_bias and not SamplingParams(logit_bias={}).uses_logit_bias


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


@pytest.mark.parametrize("kw, fragment", [
    ({"n": 0}, "SamplingParams.n: must be an integer >= 1, got 0"),
    ({"n": True}, "SamplingParams.n: must be an integer >= 1, got True"),
    ({"n": 65}, "SamplingParams.n: must be <= 64, got 65"),
    ({"temperature": -0.1}, "SamplingParams.temperature: must be >= 0, got -0.1"),
    ({"temperature": math.inf}, "SamplingParams.temperature: must be >= 0, got inf"),
    ({"top_p": 0.0}, "SamplingParams.top_p: must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "SamplingParams.top_p: must be in (0, 1], got 1.5"),
    ({"top_k": 2.0}, "SamplingParams.top_k: must be an integer, got 2.0"),
    ({"min_p": 1.01}, "SamplingParams.min_p: must be in [0, 1], got 1.01"),
    ({"repetition_penalty": 0.0}, "SamplingParams.repetition_penalty: must be in [0.01, 100], got 0.0"),
    ({"presence_penalty": 2.5}, "SamplingParams.presence_penalty: must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": math.nan}, "SamplingParams.frequency_penalty: must be in [-2, 2], got nan"),
    ({"max_tokens": 0}, "SamplingParams.max_tokens: must be an integer >= 1, got 0"),
    ({"logprobs": 21}, "SamplingParams.logprobs: must be an integer in [0, 20], got 21"),
    ({"prompt_logprobs": -1}, "SamplingParams.prompt_logprobs: must be an integer in [0, 20], got -1"),
    ({"seed": 2**63}, "SamplingParams.seed: must be an integer in [-2**63, 2**63)"),
    ({"seed": "7"}, "SamplingParams.seed: must be an integer in [-2**63, 2**63), got '7'"),
    ({"stop": ["ok", ""]}, "SamplingParams.stop: must be a list of non-empty strings"),
    ({"stop_token_ids": [1, -2]}, "SamplingParams.stop_token_ids: must be a list of token ids >= 0"),
    ({"beam_width": 0}, "SamplingParams.beam_width: must be an integer >= 1, got 0"),
    ({"beam_width": 65}, "SamplingParams.beam_width: must be <= 64, got 65"),
    ({"length_penalty": 101.0}, "SamplingParams.length_penalty: must be a number in [-100, 100], got 101.0"),
    ({"skip_special_tokens": 1}, "SamplingParams.skip_special_tokens: must be a bool, got 1"),
    ({"early_stopping": "always"}, "SamplingParams.early_stopping: must be False, True or 'never', got 'always'"),
    ({"structured": "json"}, "SamplingParams.structured: must be a StructuredSpec or None, got str"),
    ({"logit_bias": [1, 2]}, "SamplingParams.logit_bias: must be a dict of token id -> bias, got list"),
    ({"logit_bias": {-1: 1.0}}, "SamplingParams.logit_bias: token ids must be integers in [0, 9223372036854775808), got -1"),
    ({"logit_bias": {5: 100.5}}, "SamplingParams.logit_bias: biases must be numbers in [-100, 100], got 100.5 for token 5"),
    ({"logit_bias": {i: 0.0 for i in range(301)}}, "SamplingParams.logit_bias: at most 300 tokens, got 301"),
])
def test_each_bad_value_names_its_field(kw, fragment):
    _bad(fragment, **kw)


def test_caps_passed_by_the_engine():
    SamplingParams(n=8).validate(max_n=8)
    with pytest.raises(InvalidRequestError, match="SamplingParams.n: must be <= 4, got 8"):
        SamplingParams(n=8).validate(max_n=4)
    with pytest.raises(InvalidRequestError, match=r"must be an integer in \[0, 5\], got 6"):
        SamplingParams(logprobs=6).validate(max_logprobs=5)
    SamplingParams(logit_bias={99: -100.0}).validate(vocab_size=100)
    with pytest.raises(InvalidRequestError, match=r"token ids must be integers in \[0, 100\), got 100"):
        SamplingParams(logit_bias={100: 1.0}).validate(vocab_size=100)


def test_boundaries_are_inclusive_where_documented():
    SamplingParams(top_p=1.0, min_p=1.0, repetition_penalty=100.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, logprobs=0, prompt_logprobs=20, seed=-(2**63),
                   length_penalty=-100.0, early_stopping="never").validate()


@pytest.mark.parametrize("kw, fragment", [
    ({"n": 2}, "SamplingParams.n: must be 1 with beam search"),
    ({"presence_penalty": 0.5}, "SamplingParams.repetition_penalty: penalties are not supported with beam search"),
    ({"stop": ["x"]}, "SamplingParams.stop: stop strings are not supported with beam search"),
    ({"logprobs": 2}, "SamplingParams.logprobs: not supported with beam search"),
    ({"prompt_logprobs": 1}, "SamplingParams.prompt_logprobs: not supported with beam search"),
    ({"logit_bias": {1: 1.0}}, "SamplingParams.logit_bias: not supported with beam search"),
])
def test_beam_search_rejects_what_it_does_not_support(kw, fragment):
    _bad(fragment, beam_width=3, **kw)


def test_beam_search_accepts_stop_token_ids():
    SamplingParams(beam_width=3, stop_token_ids=[7], length_penalty=0.5).validate()


def test_status_finished_and_finish_reason():
    assert [s.finished for s in RequestStatus] == [False, False, False, True, True, True, True]
    r = Request("r", [1, 2, 3], SamplingParams(), arrival_time=0.0)
    assert r.finish_reason is None and not r.is_finished
    r.status = RequestStatus.FINISHED_LENGTH
    assert r.finish_reason == "length" and r.is_finished
    r.status = RequestStatus.FINISHED_ABORTED
    assert r.finish_reason == "abort"
    r.status = RequestStatus.FINISHED_ERROR  # a structured-output grammar failed at run time
    assert r.finish_reason == "error" and r.is_finished


def test_request_token_bookkeeping():
    prompt = [5, 6, 7]
    r = Request("r", prompt, SamplingParams(), arrival_time=1.0)
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (3, 3, 0)
    r.append_output_token(9)
    r.append_output_token(4, {4: -0.25, 8: -1.5})
    assert r.all_token_ids == [5, 6, 7, 9, 4] and r.output_token_ids == [9, 4]
    assert (r.num_tokens, r.num_output_tokens) == (5, 2)
    assert r.output_logprobs == [{4: -0.25, 8: -1.5}]  # only the token that came with logprobs
    assert prompt == [5, 6, 7]  # the caller's prompt list is not extended
    assert r.num_cached_tokens == -1 and r.status is RequestStatus.WAITING


def test_seeded_request_gets_its_own_generator():
    a = Request("a", [1], SamplingParams(seed=123), arrival_time=0.0)
    b = Request("b", [1], SamplingParams(seed=123), arrival_time=0.0)
    assert torch.equal(torch.rand(4, generator=a.generator), torch.rand(4, generator=b.generator))
    assert Request("c", [1], SamplingParams(), arrival_time=0.0).generator is None


class _Grammar:
    def __init__(self):
        self.seen = []

    def accept(self, t):
        self.seen.append(t)


def test_appended_tokens_reach_the_grammar():
    r = Request("r", [1], SamplingParams(), arrival_time=0.0, grammar=_Grammar())
    r.append_output_token(11)
    r.append_output_token(12)
    assert r.grammar.seen == [11, 12]


def test_metrics_ttft_and_hit_rate():
    m = RequestMetrics(arrival_time=10.0)
    assert m.ttft is None and m.prefix_hit_rate == 0.0
    m = RequestMetrics(arrival_time=10.0, first_token_time=10.25, prefix_query_tokens=32, prefix_hit_tokens=24)
    assert m.ttft == 0.25 and m.prefix_hit_rate == 0.75


def test_request_output_forwards_the_first_sample():
    outs = [CompletionOutput(0, "hi", [3, 4], "stop"), CompletionOutput(1, "yo", [5], None)]
    ro = RequestOutput("r", "p", [1, 2], outs, finished=False, metrics=RequestMetrics(0.0))
    assert (ro.text, ro.token_ids, ro.finish_reason) == ("hi", [3, 4], "stop")
    assert ro.num_cached_tokens == 0 and ro.prompt_logprobs is None
