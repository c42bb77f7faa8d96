"""The engine under pressure on the new model kinds: multi-head latent attention (DeepSeek-V3,
dense, ``q_lora_rank`` null) and mixture of experts (Qwen3-MoE), tiny seeded random-weight
models built with transformers (``tests.model.test_mla`` / ``tests.model.test_families_moe``).

Checked, against the same engine on a large pool (itself equal to transformers in those test
modules) or transformers directly:

* aborts mid-prefill (4-token chunks), mid-decode and of preempted requests in a pool
  too small for the batch: the survivors' greedy tokens are unchanged, and afterwards every
  block is free with reference count 0 (no leak);
* block size 1 with 1-token prefill chunks (every token a block boundary);
* beam search (3 beams, ``early_stopping`` False) returns transformers' 3 hypotheses.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.engine.engine import LLMEngine
from pagedkv.model.loader import load_model
from tests.model.builders import NORM_NOISE, match, save_tiny, seeded_model
from tests.model.builders import prompt as _prompt

KINDS = ["deepseek_v3", "qwen3_moe"]


def _build(kind: str, out):
    if kind == "qwen3_moe":
        from tests.model.builders import moe_config as _hf_config
    else:
        from tests.model.test_mla import _hf_config

    # non-trivial norms, decisive routers, scores large enough that mistakes show
    big = ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj", "embed_tokens")
    hf = seeded_model(*_hf_config(kind), [NORM_NOISE, (match(ends=("gate.weight",)), "mul", 20.0),
                                          (match(has=big), "mul", 3.0)])
    return hf, load_model(save_tiny(hf, out))


@pytest.fixture(scope="module", params=KINDS)
def family(request, tmp_path_factory):
    return (request.param, *_build(request.param, tmp_path_factory.mktemp(request.param)))


PROMPTS = [_prompt(n, s) for s, n in enumerate([1, 3, 4, 5, 15, 16, 17, 32, 33])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _run(engine: LLMEngine, aborts: dict[int, list[str]] | None = None) -> dict[str, object]:
    aborts = aborts or {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    outs, step = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
        step += 1
        engine.abort_request(aborts.get(step, []))
    return outs


def _no_leak(engine: LLMEngine, free0: int) -> None:
    engine.scheduler.check_invariants()
    assert engine.kv.num_free_blocks == free0 == engine.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)


@pytest.fixture(scope="module")
def reference(family):
    _, _, lm = family
    return {k: c.token_ids for k, c in _run(LLMEngine(lm, num_blocks=256, block_size=16)).items()}


@pytest.mark.parametrize("kw, aborts", [
    (dict(max_num_batched_tokens=4), {1: ["r7", "r8"]}),  # mid-prefill: 4-token chunks, step 1
    (dict(), {3: ["r0", "r5", "r8"]}),  # mid-decode
    (dict(num_blocks=14), {6: ["r1", "r4", "r6"]}),  # 14 blocks of 4 for 9 requests: preempted ones
])
def test_aborts_leave_no_block_and_do_not_change_the_survivors(family, reference, kw, aborts):
    _, _, lm = family
    engine = LLMEngine(lm, **{"num_blocks": 64, "block_size": 4, "debug_invariants": True, **kw})
    free0 = engine.kv.num_free_blocks
    outs = _run(engine, aborts)
    aborted = sorted(k for k, c in outs.items() if c.finish_reason == "abort")
    assert aborted == sorted(sum(aborts.values(), []))
    assert {k: c.token_ids for k, c in outs.items() if k not in aborted} == \
        {k: t for k, t in reference.items() if k not in aborted}
    if "num_blocks" in kw:
        assert engine.scheduler.stats.num_preemptions > 0
    _no_leak(engine, free0)


def test_block_size_one_with_one_token_chunks(family, reference):
    _, _, lm = family
    engine = LLMEngine(lm, num_blocks=160, block_size=1, max_num_batched_tokens=1, debug_invariants=True)
    free0 = engine.kv.num_free_blocks
    assert {k: c.token_ids for k, c in _run(engine).items()} == reference
    _no_leak(engine, free0)


def test_beam_search_equals_transformers(family):
    _, hf, lm = family
    engine = LLMEngine(lm, num_blocks=20, block_size=4, debug_invariants=True)
    free0 = engine.kv.num_free_blocks
    prompts = [_prompt(16, 6), _prompt(17, 7)]
    params = SamplingParams(beam_width=3, temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=8, num_beams=3, num_return_sequences=3, do_sample=False,
                              pad_token_id=0, eos_token_id=None, length_penalty=1.0, early_stopping=False)
        assert [c.token_ids for c in outs[f"b{i}"].outputs] == [s[len(p):].tolist() for s in ref]
    _no_leak(engine, free0)
