"""Speculative decoding with a draft model (pagedkv.worker.draft_proposer): the draft's greedy
tokens and its K/V in the target's blocks (the longest prefix that matches tokens and block
ids kept, whole blocks another request filled shared, copy-on-write copies followed,
batched forwards, never a write past the row's slots), the scheduler's lookahead
reservation, and through the engine greedy output identical with it on and off (block
boundaries, preemption, abort, prefix hits, n > 1 seeded sampling), the pool sized for both
models' bytes, and ConfigErrors for another tokenizer or a missing model."""

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
from pagedkv.engine.spec_decode import reserve_draft_slots
from pagedkv.errors import ConfigError
from pagedkv.kv import KVCacheManager, check_invariants
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
    p = DraftModelProposer(worker, k, 16, max_len)
    p.init_cache(num_blocks, 16)
    return p


class Target:
    """The target's block tables for the proposer alone: a ``KVCacheManager`` whose rows get
    the slots the scheduler reserves (the context and the drafts' positions)."""

    def __init__(self, num_blocks=32):
        self.kv = KVCacheManager(num_blocks, 16)

    def row(self, rid, ctx, most):
        want, have = len(ctx) + most, self.kv.num_tokens(rid)
        if have > want:
            self.kv.trim(rid, want)
        elif have < want:
            self.kv.allocate_slots(rid, want - have, have)
        return DraftRequest(rid, list(ctx), most, self.kv.get_block_ids(rid))


def _one(p, ctx, most, rid, target=None):
    """``p``'s drafts for one request ``rid`` (context ``ctx``, at most ``most``), the others kept."""
    target = target or Target()
    return p.propose_batch([target.row(rid, ctx, most)])[rid]


def _kv(p, rid):
    """The first and last layers' K and V of ``rid``'s held tokens in the draft's cache."""
    ids, r = p.held_blocks[rid], p.worker.runner
    slots = torch.tensor([ids[i // 16] * 16 + i % 16 for i in range(len(p.held[rid]))])
    return [t for cache in (r.kv_caches[0], r.kv_caches[-1]) for t in r.backend.gather_kv(cache, slots)]


def _same_kv(p, rid, fresh):
    for got, want in zip(_kv(p, rid), _kv(fresh, rid)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _greedy_continuation(model, ids, n):
    eng = LLMEngine(model, block_size=16, num_blocks=64)
    eng.add_request("g", list(ids), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                return list(o.outputs[0].token_ids)


def run(model, prompts, params, **kw):
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 16)
    llm = LLM(model, debug_invariants=True, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    assert not eng.has_unfinished_requests() and eng.kv.num_used_blocks == 0
    check_invariants(eng.kv)
    if isinstance(eng.proposer, DraftModelProposer):  # nothing held for finished requests
        assert eng.proposer.held == {} and eng.proposer.held_blocks == {}
    return outs, eng.get_stats(), eng


def greedy(n=40, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


# ---- the proposer alone (tiny random model) -------------------------------------------------
def test_drafts_are_the_draft_models_greedy_tokens_and_its_kv_follows_the_context(tiny):
    ctx = [(i * 37 + 3) % 3000 + 5 for i in range(21)]
    want = _greedy_continuation(tiny, ctx, 6)
    p, t = _proposer(tiny), Target()
    d = _one(p, ctx, 4, "a", t)
    assert d == want[:4]
    # it holds the context and the 3 drafts fed back, in the target's 2 blocks (25 slots reserved)
    assert p.held["a"] == ctx + d[:3] and p.held_blocks["a"] == t.kv.get_block_ids("a") == [0, 1]
    assert p.num_forwards == 4  # one catch-up forward, three one-token decodes
    # two drafts accepted plus a token the draft did not propose: the common prefix (23
    # tokens) is kept, one token caught up, three more decodes
    other = (want[2] + 1) % 3000
    ctx2 = ctx + want[:2] + [other]
    d2 = _one(p, ctx2, 4, "a", t)
    assert d2 == _greedy_continuation(tiny, ctx2, 4)
    assert p.held["a"] == ctx2 + d2[:3] and p.num_forwards == 8
    fresh = _proposer(tiny)
    _one(fresh, ctx2, 4, "a")
    _same_kv(p, "a", fresh)
    # a shorter context (a recompute after preemption, say): cut to it
    d3 = _one(p, ctx[:10], 2, "a", t)
    assert d3 == _greedy_continuation(tiny, ctx[:10], 2)
    assert p.held["a"] == ctx[:10] + d3[:1] and p.held_blocks["a"] == [0]
    assert p.propose([]) == {} and p.held == {} == p.held_blocks  # not running: forgotten


def test_batched_drafts_equal_one_by_one_and_the_drafts_context_bounds_them(tiny):
    a = [(i * 11 + 7) % 3000 + 5 for i in range(40)]
    b = [(i * 53 + 1) % 3000 + 5 for i in range(9)]
    alone = {rid: _one(_proposer(tiny), ctx, 3, rid) for rid, ctx in (("a", a), ("b", b))}
    p, t = _proposer(tiny), Target()
    got = p.propose_batch([t.row("a", a, 3), t.row("b", b, 3), t.row("c", b, 0)])
    assert got == {**alone, "c": []} and p.num_forwards == 3  # 1 catch-up + 2 decodes for both
    assert "c" not in p.held and p.held_blocks["a"] == [0, 1, 2] and p.held_blocks["b"] == [3]
    # the draft's context ends: positions past max_len are never drafted
    short = _proposer(tiny, max_len=11)
    assert _one(short, b, 4, "b") == alone["b"][:2]
    # its context grew past the draft's: it can never draft for it again, its state goes
    assert _one(short, b + alone["b"][:2], 4, "b") == [] and short.held == {}


def test_a_changed_block_is_recomputed_and_a_block_another_request_filled_is_shared(tiny):
    a = [(i * 11 + 7) % 3000 + 5 for i in range(40)]
    p, t = _proposer(tiny), Target()
    _one(p, a, 3, "a", t)
    assert t.kv.get_block_ids("a") == [0, 1, 2] and p.num_shared_tokens == 0
    # "b" shares a's first two blocks (a prefix hit or a fork): their 32 tokens' draft K/V is a's
    t.kv.fork("a", "b")
    t.kv.trim("b", 32)
    b = a[:32] + [(i * 53 + 1) % 3000 + 5 for i in range(9)]
    db = p.propose_batch([t.row("a", a, 0), t.row("b", b, 3)])["b"]
    assert t.kv.get_block_ids("b") == [0, 1, 3] and p.num_shared_tokens == 32
    fresh = _proposer(tiny)
    assert db == _one(fresh, b, 3, "b") and p.held["b"] == fresh.held["b"]
    _same_kv(p, "b", fresh)
    # a's blocks past the first given back and others taken: the tokens still match but the
    # blocks do not, so their K/V is computed again
    before = p.num_shared_tokens
    da = p.propose_batch([DraftRequest("a", a, 3, [0, 9, 10])])["a"]
    assert p.held_blocks["a"] == [0, 9, 10] and p.num_shared_tokens == before
    fresh = _proposer(tiny)
    assert da == _one(fresh, a, 3, "a")
    _same_kv(p, "a", fresh)


def test_copy_on_write_copies_reach_the_draft_caches_and_nothing_is_written_past_the_slots(tiny):
    p = _proposer(tiny, num_blocks=8)
    ctx = [(i * 37 + 3) % 3000 + 5 for i in range(20)]
    d = p.propose_batch([DraftRequest("a", ctx, 4, [3, 5])])["a"]
    assert len(d) == 4 and p.held_blocks["a"] == [3, 5]
    r = p.worker.runner
    src = [r.backend.gather_kv(c, torch.arange(80, 96)) for c in r.kv_caches]
    p.copy_blocks([(5, 6)])  # the target copied block 5 to 6 before a write into it
    for c, (k, v) in zip(r.kv_caches, src):
        k2, v2 = r.backend.gather_kv(c, torch.arange(96, 112))
        assert torch.equal(k2, k) and torch.equal(v2, v)
    # the request now has block 6 where it had 5: the K/V held there still counts (nothing
    # recomputed), once; a block that changed without a copy is cut at its first position
    p._validate([DraftRequest("a", ctx + d[:2], 0, [3, 6])])
    assert p.held["a"] == ctx + d[:1] and p.held_blocks["a"] == [3, 6] and p.copied == set()
    p._validate([DraftRequest("a", ctx + d[:2], 0, [3, 7])])
    assert p.held["a"] == ctx[:16]
    # 32 slots: a 32-token context writes the K/V of position 31 only, so one draft; a
    # 33-token one has no slot for its last token: none
    assert len(p.propose_batch([DraftRequest("b", ctx + list(range(12)), 4, [1, 2])])["b"]) == 1
    assert p.propose_batch([DraftRequest("e", ctx + list(range(13)), 4, [1, 2])])["e"] == []


def test_the_scheduler_reserves_the_drafts_slots_and_gives_back_an_unverified_reservation():
    kv = KVCacheManager(6, 16)
    reqs = []
    for rid, n in (("a", 21), ("b", 16)):
        r = Request(request_id=rid, prompt_token_ids=list(range(5, 5 + n)), sampling_params=greedy(100), arrival_time=0.0)
        r.status, r.num_computed_tokens = RequestStatus.RUNNING, n - 1
        kv.allocate_slots(rid, n - 1, 0)
        reqs.append(r)
    rows = [(r.request_id, r.all_token_ids, 4) for r in reqs]
    out, copies = reserve_draft_slots(kv, reqs, rows, 16)
    # a: positions 20 .. 24 (2 blocks); b: 15 .. 19 (its 2nd block); 2 of 6 blocks left
    assert [(rid, most, ids) for rid, _, most, ids in out] == [("a", 4, [0, 1]), ("b", 4, [2, 3])]
    assert copies == [] and (kv.num_tokens("a"), kv.num_tokens("b")) == (25, 20) and kv.num_free_blocks == 2
    # b does not draft now (backing off): its unverified reservation goes back
    out, _ = reserve_draft_slots(kv, reqs, [rows[0], ("b", rows[1][1], 0)], 16)
    assert out[1][2:] == (0, [2]) and kv.num_tokens("b") == 16 and kv.num_free_blocks == 3
    # the pool is full (a blocker took the rest): a's drafts stay inside the block it has, b
    # (its decode token ends its block) gets none
    kv.allocate_slots("z", 48, 0)
    reqs[0].append_output_token(7, None)
    reqs[0].append_output_token(8, None)
    reqs[0].num_computed_tokens = 22
    rows = [("a", reqs[0].all_token_ids, 4), ("b", reqs[1].all_token_ids, 4)]
    out, _ = reserve_draft_slots(kv, reqs, rows, 16)
    assert [o[2] for o in out] == [4, 0] and kv.num_tokens("a") == 27 and kv.num_free_blocks == 0
    check_invariants(kv)
    # a's last block is now shared with a fork: it needs a copy before a write, and there is no
    # block for one: no drafts, its table unchanged, no error
    kv.fork("a", "a2")
    out, copies = reserve_draft_slots(kv, reqs[:1], rows[:1], 16)
    assert out[0][2:] == (0, [0, 1]) and copies == [] and kv.num_tokens("a") == 27
    kv.free("z")  # room again: the copy is made here, before the draft writes
    out, copies = reserve_draft_slots(kv, reqs[:1], rows[:1], 16)
    assert out[0][2] == 4 and copies == [(1, out[0][3][1])] and out[0][3][1] != 1
    check_invariants(kv)


def test_after_a_step_it_drafts_no_more_than_a_step_can_verify(tiny):
    """A row verifies at most ``max_num_batched_tokens - 1`` drafts: with k = 10 and a budget of
    5 tokens the scheduler's rows ask for 4, their slots are reserved and the proposer drafts
    4 (4 forwards), not 10 it would discard; the drafts ride on the request to the next step."""
    ctx = [(i * 37 + 3) % 3000 + 5 for i in range(21)]
    req = Request(request_id="a", prompt_token_ids=ctx[:-1], sampling_params=greedy(100), arrival_time=0.0)
    req.append_output_token(ctx[-1], None)
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, len(ctx) - 1
    s = Scheduler(SchedulerConfig(num_blocks=8, max_num_batched_tokens=5, max_model_len=4096,
                                  num_speculative_tokens=10, draft_kv=True))
    s.kv.allocate_slots("a", 20, 0)
    s.running.append(req)
    s.requests["a"] = req
    rows, copies = s.draft_rows()
    assert rows == [("a", ctx, 4, [0, 1])] and copies == [] and s.kv.num_tokens("a") == 25
    p = _proposer(tiny, k=10)
    want = _greedy_continuation(tiny, ctx, 4)
    s.set_drafts(p.propose(rows))
    assert (req.draft_token_ids, req.draft_after) == (want, 21) and p.num_forwards == 4
    assert p.held["a"] == ctx + want[:3]
    s.config.max_num_batched_tokens = 1  # no room for a draft in the step: none drafted, state kept
    rows, _ = s.draft_rows()
    assert p.propose(rows) == {"a": []} and p.num_forwards == 4 and s.kv.num_tokens("a") == 21
    assert p.held["a"] == ctx[:20] and p.held_blocks["a"] == [0, 1]  # kept up to the last token


_OPS = st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from(["accept", "decode", "shrink", "release", "move"]),
                          st.integers(0, 4), st.integers(5, 2999)), min_size=1, max_size=12)


@settings(max_examples=20, deadline=None)
@given(ops=_OPS)
def test_random_accept_reject_sequences_keep_the_draft_kv_consistent(tiny, ops):
    """Random verify outcomes (m drafts accepted then another token), plain decode steps
    without a proposal, shrinking contexts (a sibling's, a recompute's), releases and blocks
    the target gave back and took again: after every proposal each request's drafts equal a
    fresh proposer's from its whole context, it holds its context plus the drafts fed back,
    and the K/V it kept and caught up are a computation from scratch's."""
    p, t = _proposer(tiny, num_blocks=64, k=4), Target(64)
    ctx = {"a": [(i * 37 + 3) % 3000 + 5 for i in range(21)], "b": [(i * 7 + 1) % 3000 + 5 for i in range(16)]}
    last = {r: _one(p, c, 4, r, t) for r, c in ctx.items()}
    for rid, op, m, tok in ops:
        if op == "accept":
            ctx[rid] = ctx[rid] + last[rid][:m] + [tok]
        elif op == "decode":  # m + 1 plain decode steps (backing off): no proposal in between
            ctx[rid] = ctx[rid] + [(tok + 131 * j) % 3000 + 5 for j in range(m + 1)]
        elif op == "shrink":
            ctx[rid] = ctx[rid][:max(1, len(ctx[rid]) - 3 * m - 1)]
        elif op == "move":  # the target's blocks past m * 16 tokens go back; a blocker takes one
            t.kv.trim(rid, min(m * 16, t.kv.num_tokens(rid)))
            t.kv.allocate_slots(f"x{tok}", 1, 0)
        else:
            p.release(rid)
            assert rid not in p.held
        rows = [t.row(r, c, 1 + (m + i) % 4) for i, (r, c) in enumerate(ctx.items())]
        last = p.propose_batch(rows)
        for r, c in ctx.items():
            d, fresh = last[r], _proposer(tiny, k=4)
            assert d == _one(fresh, c, len(d), r) and len(d) >= 1
            assert p.held[r] == fresh.held[r] == c + d[:-1] and p.held_blocks[r] == t.kv.get_block_ids(r)
            _same_kv(p, r, fresh)
    p.retain(["b"])
    assert list(p.held) == ["b"] == list(p.held_blocks)


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
    assert set(eng.proposer.held) == {"b"} == set(eng.proposer.held_blocks)
    # b's draft K/V sits in b's own target blocks
    n = -(-len(eng.proposer.held["b"]) // 16)
    assert eng.proposer.held_blocks["b"][:n] == eng.kv.get_block_ids("b")[:n]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert done["b"] == plain[5].outputs[0].token_ids
    a = done["a"]  # the aborted request's tokens so far: a prefix of its plain ones
    assert 0 < len(a) < 32 and a == plain[4].outputs[0].token_ids[:len(a)]
    assert eng.proposer.held == {} and eng.kv.num_used_blocks == 0
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


def _nbytes(caches):
    return sum(c.key.nbytes + c.value.nbytes for c in caches)


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_siblings_fork_level_with_a_prompt_whose_last_chunk_is_one_token(loaded_model, prompt_ids, spec):
    """A 36-token prompt in chunks of 7 ends with a 1-token chunk: that row samples the first
    token alone (no drafts), so its ``n = 2`` siblings fork level with the prompt (they started
    past it, counting the draft slots, and stalled or decoded from the wrong position)."""
    kw = DRAFT if spec == "draft" else dict(speculative="ngram")
    prompt = prompt_ids[:36]
    (plain,), _, _ = run(loaded_model, [prompt], greedy(12))
    for bs in (1, 16):
        (got,), _, _ = run(loaded_model, [prompt], SamplingParams(temperature=0.0, max_tokens=12, n=2),
                           block_size=bs, max_num_batched_tokens=7, num_speculative_tokens=1, **kw)
        assert [c.token_ids for c in got.outputs] == [plain.outputs[0].token_ids] * 2


def test_the_pool_holds_both_models_kv_in_the_budget(loaded_model):
    """One block id is a page of the target's K/V and a page of the draft's: ``kv_cache_memory``
    is divided by their sum, and the draft's caches are exactly that many pages (SmolLM2 as its
    own fp32 draft: 2 x 30 layers x 3 heads x 64 x 4 B x 16 tokens = 737,280 B a block)."""
    budget = 64 * 2**20
    eng = LLMEngine(loaded_model, block_size=16, kv_cache_memory=budget, **DRAFT)
    target = eng.kv_spec.block_bytes(16)
    assert eng.draft_block_bytes == 737_280 == eng.proposer.kv_bytes_per_block(16)
    assert eng.num_blocks == budget // (target + 737_280)
    assert _nbytes(eng.proposer.worker.runner.kv_caches) == eng.num_blocks * 737_280
    summary = eng.kv_summary()
    assert (summary["bytes"], summary["draft_bytes"]) == (eng.num_blocks * target, eng.num_blocks * 737_280)
    assert summary["bytes"] + summary["draft_bytes"] <= budget
    plain = LLMEngine(loaded_model, block_size=16, kv_cache_memory=budget)
    assert plain.num_blocks == budget // target and plain.kv_summary()["draft_bytes"] == 0


def test_prefix_hits_and_siblings_reuse_the_drafts_kv_and_copies_follow_it(loaded_model, prompt_ids):
    """A prefix-cache hit and ``n > 1`` siblings share the target's blocks, and with them the
    draft K/V written there (computed once, ``num_shared_tokens``); the siblings' copy-on-write
    of their shared last block copies the draft's page too: greedy siblings (all the same
    tokens) keep accepting nearly every draft, and the tokens equal plain decoding's."""
    prompt = prompt_ids[:37]  # 2 whole blocks and a shared partial one
    (plain,), _, _ = run(loaded_model, [prompt], greedy(24))
    (spec,), stats, eng = run(loaded_model, [prompt], SamplingParams(temperature=0.0, max_tokens=24, n=3), **DRAFT,
                             enable_prefix_caching=True)
    assert [c.token_ids for c in spec.outputs] == [plain.outputs[0].token_ids] * 3
    assert stats.spec_acceptance_rate > 0.9 and eng.kv.stats.cow_copies >= 2
    assert eng.proposer.num_shared_tokens >= 2 * 32  # the two siblings' whole prompt blocks
    # one after the other: the second request's prompt blocks are prefix hits, their draft K/V too
    llm = LLM(loaded_model, block_size=16, num_blocks=256, enable_prefix_caching=True, debug_invariants=True, **DRAFT)
    first = llm.generate([prompt], greedy(24), use_tqdm=False)[0].outputs[0].token_ids
    shared = llm.engine.proposer.num_shared_tokens
    second = llm.generate([prompt + [11]], greedy(24), use_tqdm=False)
    assert first == plain.outputs[0].token_ids and llm.engine.get_stats().spec_acceptance_rate > 0.9
    assert second[0].outputs[0].token_ids == run(loaded_model, [prompt + [11]], greedy(24))[0][0].outputs[0].token_ids


def test_a_target_with_only_sliding_window_layers_is_refused(monkeypatch, tmp_path):
    """The draft's K/V shares the target's full-attention block table; a target whose every
    layer has a window (a tiny Mistral, window 10) has none: ConfigError, before any cache."""
    from pagedkv.model.loader import load_model
    from pagedkv.worker.proposer import Proposer
    from tests.model.builders import save_tiny, seeded_model
    from tests.model.test_families import _hf_config

    class KVWriter(Proposer):
        writes_kv, k = True, 2

        def init_cache(self, num_blocks, block_size):
            raise AssertionError("caches built for a target it cannot share")

    monkeypatch.setattr("pagedkv.engine.engine.make_proposer", lambda *a: KVWriter())
    lm = load_model(save_tiny(seeded_model(*_hf_config("mistral"), []), tmp_path / "m"))
    with pytest.raises(ConfigError, match="no full-attention layer"):
        LLMEngine(lm, num_blocks=16, speculative="ngram")
