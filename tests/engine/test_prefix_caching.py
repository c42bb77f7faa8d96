"""Prefix caching in the engine (seed §02/§04), block_size 4.

"Cold" = the same request on an engine with prefix caching off. Every test checks the
output equals cold, nothing leaks, and (every step) that each prefix-cache entry maps a
block whose cached layer-0 values are those of the hashed tokens (layer-0 values depend on
the token id only), so no hash ever maps a block that was given up and rewritten.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedkv import LLM, SamplingParams
from pagedkv.engine.request import RequestStatus
from pagedkv.kv import check_invariants
from pagedkv.model.llama import _rms_norm

TEXT = (
    "Paged attention splits each request's key-value cache into fixed-size blocks, so memory "
    "is handed out on demand and shared prefixes can be stored once and referenced by many "
    "requests, like pages of virtual memory mapped into several processes."
)


@pytest.fixture(scope="module")
def base_ids(hf_tokenizer):
    ids = list(hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    assert len(ids) >= 32
    return ids


def greedy(max_tokens=8):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(loaded_model, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 128)
    kw.setdefault("enable_prefix_caching", True)
    kw.setdefault("debug_invariants", True)
    return LLM(loaded_model, **kw)


_COLD: dict = {}


def cold(loaded_model, prompt, max_tokens=8):
    key = (tuple(prompt), max_tokens)
    if key not in _COLD:
        llm = make_llm(loaded_model, enable_prefix_caching=False)
        _COLD[key] = llm.generate([prompt], greedy(max_tokens), use_tqdm=False)[0].token_ids
        assert_clean(llm.engine)
    return _COLD[key]


def assert_clean(eng):
    assert not eng.has_unfinished_requests()
    assert eng.kv.num_used_blocks == 0, "blocks leaked"
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
    check_invariants(eng.kv)


def v0_reference(model, token_ids):
    """Layer-0 values ``[n, Hkv, d]`` of ``token_ids`` (a function of the token id only)."""
    l0 = model.layers[0]
    with torch.inference_mode():
        x = _rms_norm(model.embed_tokens(torch.tensor(token_ids)), l0.input_layernorm.weight, l0.eps)
        qkv = F.linear(x, l0.qkv_proj.weight, l0.qkv_proj.bias)
    return qkv[:, l0.q_size + l0.kv_size:].reshape(len(token_ids), l0.num_kv_heads, l0.head_dim)


def check_cache_entries(eng):
    """Every hash -> block entry (in use or free) holds the K/V of the tokens it was hashed
    from, and every published block in a live table is hashed from that request's tokens."""
    bs = eng.kv.block_size
    pool = eng.kv.pool
    for h, blk in pool.cached.items():
        toks = np.frombuffer(blk.token_bytes, dtype="<i8").tolist()
        slots = torch.arange(blk.block_id * bs, (blk.block_id + 1) * bs)
        _, v = eng.backend.gather_kv(eng.runner.kv_caches[0], slots)
        assert torch.allclose(v, v0_reference(eng.runner.model, toks), atol=1e-4, rtol=1e-4), (
            f"hash {h.hex()[:8]} maps block {blk.block_id}, which no longer holds its tokens")
    for rid, table in eng.kv.tables.items():
        req = eng.scheduler.requests.get(rid)
        for j, blk in enumerate(table.blocks):
            if blk.block_hash is not None and req is not None:
                assert np.frombuffer(blk.token_bytes, dtype="<i8").tolist() == req.all_token_ids[j * bs:(j + 1) * bs]


def drain(eng, check=check_cache_entries):
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        check(eng)
    return outs


def run_one(eng, rid, prompt, max_tokens=8, **kw):
    eng.add_request(rid, prompt, greedy(max_tokens), **kw)
    return drain(eng)[rid]


# ---- the same prompt twice ----------------------------------------------------------
@pytest.mark.parametrize("length", [12, 13])
def test_same_prompt_twice_computes_only_the_uncached_tail(loaded_model, base_ids, length):
    prompt = base_ids[:length]
    llm = make_llm(loaded_model)
    eng = llm.engine
    first = run_one(eng, "a", prompt)
    before = eng.get_stats().num_batched_tokens
    second = run_one(eng, "b", prompt)
    computed = eng.get_stats().num_batched_tokens - before
    hit = (length - 1) // 4 * 4  # whole blocks, never the whole prompt: 8 of 12, 12 of 13
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == hit
    assert computed == (length - hit) + 7  # the uncached tail (>= the last prompt token) + 7 decodes
    assert second.metrics.prefix_query_tokens == length and second.metrics.prefix_hit_tokens == hit
    assert second.metrics.prefix_hit_rate == pytest.approx(hit / length)
    st = eng.get_stats()
    assert st.kv_prefix_queries == 2 * length and st.kv_prefix_hits == hit
    assert st.kv_prefix_hit_rate == pytest.approx(hit / (2 * length))
    assert first.token_ids == second.token_ids == cold(loaded_model, prompt)
    assert_clean(eng)


def test_a_request_waits_for_a_prefix_another_request_is_prefilling(loaded_model, base_ids):
    """Both prompts share 32 tokens; with 24 tokens per step the second one would be admitted
    while the first still computes block 6..7 of the shared part. It waits a step and hits
    all 8 shared blocks instead of recomputing two of them."""
    shared = base_ids[:32]
    p0, p1 = shared + [1000, 1001, 1002, 1003], shared + [2000, 2001, 2002, 2003]
    llm = make_llm(loaded_model, max_num_batched_tokens=24)
    eng = llm.engine
    eng.add_request("r0", p0, greedy(4))
    eng.add_request("r1", p1, greedy(4))
    outs = drain(eng)
    assert outs["r1"].num_cached_tokens == 32
    assert eng.get_stats().num_batched_tokens == 36 + 4 + 2 * 3  # prompts once, then decodes
    assert outs["r0"].token_ids == cold(loaded_model, p0, 4)
    assert outs["r1"].token_ids == cold(loaded_model, p1, 4)
    assert_clean(eng)


# ---- isolation ------------------------------------------------------------------------
def test_other_revision_adapter_salt_or_tenant_never_hit_and_the_same_salt_does(loaded_model, base_ids):
    prompt = base_ids[:16]
    ref = cold(loaded_model, prompt, 4)
    llm = make_llm(loaded_model)
    eng = llm.engine
    assert run_one(eng, "base", prompt, 4, cache_salt="s1").num_cached_tokens == 0
    rev = eng.revision
    eng.revision = rev + "+other"  # e.g. weights reloaded at another revision
    out = run_one(eng, "rev", prompt, 4, cache_salt="s1")
    eng.revision = rev
    assert out.num_cached_tokens == 0 and out.token_ids == ref
    for name, kw in [("adapter", dict(adapter_id="lora-a")), ("salt", dict(cache_salt="s2")),
                     ("tenant", dict(tenant="t2")), ("typed", dict(cache_salt=None, adapter_id="s1"))]:
        kw.setdefault("cache_salt", "s1")
        out = run_one(eng, name, prompt, 4, **kw)
        assert out.num_cached_tokens == 0, name
        assert out.token_ids == ref, name
    same = run_one(eng, "same", prompt, 4, cache_salt="s1")
    assert same.num_cached_tokens == 12 and same.token_ids == ref
    assert eng.get_stats().kv_prefix_hits == 12
    assert_clean(eng)


# ---- abort during chunked prefill -----------------------------------------------------
@pytest.mark.parametrize("when", ["between_steps", "during_forward"])
def test_abort_during_chunked_prefill_then_resend(loaded_model, base_ids, when):
    prompt = base_ids[:30]
    llm = make_llm(loaded_model, max_num_batched_tokens=8)
    eng = llm.engine
    eng.add_request("x", prompt, greedy())
    eng.step()  # first chunk: positions 0..7, two full blocks published
    assert eng.scheduler.requests["x"].num_computed_tokens == 8
    outs = {}
    if when == "between_steps":
        eng.abort_request("x")
    else:
        real = eng.runner.execute

        def execute(inp):
            eng.abort_request("x")  # lands while the step's writes are in flight
            assert eng.kv.holds, "the aborted request's blocks are held until the step ends"
            return real(inp)

        eng.runner.execute = execute
        outs = {o.request_id: o for o in eng.step()}  # the chunk is written, not published
        eng.runner.execute = real
    outs.update(drain(eng))
    assert outs["x"].finish_reason == "abort"
    assert eng.kv.num_used_blocks == 0
    again = run_one(eng, "x2", prompt)
    assert again.num_cached_tokens == 8
    assert again.token_ids == cold(loaded_model, prompt)
    assert_clean(eng)


# ---- preemption with prefix caching ---------------------------------------------------
def test_preempted_after_5_tokens_in_a_6_block_pool_rehits_its_own_blocks(loaded_model, base_ids):
    """A (7-token prompt) and B (8 tokens) share 6 blocks of 4 slots. B is admitted second,
    so it is the victim when it needs a 4th block to write position 12: it has 5 output
    tokens then. Its freed blocks go back tail first: A's next block evicts B's third block
    (positions 8..11); on resume B re-hits its first two blocks and recomputes 8..12."""
    a, b = base_ids[:7], base_ids[20:28]
    llm = make_llm(loaded_model, num_blocks=6, shuffle_blocks=5)
    eng = llm.engine
    eng.add_request("A", a, greedy(10))
    eng.add_request("B", b, greedy(10))
    seen = {}
    outs = {}
    while eng.has_unfinished_requests():
        b_ids = eng.kv.get_block_ids("B")
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        check_cache_entries(eng)
        rb = eng.scheduler.requests.get("B")
        if rb is not None and rb.status == RequestStatus.PREEMPTED and "outputs" not in seen:
            seen["outputs"] = rb.num_output_tokens
            seen["gave_up"] = b_ids
        if "gave_up" in seen and "reused" not in seen:
            a_ids = eng.kv.get_block_ids("A")
            reused = [i for i in seen["gave_up"] if i in a_ids]
            if reused:
                seen["reused"] = reused
                for i in reused:  # no hash maps a block it gave up and A now writes
                    blk = eng.kv.pool.blocks[i]
                    assert blk.block_hash is None and blk not in eng.kv.pool.cached.values()
    assert seen["outputs"] == 5
    assert seen["reused"] == [seen["gave_up"][2]]  # the tail block went first
    assert outs["B"].metrics.num_preemptions == 1
    st = eng.get_stats()
    assert st.num_preemptions == 1 and st.kv_evictions >= 1
    # the resume re-hit B's first two blocks, but the counters hold first admissions only
    # (vLLM's): 7 + 8 prompt tokens looked up, no hit, as the requests' num_cached_tokens say
    assert st.kv_prefix_hits == 0 == outs["A"].num_cached_tokens + outs["B"].num_cached_tokens
    assert st.kv_prefix_queries == 7 + 8
    assert outs["A"].token_ids == cold(loaded_model, a, 10)
    assert outs["B"].token_ids == cold(loaded_model, b, 10)
    assert_clean(eng)


def test_engine_and_request_stats_name_every_sharing_counter(loaded_model, base_ids):
    llm = make_llm(loaded_model)
    outs = llm.generate([base_ids[:9]] * 2, SamplingParams(n=2, seed=1, max_tokens=4), use_tqdm=False)
    st = llm.engine.get_stats()
    for key in ("kv_prefix_queries", "kv_prefix_hits", "kv_prefix_hit_rate", "num_shared_blocks",
                "peak_shared_blocks", "kv_cow_copies", "kv_evictions", "num_preemptions", "peak_used_blocks"):
        assert key in st.as_dict(), key
    assert st.peak_shared_blocks >= 2 and st.kv_cow_copies == 2  # one half block per request
    assert sum(o.metrics.num_cow_copies for o in outs) == 2
    assert all(o.metrics.prefix_query_tokens == 9 for o in outs)
    assert_clean(llm.engine)


def test_reset_prefix_cache_forgets_every_hash(loaded_model):
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.request import SamplingParams
    from pagedkv.testing.tiny import tiny_random_model

    engine = LLMEngine(tiny_random_model(loaded_model), num_blocks=16, block_size=4, max_model_len=32,
                       enable_prefix_caching=True)
    prompt = list(range(400, 413))  # 3 full blocks

    def cached() -> int:
        engine.add_request(None, prompt, SamplingParams(max_tokens=1, temperature=0))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        return outs[0].num_cached_tokens

    assert cached() == 0 and cached() == 12
    assert engine.reset_prefix_cache() == 3
    assert cached() == 0 and cached() == 12  # published again by the run after the reset
