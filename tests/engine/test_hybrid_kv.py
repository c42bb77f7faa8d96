"""The engine on a hybrid KV cache: a tiny random Gemma-2 (layers [window 6, full, window 6],
soft caps on) whose 30-45 token prompts are far longer than the window, so the window group
frees blocks mid-request. Greedy tokens equal transformers' (fp32) while blocks are freed; the
window group never holds more than its bound; forks (n=2, beam search) and prefix hits work on
the window group; nothing leaks after an abort.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine.request import RequestStatus
from pagedkv.errors import ConfigError
from pagedkv.kv import check_invariants
from tests.model.test_families import _prompt, family  # noqa: F401  (family: the fixture)

BLOCK = 4
WINDOW = 6
NEW = 10
pytestmark = pytest.mark.parametrize("family", ["gemma2"], indirect=True)


@pytest.fixture(scope="module")
def gemma2(family):  # noqa: F811
    """(transformers model, pagedkv LoadedModel): test_families' tiny Gemma-2."""
    _kind, hf, _dir, lm = family
    return hf, lm


def hf_greedy(hf, ids, n=NEW):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=0)
    toks = out[0, len(ids):].tolist()
    return toks[: toks.index(2) + 1] if 2 in toks else toks  # the engine stops at EOS (2)


def make(lm, **kw):
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 64)
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("debug_invariants", True)
    return LLM(lm, **kw)


def test_greedy_equals_transformers_while_window_blocks_are_freed(gemma2):
    hf, lm = gemma2
    assert lm.config.layer_windows() == [WINDOW, None, WINDOW]
    prompts = [_prompt(41, 11), _prompt(33, 12)]
    refs = [hf_greedy(hf, p) for p in prompts]
    llm = make(lm)
    eng = llm.engine
    kv = eng.kv
    # 1 full + 2 window layers: cut into three 1-layer groups (pages of one layer, none unused)
    assert kv.num_groups == 3 and kv.groups.windows == (None, WINDOW, WINDOW) and kv.null_block.block_id == 0
    assert len(eng.runner.shared_caches) == 1  # max_layers
    summary = eng.kv_summary()
    assert [g["layers"] for g in summary["layer_groups"]] == [[1], [0], [2]]
    # 63 usable blocks; one 128-token request holds 32 full + 2 x 2 window blocks
    assert summary["max_concurrency_at_max_model_len"] == 63 / 36
    assert eng.runner.kv_caches[0] is eng.runner.kv_caches[1] is eng.runner.kv_caches[2]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=NEW))
    outs, nulls_seen, peak_window = {}, 0, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        for rid in kv.tables:
            full, *windows = kv.held_blocks(rid)
            ids = kv.get_group_block_ids(rid)
            assert full == len(ids[0]) == -(-kv.num_tokens(rid) // BLOCK)  # the full group keeps all
            assert ids[1].count(0) == ids[2].count(0) and windows[0] == windows[1]  # the same slide
            assert set(ids[1]).isdisjoint(ids[2]) or set(ids[1]) & set(ids[2]) == {0}  # own block ids
            nulls_seen = max(nulls_seen, ids[1].count(0))
            peak_window = max(peak_window, *windows)
    assert [outs["r0"], outs["r1"]] == refs
    assert all(len(set(r)) >= 4 for r in refs)  # not one repeated token
    # 16-token chunks: a step computing from p holds blocks (p - 5) // 4 .. (p + 15) // 4
    assert nulls_seen >= 8 and peak_window == 6
    assert kv.stats.window_freed_blocks >= 2 * 2 * 7
    assert kv.num_used_blocks == 0
    check_invariants(kv)


def test_prefix_hit_and_preemption_on_the_window_group(gemma2):
    hf, lm = gemma2
    shared = _prompt(24, 7)
    prompts = [shared + _prompt(9, 8), shared + _prompt(7, 9)]
    refs = [hf_greedy(hf, p) for p in prompts]
    llm = make(lm, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW)
    first = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    second = llm.generate(prompts[1:], params, use_tqdm=False)[0]
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == refs
    # 24 shared tokens: full blocks 0..5 and the window's blocks 4, 5 (tokens 17..23) hit
    assert second.num_cached_tokens == 24
    # a pool too small for both at once: the scheduler preempts and recomputes, tokens unchanged
    small = make(lm, num_blocks=28)  # one needs 11 full + 2 x 7 window blocks at its peak
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert small.engine.kv.num_used_blocks == 0


def test_n2_forks_and_beam_search_on_the_window_group(gemma2):
    hf, lm = gemma2
    ids = _prompt(30, 21)
    llm = make(lm)
    eng = llm.engine
    out = llm.generate([ids], SamplingParams(temperature=0.0, n=2, max_tokens=NEW), use_tqdm=False)[0]
    ref = hf_greedy(hf, ids)
    assert [c.token_ids for c in out.outputs] == [ref, ref]
    assert eng.kv.stats.cow_copies > 0 and eng.kv.num_used_blocks == 0
    with torch.inference_mode():
        r = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=NEW, num_beams=2, do_sample=False, num_return_sequences=2,
                        pad_token_id=0)
    out = llm.generate([ids], SamplingParams(beam_width=2, max_tokens=NEW), use_tqdm=False)[0]
    strip = [s[len(ids):].tolist() for s in r]
    assert [c.token_ids for c in out.outputs] == [t[: t.index(2) + 1] if 2 in t else t for t in strip]
    assert eng.kv.num_used_blocks == 0
    check_invariants(eng.kv)


def test_abort_mid_request_leaks_nothing(gemma2):
    _, lm = gemma2
    llm = make(lm)
    eng = llm.engine
    eng.add_request("a", _prompt(40, 31), SamplingParams(temperature=0.0, max_tokens=NEW))
    eng.add_request("b", _prompt(38, 32), SamplingParams(temperature=0.0, max_tokens=NEW))
    for _ in range(4):
        eng.step()
    assert eng.kv.get_group_block_ids("a")[1][0] == 0  # the window already slid
    eng.abort_request("a")
    assert eng.scheduler.requests.get("a") is None
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv.num_used_blocks == 0 and eng.kv.holds == []
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
    check_invariants(eng.kv)
    assert RequestStatus.FINISHED_ABORTED.finished


def test_kv_tiers_and_events_refuse_a_windowed_model(gemma2):
    _, lm = gemma2
    with pytest.raises(ConfigError, match="sliding-window"):
        make(lm, kv_offload=["host:1MiB"])
    with pytest.raises(ConfigError, match="sliding-window"):
        make(lm, kv_events="tcp://127.0.0.1:1")
