"""Speculative decoding on the bundled model: greedy tokens identical with it on and off
(across block boundaries, preemption, prefix hits, aborts, stop strings, logprobs), drafts
really accepted, no block left."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.kv import check_invariants

TEXT = ("Repeat this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, figs. "
        "Again: apples, pears, plums, cherries, grapes, lemons, limes, figs. Again: apples, pears,")


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer):
    return hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"]


def run(model, prompts, params, **kw):
    kw.setdefault("num_blocks", 256)
    llm = LLM(model, block_size=16, debug_invariants=True, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    assert not eng.has_unfinished_requests() and eng.kv.num_used_blocks == 0
    check_invariants(eng.kv)
    return outs, eng.get_stats(), eng


def greedy(n=40, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def test_greedy_tokens_identical_and_drafts_accepted(loaded_model, prompt_ids):
    prompts = [prompt_ids, prompt_ids[:15], prompt_ids[:16], prompt_ids[:17]]
    plain, _, _ = run(loaded_model, prompts, greedy())
    spec, stats, _ = run(loaded_model, prompts, greedy(), speculative="ngram", num_speculative_tokens=4)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert stats.num_spec_rows > 0 and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens <= 4 * stats.num_spec_rows
    assert stats.num_generated_tokens == sum(len(o.outputs[0].token_ids) for o in spec)
    assert 0.0 < stats.spec_acceptance_rate <= 1.0


def test_preemption_prefix_hits_and_abort_keep_the_tokens(loaded_model, prompt_ids):
    prompts = [prompt_ids[: 20 + 3 * i] for i in range(6)]
    plain, _, _ = run(loaded_model, prompts, greedy(32))
    # a pool too small for all six: preemption by recompute
    spec, stats, _ = run(loaded_model, prompts, greedy(32), num_blocks=14, speculative="ngram")
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert stats.num_preemptions > 0 and stats.num_accepted_tokens > 0
    # prefix caching: the same prompts twice, the second time from cached blocks
    llm = LLM(loaded_model, block_size=16, num_blocks=256, enable_prefix_caching=True, speculative="ngram",
              debug_invariants=True)
    for _ in range(2):
        outs = llm.generate(prompts[:3], greedy(32), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain[:3]]
    assert llm.engine.get_stats().kv_prefix_hits > 0
    # abort one of two mid-run: the other's tokens are unchanged, nothing leaks
    eng = llm.engine
    eng.add_request("a", prompts[4], greedy(32))
    eng.add_request("b", prompts[5], greedy(32))
    for _ in range(4):
        eng.step()
    eng.abort_request("a")
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert done["b"] == plain[5].outputs[0].token_ids
    assert eng.kv.num_used_blocks == 0


def test_stop_strings_logprobs_and_seeded_sampling(loaded_model, prompt_ids):
    params = greedy(40, stop=["cherries"], logprobs=2)
    (plain,), _, _ = run(loaded_model, [prompt_ids], params)
    (spec,), _, _ = run(loaded_model, [prompt_ids], params, speculative="ngram")
    a, b = plain.outputs[0], spec.outputs[0]
    assert (a.finish_reason, a.stop_reason) == ("stop", "cherries") and len(a.logprobs) == len(a.token_ids) > 2
    assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason, a.stop_reason)
    assert [sorted(d) for d in b.logprobs] == [sorted(d) for d in a.logprobs]
    for da, db in zip(a.logprobs, b.logprobs):
        for t in da:
            assert abs(da[t] - db[t]) < 1e-3
    # seeded sampling with n = 2: the same seed gives the same tokens, alone or with others
    sp = SamplingParams(temperature=0.8, max_tokens=24, seed=11, n=2)
    (x,), _, _ = run(loaded_model, [prompt_ids], sp, speculative="ngram")
    (y, _), _, _ = run(loaded_model, [prompt_ids, prompt_ids[:30]], [sp, greedy(8)], speculative="ngram")
    assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
