"""Engine API behaviour: seeded sampling, stops, bad input, statistics."""

from __future__ import annotations

import pytest

from pagedkv import LLM, InvalidRequestError, SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.kv import check_invariants


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded_model, block_size=8, num_blocks=256, max_model_len=512, debug_invariants=True)


def test_seeded_sampling_same_alone_or_in_batch_of_16(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = "Once upon a time"
    alone = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=24 + i) for i in range(15)]
    batch = llm.generate([f"Story number {i}:" for i in range(15)] + [prompt], others + [sp], use_tqdm=False)
    assert batch[-1].token_ids == alone
    assert len(alone) == 24
    different_seed = llm.generate([prompt], SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99,
                                                           max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    assert different_seed.token_ids != alone


def test_max_tokens_and_length_finish(llm):
    out = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_string_cuts_text(llm):
    free = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    # pick a stop string from the model's own continuation so the test is real
    stop = free.text.strip()[2:4]
    assert stop
    out = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert free.text.startswith(out.text)
    assert out.outputs[0].stop_reason == stop


def test_stop_token_ids(llm):
    free = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    tok = free.token_ids[3]
    out = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tok], ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(tok) + 1]
    assert out.finish_reason == "stop"


def test_max_model_len_caps_output(loaded_model):
    llm = LLM(loaded_model, block_size=8, num_blocks=64, max_model_len=20)
    prompt = list(range(100, 115))  # 15 tokens
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        (list(range(600)), SamplingParams(), "max_model_len"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", SamplingParams(temperature=-0.5), "temperature"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ([10**7], SamplingParams(), "token ids"),
        ("hi", SamplingParams(logit_bias={49152: 5.0}), "logit_bias"),  # vocab is 49,152: ids 0..49151
    ],
)
def test_bad_input_is_typed_and_leaves_engine_clean(llm, prompt, params, match):
    eng = llm.engine
    before = eng.kv.num_used_blocks
    with pytest.raises(InvalidRequestError, match=match):
        eng.add_request(None, prompt, params)
    assert not eng.has_unfinished_requests()
    assert eng.kv.num_used_blocks == before == 0
    # the engine keeps serving
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 3
    check_invariants(eng.kv)


def test_request_that_could_never_fit_is_rejected(loaded_model):
    llm = LLM(loaded_model, block_size=4, num_blocks=8, max_model_len=512)  # 32 slots
    with pytest.raises(InvalidRequestError, match="could never fit"):
        llm.generate(["word " * 40], SamplingParams(max_tokens=4), use_tqdm=False)
    ok = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].token_ids) == 4
    assert llm.engine.kv.num_used_blocks == 0


def test_bad_batch_admits_nothing(llm):
    eng = llm.engine
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not eng.has_unfinished_requests()
    assert eng.kv.num_used_blocks == 0


def test_bad_engine_options(loaded_model):
    with pytest.raises(ConfigError):
        LLM(loaded_model, block_size=0)
    with pytest.raises(ConfigError):
        LLM(loaded_model, not_an_option=1)
    with pytest.raises(ConfigError):
        LLM(loaded_model, max_num_seqs=0, num_blocks=8)


def test_stats_and_logprobs(llm):
    out = llm.generate(["The sky is"], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for tok, d in zip(out.token_ids, lps):
        assert tok in d and len(d) == 3  # greedy token is among the top 3
        assert max(d.values()) == d[tok]
    st = llm.engine.get_stats()
    assert st.num_used_blocks == 0 and st.num_blocks == 256
    assert st.num_generated_tokens >= 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompt=None), "prompt must be"),
        (dict(prompt=5), "prompt must be"),
        (dict(params=SamplingParams(stop=5)), "stop"),
        (dict(params=SamplingParams(stop_token_ids=5)), "stop_token_ids"),
        (dict(mm_hashes=5), "mm_hashes"),
        (dict(params=SamplingParams(seed=2**64)), "seed"),
        (dict(arrival_time="now"), "arrival_time"),
        (dict(params=SamplingParams(skip_special_tokens="no")), "skip_special_tokens"),
        (dict(priority="high"), "priority"),
        (dict(params=SamplingParams(beam_width=2, length_penalty=1e308)), "length_penalty"),
        (dict(request_id="x#1"), "must not contain"),
        (dict(params=SamplingParams(n=True)), "SamplingParams.n"),
    ],
)
def test_malformed_request_fields_are_typed_errors(llm, kwargs, match):
    eng = llm.engine
    call = dict(request_id=None, prompt="hi", params=SamplingParams())
    call.update(kwargs)
    extra = {k: call.pop(k) for k in ("arrival_time", "priority", "mm_hashes") if k in call}
    with pytest.raises(InvalidRequestError, match=match):
        eng.add_request(call["request_id"], call["prompt"], call["params"], **extra)
    assert not eng.has_unfinished_requests() and eng.kv.num_used_blocks == 0


def test_tiny_temperature_is_greedy(llm):
    tiny = llm.generate(["The capital of France is"], SamplingParams(temperature=1e-40, max_tokens=4), use_tqdm=False)[0]
    greedy = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert tiny.token_ids == greedy.token_ids and 0 not in tiny.token_ids


def test_failed_step_closes_its_fence(loaded_model):
    """An exception inside step() (here an interrupt in the forward) must not leave the step
    fence open: after an abort every block returns to the pool."""
    llm = LLM(loaded_model, block_size=4, num_blocks=32)
    eng = llm.engine
    eng.add_request("a", "Hello there", SamplingParams(max_tokens=4))
    real = eng.runner.execute

    def boom(inp):
        raise KeyboardInterrupt

    eng.runner.execute = boom
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    eng.runner.execute = real
    assert eng.kv.open_steps == {}
    eng.abort_request("a")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv.num_used_blocks == 0
    check_invariants(eng.kv)


@pytest.mark.parametrize(
    "opts",
    [dict(max_model_len="512"), dict(max_num_seqs=None), dict(max_num_batched_tokens=2.5),
     dict(watermark="0.1"), dict(seed="x"), dict(device="nope"), dict(seed=2**70)],
)
def test_bad_engine_option_types(loaded_model, opts):
    with pytest.raises(ConfigError):
        LLM(loaded_model, num_blocks=8, **opts)
