"""Speculative decoding with a draft model (pagedkv.worker.draft_proposer): the draft's greedy
tokens and its own paged KV (longest-common-prefix bookkeeping, batched forwards, blocks
freed), and through the engine greedy output identical with it on and off (block
boundaries, preemption, abort, n > 1 seeded sampling), 0 draft blocks afterwards, and
ConfigErrors for another tokenizer or a missing model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.engine.cli import add_engine_args, engine_kwargs
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.errors import ConfigError
from pagedkv.kv import check_invariants
from pagedkv.testing.tiny import tiny_random_model
from pagedkv.worker.draft_proposer import DraftModelProposer, check_same_tokenizer
from pagedkv.worker.proposer import DraftRequest, draft_model_name
from pagedkv.worker.worker import Worker

TEXT = ("Repeat this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, figs. "
        "Again: apples, pears, plums, cherries, grapes, lemons, limes, figs. Again: apples, pears,")
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
DRAFT = dict(speculative="draft:smollm2", draft_weights="fp32")


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer):
    return hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def free_ids(hf_tokenizer):
    return hf_tokenizer(FREE, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def tiny(loaded_model):
    return tiny_random_model(loaded_model, seed=3)


def _proposer(model, num_blocks=32, k=4, max_len=4096):
    worker = Worker(model.model, model.config, get_backend("cpu"), loaded=model)
    worker.init_cache(num_blocks, 16, torch.float32)
    return DraftModelProposer(worker, k, num_blocks, 16, max_len)


def _one(p, ctx, most, rid):
    """``p``'s drafts for one request ``rid`` (context ``ctx``, at most ``most``), the others kept."""
    return p.propose_batch([DraftRequest(rid, ctx, most)])[rid]


def _kv(p, rid):
    """The first and last layers' K and V of ``rid``'s held tokens in the draft's cache."""
    ids, r = p.kv.get_block_ids(rid), p.worker.runner
    slots = torch.tensor([ids[i // 16] * 16 + i % 16 for i in range(len(p.held[rid]))])
    return [t for cache in (r.kv_caches[0], r.kv_caches[-1]) for t in r.backend.gather_kv(cache, slots)]


def _greedy_continuation(model, ids, n):
    eng = LLMEngine(model, block_size=16, num_blocks=64)
    eng.add_request("g", list(ids), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                return list(o.outputs[0].token_ids)


def run(model, prompts, params, **kw):
    kw.setdefault("num_blocks", 256)
    llm = LLM(model, block_size=16, debug_invariants=True, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    assert not eng.has_unfinished_requests() and eng.kv.num_used_blocks == 0
    check_invariants(eng.kv)
    if isinstance(eng.proposer, DraftModelProposer):  # the draft's own pool is empty too
        assert eng.proposer.num_used_blocks == 0 and eng.proposer.held == {}
        check_invariants(eng.proposer.kv)
    return outs, eng.get_stats(), eng


def greedy(n=40, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


# ---- the proposer alone (tiny random model) -------------------------------------------------
def test_drafts_are_the_draft_models_greedy_tokens_and_its_kv_follows_the_context(tiny):
    ctx = [(i * 37 + 3) % 3000 + 5 for i in range(21)]
    want = _greedy_continuation(tiny, ctx, 6)
    p = _proposer(tiny)
    d = _one(p, ctx, 4, "a")
    assert d == want[:4]
    # it holds the context and the 3 drafts fed back: 24 tokens in 2 blocks of 16
    assert p.held["a"] == ctx + d[:3] and p.kv.num_tokens("a") == 24 and p.num_used_blocks == 2
    assert p.num_forwards == 4  # one catch-up forward, three one-token decodes
    # two drafts accepted plus a token the draft did not propose: the common prefix (23
    # tokens) is kept, one token caught up, three more decodes
    other = (want[2] + 1) % 3000
    ctx2 = ctx + want[:2] + [other]
    d2 = _one(p, ctx2, 4, "a")
    assert d2 == _greedy_continuation(tiny, ctx2, 4)
    assert p.held["a"] == ctx2 + d2[:3] and p.num_forwards == 8
    # a shorter context (a recompute after preemption, say): trimmed to it, a block freed
    d3 = _one(p, ctx[:10], 2, "a")
    assert d3 == _greedy_continuation(tiny, ctx[:10], 2)
    assert p.held["a"] == ctx[:10] + d3[:1] and p.kv.num_tokens("a") == 11 and p.num_used_blocks == 1
    assert p.propose([]) == {} and p.held == {} and p.num_used_blocks == 0  # not running: freed
    check_invariants(p.kv)


def test_batched_drafts_equal_one_by_one_and_a_full_pool_drafts_nothing(tiny):
    a = [(i * 11 + 7) % 3000 + 5 for i in range(40)]
    b = [(i * 53 + 1) % 3000 + 5 for i in range(9)]
    alone = {rid: _one(_proposer(tiny), ctx, 3, rid) for rid, ctx in (("a", a), ("b", b))}
    p = _proposer(tiny)
    got = p.propose_batch([("a", a, 3), ("b", b, 3), ("c", b, 0)])
    assert got == {**alone, "c": []} and p.num_forwards == 3  # 1 catch-up + 2 decodes for both
    assert p.num_used_blocks == 3 + 1 and "c" not in p.held  # 42 and 11 tokens
    # 2 blocks: "a" (42 tokens) cannot get its 3, "b" fits; "a" proposes nothing, holds nothing
    small = _proposer(tiny, num_blocks=2)
    got = small.propose_batch([("a", a, 3), ("b", b, 3)])
    assert got == {"a": [], "b": alone["b"]} and list(small.held) == ["b"] and small.num_used_blocks == 1
    # the draft's context ends: positions past max_len are never drafted
    short = _proposer(tiny, max_len=11)
    assert _one(short, b, 4, "b") == alone["b"][:2]
    # its context grew past the draft's: it can never draft for it again, its blocks go back
    assert _one(short, b + alone["b"][:2], 4, "b") == [] and short.held == {} and short.num_used_blocks == 0


def test_after_a_step_it_drafts_no_more_than_a_step_can_verify(tiny):
    """A row verifies at most ``max_num_batched_tokens - 1`` drafts: with k = 10 and a budget of
    5 tokens the scheduler's rows ask for 4 and the proposer drafts 4 (4 forwards, 4 + 3 draft
    slots), not 10 it would discard; the drafts ride on the request to the next step."""
    ctx = [(i * 37 + 3) % 3000 + 5 for i in range(21)]
    req = Request(request_id="a", prompt_token_ids=ctx, sampling_params=greedy(100), arrival_time=0.0)
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, len(ctx) - 1
    s = Scheduler(SchedulerConfig(num_blocks=8, max_num_batched_tokens=5, max_model_len=4096,
                                  num_speculative_tokens=10))
    s.running.append(req)
    s.requests["a"] = req
    assert s.draft_rows() == [("a", ctx, 4)]
    p = _proposer(tiny, k=10)
    want = _greedy_continuation(tiny, ctx, 4)
    s.set_drafts(p.propose([DraftRequest(*row) for row in s.draft_rows()]))
    assert (req.draft_token_ids, req.draft_after) == (want, 21) and p.num_forwards == 4
    assert p.held["a"] == ctx + want[:3] and p.kv.num_tokens("a") == 24
    s.config.max_num_batched_tokens = 1  # no room for a draft in the step: none drafted, state kept
    assert p.propose([DraftRequest(*row) for row in s.draft_rows()]) == {"a": []} and p.num_forwards == 4
    assert p.held["a"] == ctx + want[:3]


_OPS = st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from(["accept", "decode", "shrink", "release"]),
                          st.integers(0, 4), st.integers(5, 2999)), min_size=1, max_size=12)


@settings(max_examples=20, deadline=None)
@given(ops=_OPS)
def test_random_accept_reject_sequences_keep_the_draft_kv_consistent(tiny, ops):
    """Random verify outcomes (m drafts accepted then another token), plain decode steps
    without a proposal, shrinking contexts
    (a sibling's, a recompute's) and releases: after every proposal each request's drafts equal
    a fresh proposer's from its whole context, it holds its context plus the drafts fed back,
    the pool's used blocks are exactly those tokens' blocks, and the invariant checker passes."""
    p = _proposer(tiny, num_blocks=32, k=4)
    ctx = {"a": [(i * 37 + 3) % 3000 + 5 for i in range(21)], "b": [(i * 7 + 1) % 3000 + 5 for i in range(16)]}
    last = {r: _one(p, c, 4, r) for r, c in ctx.items()}
    for rid, op, m, tok in ops:
        if op == "accept":
            ctx[rid] = ctx[rid] + last[rid][:m] + [tok]
        elif op == "decode":  # m + 1 plain decode steps (backing off): no proposal in between
            ctx[rid] = ctx[rid] + [(tok + 131 * j) % 3000 + 5 for j in range(m + 1)]
        elif op == "shrink":
            ctx[rid] = ctx[rid][:max(1, len(ctx[rid]) - 3 * m - 1)]
        else:
            p.release(rid)
            assert rid not in p.held
        last = p.propose_batch([(r, c, 1 + (m + i) % 4) for i, (r, c) in enumerate(ctx.items())])
        for r, c in ctx.items():
            d, fresh = last[r], _proposer(tiny, k=4)
            assert d == _one(fresh, c, len(d), r) and len(d) >= 1
            assert p.held[r] == fresh.held[r] == c + d[:-1] and p.kv.num_tokens(r) == len(c) + len(d) - 1
            # the K/V it kept and caught up are those of a computation from scratch
            for got, want in zip(_kv(p, r), _kv(fresh, r)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert p.num_used_blocks == sum(-(-len(h) // 16) for h in p.held.values())
        check_invariants(p.kv)
    p.retain(["b"])
    assert list(p.held) == ["b"] and p.num_used_blocks == -(-len(p.held["b"]) // 16)


def test_tokenizer_check_and_speculative_options(loaded_model):
    class Shifted:  # the same vocabulary size, other ids
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [t + 1 for t in loaded_model.tokenizer(text, add_special_tokens=False)["input_ids"]]}

    other = SimpleNamespace(config=loaded_model.config, tokenizer=Shifted())
    check_same_tokenizer(loaded_model, loaded_model, "t", "d")  # the same: no error
    with pytest.raises(ConfigError, match="draft model 'd' tokenizes .* the target 't'"):
        check_same_tokenizer(loaded_model, other, "t", "d")
    assert draft_model_name("draft:smollm2-135m") == "smollm2-135m" and draft_model_name("ngram") is None
    EngineConfig.from_kwargs({"speculative": "draft:x.gguf"})  # checked, not loaded: the engine loads it
    with pytest.raises(ConfigError, match="needs a model path"):
        EngineConfig.from_kwargs({"speculative": "draft:"})
    with pytest.raises(ConfigError, match="draft_weights"):
        EngineConfig.from_kwargs({"speculative": "draft:x", "draft_weights": "int3"})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig.from_kwargs({"speculative": "draft:x", "num_speculative_tokens": 0})
    import argparse

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    kw = engine_kwargs(ap.parse_args(["--speculative", "draft:smollm2-135m", "--draft-weights", "int4"]))
    assert (kw["speculative"], kw["draft_weights"]) == ("draft:smollm2-135m", "int4")


# ---- through the engine (the bundled model as its own draft) ---------------------------------
def test_greedy_identical_with_the_model_as_its_own_draft(loaded_model, prompt_ids, free_ids):
    prompts = [prompt_ids, prompt_ids[:15], prompt_ids[:16], prompt_ids[:17], free_ids]
    plain, _, _ = run(loaded_model, prompts, greedy())
    spec, stats, eng = run(loaded_model, prompts, greedy(), **DRAFT)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert stats.num_spec_rows > 0 and stats.num_draft_tokens <= 4 * stats.num_spec_rows
    # fp32 target, fp32 draft of the same weights: the drafts are the target's own argmax
    assert stats.spec_acceptance_rate > 0.9
    assert stats.num_generated_tokens == sum(len(o.outputs[0].token_ids) for o in spec)
    assert eng.proposer.num_forwards > 0


def test_preemption_abort_and_seeded_n_samples(loaded_model, prompt_ids):
    prompts = [prompt_ids[: 20 + 3 * i] for i in range(6)]
    plain, _, _ = run(loaded_model, prompts, greedy(32))
    # a pool too small for all six: preemption by recompute (the draft's blocks freed, recomputed)
    spec, stats, _ = run(loaded_model, prompts, greedy(32), num_blocks=14, **DRAFT)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert stats.num_preemptions > 0 and stats.spec_acceptance_rate > 0.9
    # abort one of two mid-run: its draft blocks go at once, the other's tokens are unchanged
    eng = LLMEngine(loaded_model, block_size=16, num_blocks=64, debug_invariants=True, **DRAFT)
    eng.add_request("a", prompts[4], greedy(32))
    eng.add_request("b", prompts[5], greedy(32))
    for _ in range(4):
        eng.step()
    assert set(eng.proposer.held) == {"a", "b"}
    eng.abort_request("a")
    assert set(eng.proposer.held) == {"b"}
    assert eng.proposer.num_used_blocks == -(-len(eng.proposer.held["b"]) // 16)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert done["b"] == plain[5].outputs[0].token_ids
    a = done["a"]  # the aborted request's tokens so far: a prefix of its plain ones
    assert 0 < len(a) < 32 and a == plain[4].outputs[0].token_ids[:len(a)]
    assert eng.proposer.num_used_blocks == 0 and eng.kv.num_used_blocks == 0
    # seeded sampling with n = 3: the same seed gives the same tokens, alone or beside another request
    sp = SamplingParams(temperature=0.8, max_tokens=24, seed=11, n=3)
    (x,), st, _ = run(loaded_model, [prompt_ids], sp, **DRAFT)
    (y, _), _, _ = run(loaded_model, [prompt_ids, prompt_ids[:30]], [sp, greedy(8)], **DRAFT)
    assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
    assert len({tuple(c.token_ids) for c in x.outputs}) > 1 and st.num_accepted_tokens > 0


def test_another_tokenizer_or_a_missing_model_is_a_config_error(loaded_model, gemma3_gguf, tmp_path):
    with pytest.raises(ConfigError, match=r"draft model '.*gemma.*' has a vocabulary of 262144 tokens, the target "
                                          r"'SmolLM2-135M-Instruct-Q4_1' 49152"):
        LLMEngine(loaded_model, num_blocks=16, speculative=f"draft:{gemma3_gguf}", draft_weights="fp32")
    # the message says the draft's path was wrong (not the target's: both are "model" options)
    with pytest.raises(ConfigError, match=r"^speculative draft model '.*none\.gguf': .*does not exist"):
        LLMEngine(loaded_model, num_blocks=16, speculative=f"draft:{tmp_path / 'none.gguf'}")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConfigError, match=r"^speculative draft model '.*': .*has no config\.json"):
        LLMEngine(loaded_model, num_blocks=16, speculative=f"draft: {tmp_path} ")
