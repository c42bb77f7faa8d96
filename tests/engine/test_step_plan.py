"""SchedulerOutput (pagedkv/engine/step_plan.py): model inputs, prompt-logprob rows and the
sampled sequences of a hand-made plan (prefill chunk, last chunk, decode)."""

from pagedkv.engine.request import Request, SamplingParams
from pagedkv.engine.step_plan import SchedulerOutput


def _req(rid, prompt, out=(), computed=0, prompt_logprobs=None):
    r = Request(rid, list(prompt), SamplingParams(prompt_logprobs=prompt_logprobs), arrival_time=0.0)
    for t in out:
        r.append_output_token(t)
    r.num_computed_tokens = computed
    return r


def _plan():
    chunk = _req("chunk", range(10, 20), computed=4, prompt_logprobs=2)  # 10 prompt tokens, 4 done
    last = _req("last", [1, 2, 3, 4, 5], computed=3, prompt_logprobs=0)  # its last 2 prompt tokens
    decode = _req("decode", [7, 8], out=[9, 30], computed=3)  # 4 tokens, 3 computed
    return SchedulerOutput(scheduled=[(chunk, 3), (last, 2), (decode, 1)], copies=[(5, 6)], preempted=[],
                           step_id=7, num_batched_tokens=6, block_ids=[[0, 1], [2], [3]])


def test_model_inputs():
    toks, starts, blocks, sample = _plan().model_inputs()
    assert toks == [[14, 15, 16], [4, 5], [30]]
    assert starts == [4, 3, 3]
    assert blocks == [[0, 1], [2], [3]]
    assert sample == [False, True, True]


def test_sampling_requests_are_those_that_reach_their_end():
    assert [r.request_id for r in _plan().sampling_requests()] == ["last", "decode"]


def test_prompt_rows():
    # chunk: positions 4..6 all score a next prompt token -> 3; last: positions 3, 4 of a
    # 5-token prompt, only position 3 scores a prompt token -> 1; decode: not asked -> 0
    assert _plan().prompt_rows() == [3, 1, 0]


def test_prompt_rows_of_a_whole_prompt_and_of_a_decode_step():
    whole = _req("w", [1, 2, 3, 4], prompt_logprobs=1)
    assert SchedulerOutput([(whole, 4)], [], [], 0).prompt_rows() == [3]
    dec = _req("d", [1, 2], out=[3], computed=2, prompt_logprobs=1)
    assert SchedulerOutput([(dec, 1)], [], [], 0).prompt_rows() == [0]


def test_empty_plan():
    p = SchedulerOutput(scheduled=[], copies=[], preempted=[], step_id=0)
    assert p.is_empty and p.model_inputs() == ([], [], [], []) and p.sampling_requests() == []
    assert not _plan().is_empty and p.num_batched_tokens == 0 and p.kv_transfer is None
