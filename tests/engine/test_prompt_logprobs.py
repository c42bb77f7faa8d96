"""SamplingParams(prompt_logprobs=k): values against transformers' log-softmax (fp32, same
GGUF), with chunked prefill, a prefix-cache hit bypassed, n > 1, and top-k alternatives."""

import pytest
import torch

from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.request import SamplingParams
from pagedkv.errors import InvalidRequestError

PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


def _hf_logprobs(hf_model, ids):
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [P, vocab]: row j scores token j + 1


def _run(engine, prompt, params, rid="r"):
    engine.add_request(rid, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                final = o
    return final


@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_match_transformers(loaded_model, hf_model, chunk):
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=chunk) if chunk else {}
    engine = LLMEngine(loaded_model, dtype="float32", num_blocks=64, block_size=4, **kw)
    ids = engine.tokenize(PROMPT)
    out = _run(engine, ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    ref = _hf_logprobs(hf_model, ids)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        d = plp[j]
        assert abs(d[ids[j]] - ref[j - 1, ids[j]].item()) < 1e-4
        top = torch.topk(ref[j - 1], 3).indices.tolist()
        assert list(d)[1:] == [t for t in top if t != ids[j]] or list(d)[1:] == top  # prompt token first
        for t, v in d.items():
            assert abs(v - ref[j - 1, t].item()) < 1e-4
    assert out.outputs[0].token_ids[0] == int(ref[-1].argmax())


def test_prefix_cache_hit_is_bypassed_for_prompt_logprobs(loaded_model, hf_model):
    engine = LLMEngine(loaded_model, dtype="float32", num_blocks=64, block_size=4, enable_prefix_caching=True)
    ids = engine.tokenize(PROMPT)
    _run(engine, ids, SamplingParams(temperature=0, max_tokens=1), "warm")
    again = _run(engine, ids, SamplingParams(temperature=0, max_tokens=1), "hit")
    assert again.num_cached_tokens >= 12  # the prompt's full blocks are cached
    out = _run(engine, ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, n=2), "plp")
    assert out.num_cached_tokens == 0
    ref = _hf_logprobs(hf_model, ids)
    got = [d[ids[j]] for j, d in enumerate(out.prompt_logprobs) if j]
    want = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert all(len(d) == 1 for d in out.prompt_logprobs[1:])


def test_prompt_logprobs_validated(loaded_model):
    engine = LLMEngine(loaded_model, dtype="float32", num_blocks=16)
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            engine.add_request("x", "hi", SamplingParams(prompt_logprobs=bad))
    assert engine.kv.num_free_blocks == 16
