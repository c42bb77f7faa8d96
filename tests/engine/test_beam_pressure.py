"""Beam search under memory pressure, prefix caching off (a livelock found by an adversarial pass).

block_size 2, 13 blocks, two greedy requests and a width-2 beam search on a 10-token prompt.
Preemption used to split the beam group: one beam kept its 7 blocks in ``running`` waiting
for its sibling's logits while the sibling, requeued, needed 7 blocks with 6 free, so
``step()`` scheduled nothing forever. A beam group is now preempted and readmitted whole
(its shared prefix recomputed once and forked), and an engine that can schedule nothing
with requests pending raises instead of spinning.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.scheduler import SchedulerStallError
from pagedkv.kv import check_invariants

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BEAM = SamplingParams(beam_width=2, max_tokens=6, ignore_eos=True)


def _prompt(llm):
    ids = llm.tokenizer("The quick brown fox jumps over the lazy dog again and", add_special_tokens=False)
    return list(ids["input_ids"][:10])


def _drain(eng, max_steps=500):
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        assert steps < max_steps, "no progress"
    return done


def _beams(out):
    """Hypotheses as (token ids, cumulative logprob): ids exactly, logprobs to 1e-3. A run
    under pressure recomputes the beams' context in a prefill chunk (another kernel, other
    float rounding than the decode steps of an unpressured run), so the sums agree only to a
    few ulps: rounding them to 4 decimals flipped the last digit on AVX-512 machines."""
    return [(c.token_ids, pytest.approx(c.cumulative_logprob, abs=1e-3)) for c in out.outputs]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_beam_group_under_pressure_completes(loaded_model, prefix_caching):
    llm = LLM(loaded_model, block_size=2, num_blocks=13, debug_invariants=True,
              enable_prefix_caching=prefix_caching)
    eng = llm.engine
    prompt = _prompt(llm)
    eng.add_request("C", prompt[:2], GREEDY)
    eng.add_request("C2", prompt[2:4], GREEDY)
    eng.add_request("G", prompt, BEAM)
    done = _drain(eng)
    assert sorted(done) == ["C", "C2", "G"]
    assert eng.get_stats().num_preemptions > 0  # the pressure this test is about happened
    eng.step()
    assert eng.kv.num_used_blocks == 0
    check_invariants(eng.kv)

    roomy = LLM(loaded_model, block_size=2, num_blocks=256)
    alone = roomy.generate([prompt], BEAM)[0]
    assert _beams(done["G"]) == _beams(alone)
    # the greedy requests are unaffected as well
    for rid, p in (("C", prompt[:2]), ("C2", prompt[2:4])):
        assert done[rid].outputs[0].token_ids == roomy.generate([p], GREEDY)[0].outputs[0].token_ids


def test_generate_under_pressure_and_parallel_sampling(loaded_model):
    llm = LLM(loaded_model, block_size=2, num_blocks=13, debug_invariants=True)
    prompt = _prompt(llm)
    outs = llm.generate([prompt[:2], prompt[2:4], prompt], [GREEDY, GREEDY, BEAM])
    assert all(o.finished for o in outs) and len(outs[2].outputs) == 2
    # n > 1 (independent children) still works next to a beam search under pressure
    par = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    outs = llm.generate([prompt[:4], prompt], [par, BEAM])
    assert [len(o.outputs) for o in outs] == [2, 2]
    assert all(len(c.token_ids) == 8 for c in outs[0].outputs)
    assert llm.engine.kv.num_used_blocks == 0
    check_invariants(llm.engine.kv)


def test_a_stalled_step_raises_instead_of_spinning(loaded_model):
    llm = LLM(loaded_model, block_size=2, num_blocks=13)
    eng = llm.engine
    eng.add_request("x", [1, 2, 3], GREEDY)
    eng.step()
    req = eng.scheduler.running[0]
    req.num_computed_tokens = req.num_tokens  # simulate a bug: running, nothing to compute
    with pytest.raises(SchedulerStallError, match="stalled"):
        eng.step()
    eng.abort_request("x")
    eng.step()
    assert not eng.has_unfinished_requests() and eng.kv.num_used_blocks == 0
    check_invariants(eng.kv)
