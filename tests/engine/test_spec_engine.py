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


def test_spec_counters_on_metrics(loaded_model, prompt_ids):
    """The four pagedkv_spec_decode_* families /metrics exports equal the engine's stats."""
    from pagedkv.serving.metrics import _EngineCollector

    _, st, eng = run(loaded_model, [prompt_ids], greedy(24), speculative="ngram")
    got = {m.name: m.samples[0].value for m in _EngineCollector(eng, "m").collect()
           if m.name.startswith("pagedkv_spec_decode")}
    assert st.num_accepted_tokens > 0
    assert got == {"pagedkv_spec_decode_draft_tokens": st.num_draft_tokens,
                   "pagedkv_spec_decode_accepted_tokens": st.num_accepted_tokens,
                   "pagedkv_spec_decode_acceptance_rate": pytest.approx(st.spec_acceptance_rate),
                   "pagedkv_spec_decode_mean_accepted_length": pytest.approx(st.spec_mean_accepted_length)}


def test_mixed_batch_with_prompt_logprobs_and_penalty_rows(loaded_model, prompt_ids):
    """A speculating row in the same steps as a chunked prefill returning prompt logprobs and a
    row with a repetition penalty (which never speculates): every output as without speculation."""
    def go(**kw):
        llm = LLM(loaded_model, num_blocks=128, block_size=16, max_num_batched_tokens=24,
                  debug_invariants=True, **kw)
        eng = llm.engine
        eng.add_request("spec", prompt_ids[:40], greedy(30, ignore_eos=True))
        for _ in range(3):  # its prefill, then decoding
            eng.step()
        eng.add_request("plp", prompt_ids[5:50], greedy(8, prompt_logprobs=1, ignore_eos=True))
        eng.add_request("pen", prompt_ids[:20], greedy(20, repetition_penalty=1.3, ignore_eos=True))
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
        assert eng.kv.num_used_blocks == 0
        return outs, eng.get_stats()

    off, _ = go()
    on, st = go(speculative="ngram")
    assert st.num_accepted_tokens > 0
    for rid in ("spec", "plp", "pen"):
        assert on[rid].outputs[0].token_ids == off[rid].outputs[0].token_ids, rid
    a, b = on["plp"].prompt_logprobs, off["plp"].prompt_logprobs
    assert a[0] is None and b[0] is None and len(a) == len(b) == len(prompt_ids[5:50])
    for x, y in zip(a[1:], b[1:]):
        assert list(x) == list(y) and [x[t] for t in x] == pytest.approx([y[t] for t in y], abs=1e-3)


def test_counters_pinned_across_the_proposer_move(loaded_model, prompt_ids, hf_tokenizer):
    """The n-gram proposer moved to the worker side (drafting after a step instead of inside
    schedule()) without changing what is drafted, verified or accepted: 11 prompts x 32 greedy
    tokens in a pool of 14 blocks (a preemption) give 15 speculative rows, 60 drafts, 48
    accepted in 47 steps, as measured with the scheduler-side proposer before the move (with
    256 blocks: 15, 60, 49 in 26 steps; the tokens are the plain engine's in both)."""
    free = hf_tokenizer("Write a short story about a lighthouse keeper who finds a message in a bottle.",
                        add_special_tokens=False)["input_ids"]
    prompts = [prompt_ids, prompt_ids[:15], prompt_ids[:16], prompt_ids[:17], free] + [
        prompt_ids[: 20 + 3 * i] for i in range(6)]
    _, st, eng = run(loaded_model, prompts, greedy(32), num_blocks=14, speculative="ngram")
    got = (st.num_spec_rows, st.num_draft_tokens, st.num_accepted_tokens, st.num_preemptions,
           eng.scheduler.stats.num_steps)
    assert got == (15, 60, 48, 1, 47)
