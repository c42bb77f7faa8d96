"""Sharing by fork and copy-on-write: parallel sampling (n > 1) and beam search.

* n=2 on a 6-token prompt (block_size 4): the children share the prompt's two blocks; the
  half-full block is copied once, before either branch's first write lands; each branch
  equals an independent request with its seed; every ref count returns to 0.
* Beam search, width 2 and 4, 32 new tokens: the same hypotheses (best first) as
  transformers' ``generate(num_beams=k, do_sample=False, length_penalty=...)``; at every
  step each live beam's cache holds exactly its own tokens (a beam forked mid-block reads
  its private copy), checked on the layer-0 values, which depend on the token id only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedkv import LLM, SamplingParams
from pagedkv.engine.request import RequestStatus
from pagedkv.kv import check_invariants
from pagedkv.kv.prefix_cache import token_bytes
from pagedkv.model.llama import _rms_norm

BEAM_PROMPT = "The capital of France is"


def make_llm(loaded_model, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 128)
    kw.setdefault("debug_invariants", True)
    return LLM(loaded_model, **kw)


def drain(eng, check=None):
    """Step until idle; ``check(eng)`` after every step. Returns {request_id: final output}."""
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        if check is not None:
            check(eng)
    return outs


def assert_clean(eng):
    assert not eng.has_unfinished_requests()
    assert eng.kv.num_used_blocks == 0, "blocks leaked"
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
    check_invariants(eng.kv)


def v0_reference(model, token_ids):
    """Layer-0 values ``[n, Hkv, d]`` of ``token_ids``: they depend on the token id only."""
    l0 = model.layers[0]
    with torch.inference_mode():
        x = _rms_norm(model.embed_tokens(torch.tensor(token_ids)), l0.input_layernorm.weight, l0.eps)
        qkv = F.linear(x, l0.qkv_proj.weight, l0.qkv_proj.bias)
    return qkv[:, l0.q_size + l0.kv_size:].reshape(len(token_ids), l0.num_kv_heads, l0.head_dim)


def check_own_cache(eng, rid):
    """The cache slots of ``rid``'s computed positions hold its own tokens' layer-0 values,
    and every published block in its table is hashed from its own tokens."""
    req = eng.scheduler.requests[rid]
    n = req.num_computed_tokens
    if n == 0:
        return
    toks = req.all_token_ids[:n]
    slots = torch.from_numpy(np.asarray(eng.kv.slot_mapping(rid, 0, n)))
    _, v = eng.backend.gather_kv(eng.runner.kv_caches[0], slots)
    ref = v0_reference(eng.runner.model, toks)
    bad = (~torch.isclose(v, ref, atol=1e-4, rtol=1e-4)).flatten(1).any(1).nonzero().flatten().tolist()
    assert not bad, f"{rid}: positions {bad} hold another sequence's K/V"
    bs = eng.kv.block_size
    for j, b in enumerate(eng.kv.get_block_table(rid).blocks):
        if b.block_hash is not None:
            assert b.token_bytes == token_bytes(req.all_token_ids[j * bs:(j + 1) * bs]), (rid, j)


# ---- parallel sampling ----------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n2_copies_the_half_full_block_once_before_either_branch_writes(loaded_model, prefix_caching):
    prompt = [1, 504, 3458, 314, 260, 1345]  # 6 tokens: one full block + one half-full block
    sp = dict(temperature=0.8, top_p=0.95, max_tokens=8, ignore_eos=True)
    llm = make_llm(loaded_model, enable_prefix_caching=prefix_caching, shuffle_blocks=3)
    eng = llm.engine
    events = []
    real_copy, real_exec = eng.runner.copy_blocks, eng.runner.execute
    eng.runner.copy_blocks = lambda copies: (events.append(("copy", list(copies))), real_copy(copies))[1]
    eng.runner.execute = lambda inp: (events.append(("execute", inp.input_ids.numel())), real_exec(inp))[1]

    eng.add_request("r", prompt, SamplingParams(n=2, seed=7, **sp))
    eng.step()  # prefill; the sibling forks the parent's table
    parent_ids, child_ids = eng.kv.get_block_ids("r"), eng.kv.get_block_ids("r#1")
    assert parent_ids == child_ids and len(parent_ids) == 2
    half = eng.kv.pool.blocks[parent_ids[1]]
    assert half.ref_cnt == 2 and eng.kv.pool.blocks[parent_ids[0]].ref_cnt == 2
    events.clear()
    eng.step()  # both branches append at position 6, inside the shared half-full block
    copies = [c for kind, c in events if kind == "copy" and c]
    assert events[0][0] == "copy" and events[1] == ("execute", 2), events  # copy, then the writes
    assert copies == [[(half.block_id, copies[0][0][1])]], copies
    new_ids = {eng.kv.get_block_ids("r")[1], eng.kv.get_block_ids("r#1")[1]}
    assert new_ids == {half.block_id, copies[0][0][1]}, "each branch has its own copy of block 1"
    assert eng.kv.get_block_ids("r")[0] == eng.kv.get_block_ids("r#1")[0], "the full block stays shared"
    outs = drain(eng, check=lambda e: [check_own_cache(e, r) for r in ("r", "r#1") if r in e.scheduler.requests])
    out = outs["r"]
    assert eng.kv.stats.cow_copies == 1 and out.metrics.num_cow_copies == 1
    assert eng.get_stats().peak_shared_blocks == 2
    assert_clean(eng)

    # each branch equals an independent request with its seed (child i gets seed + i)
    alone = make_llm(loaded_model, enable_prefix_caching=prefix_caching)
    indep = alone.generate([prompt, prompt], [SamplingParams(seed=7, **sp), SamplingParams(seed=8, **sp)],
                           use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [o.token_ids for o in indep]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    assert_clean(alone.engine)


def test_n8_shares_the_prompt_blocks(loaded_model):
    """n=8 on a 64-token prompt: one prefill; peak blocks = prompt blocks + per-child tails."""
    prompt = list(range(1000, 1064))
    sp = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    llm = make_llm(loaded_model, num_blocks=256)
    out = llm.generate([prompt], SamplingParams(n=8, seed=0, **sp), use_tqdm=False)[0]
    st = llm.engine.get_stats()
    # 16 prompt blocks + 8 children x 2 output blocks (positions 64..70)
    assert st.peak_used_blocks == 16 + 8 * 2
    assert st.num_prompt_tokens == 64 and st.kv_cow_copies == 0  # the prompt ends on a block boundary
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_clean(llm.engine)


# ---- beam search ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def beam_prompt(hf_tokenizer):
    ids = list(hf_tokenizer(BEAM_PROMPT, add_special_tokens=False)["input_ids"])
    assert len(ids) % 4 != 0, "the prompt must end mid-block so the first forks copy"
    return ids


@pytest.mark.parametrize("beam_width,length_penalty", [(2, 1.0), (4, 0.6)])
def test_beam_search_matches_transformers(loaded_model, hf_model, beam_prompt, beam_width, length_penalty):
    ids = beam_prompt
    with torch.inference_mode():
        ref = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32, num_beams=beam_width, do_sample=False, length_penalty=length_penalty,
            num_return_sequences=beam_width, return_dict_in_generate=True, output_scores=True,
        )
    eos = hf_model.generation_config.eos_token_id

    def strip(seq):  # transformers pads shorter hypotheses after their EOS
        seq = seq[len(ids):].tolist()
        return seq[: seq.index(eos) + 1] if eos in seq else seq

    ref_seqs = [strip(s) for s in ref.sequences]
    ref_scores = ref.sequences_scores.tolist()

    llm = make_llm(loaded_model, shuffle_blocks=11)
    eng = llm.engine
    eng.add_request("b", ids, SamplingParams(beam_width=beam_width, length_penalty=length_penalty, max_tokens=32))
    seen = {"max_beams": 0, "mid_block_forks": 0}

    def check(e):
        live = [r for r in e.scheduler.requests.values() if r.parent_id == "b" and r.status == RequestStatus.RUNNING]
        seen["max_beams"] = max(seen["max_beams"], len(live))
        for r in live:
            check_own_cache(e, r.request_id)

    real_fork = eng.kv.fork

    def fork(parent, child):
        if eng.kv.num_tokens(parent) % eng.kv.block_size:
            seen["mid_block_forks"] += 1
        return real_fork(parent, child)

    eng.kv.fork = fork
    out = drain(eng, check)["b"]
    assert [c.token_ids for c in out.outputs] == ref_seqs  # best first; [0] is generate()'s answer
    assert out.token_ids == ref_seqs[0]
    assert [c.score for c in out.outputs] == pytest.approx(ref_scores, abs=1e-3)
    assert all(c.score == pytest.approx(c.cumulative_logprob / len(c.token_ids) ** length_penalty)
               for c in out.outputs)
    assert seen["max_beams"] == beam_width
    assert seen["mid_block_forks"] > 0 and eng.kv.stats.cow_copies > 0
    st = eng.get_stats()
    assert st.peak_shared_blocks >= len(ids) // 4 and st.num_shared_blocks == 0
    assert out.metrics.num_cow_copies == eng.kv.stats.cow_copies
    assert_clean(eng)


def test_beam_search_abort_and_bad_params(loaded_model, beam_prompt):
    from pagedkv.errors import InvalidRequestError

    llm = make_llm(loaded_model)
    eng = llm.engine
    for bad in (dict(n=2), dict(stop=["x"]), dict(logprobs=1), dict(repetition_penalty=1.2),
                dict(early_stopping="sometimes"), dict(length_penalty=float("nan"))):
        with pytest.raises(InvalidRequestError):
            eng.add_request(None, beam_prompt, SamplingParams(beam_width=2, **bad))
    eng.add_request("b", beam_prompt, SamplingParams(beam_width=3, max_tokens=16))
    for _ in range(4):
        eng.step()
    assert sum(1 for r in eng.scheduler.requests.values() if r.parent_id == "b") == 3
    eng.abort_request("b")
    out = drain(eng)["b"]
    assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
    assert_clean(eng)
