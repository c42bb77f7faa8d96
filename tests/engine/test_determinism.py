"""Same request, same tokens (docs/determinism.md): a prompt's sampled tokens *and their
logprobs* are bit-identical alone, in a batch of 3, 8 or 33, with a prefill chunk budget of 4,
16 or 512 tokens, on 1 or 2 threads, with and without a prefix-cache hit, and with n-gram
speculation, greedy and seeded: at default settings on the default (``gguf``) route of both
bundled models and on int8/int4 weights and an int8 KV cache, and with ``deterministic=True``
on the dense fp32/bf16 formats too. ``make test-avx2`` runs this file again as an AVX2-only host."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.llm import LLM
from pagedkv.engine.request import SamplingParams
from pagedkv.model import invariant
from pagedkv.model.quant import cpu_features

PROMPT = "Explain in detail how a paged KV cache works in an LLM inference engine, and why it helps."
OTHERS = [f"Question {i}: what is {i} times {i + 3}? Then write a short poem about the number {i}." for i in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, logprobs=1, ignore_eos=True)


def _run(llm: LLM, batch: int = 1, sp: SamplingParams = GREEDY, last: bool = False):
    """``PROMPT`` with ``batch - 1`` other prompts (before it when ``last``): its token ids and
    each sampled token's logprob."""
    prompts = OTHERS[: batch - 1] + [PROMPT] if last else [PROMPT] + OTHERS[: batch - 1]
    out = llm.generate(prompts, sp, use_tqdm=False)[-1 if last else 0].outputs[0]
    return out.token_ids, [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]


def _llm(model: str, **kw) -> LLM:
    return LLM(model, kv_cache_memory="128MiB", **kw)


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_default_route_matrix(model, bundled_gguf, gemma3_gguf):
    llm = _llm(model)
    assert llm.engine.loaded.weights == "gguf"
    ref = _run(llm)
    assert len(ref[0]) == 16
    for batch in (3, 8, 33):
        assert _run(llm, batch) == ref, f"batch {batch}"
        assert _run(llm, batch, last=True) == ref, f"batch {batch}, prompt last"
    seeded = _run(llm, 1, SEEDED)
    assert _run(llm, 8, SEEDED) == seeded
    for chunk in (4, 16):
        c = _llm(model, max_num_batched_tokens=chunk)
        assert _run(c) == ref and _run(c, 8) == ref, f"chunk budget {chunk}"
        del c
    p = _llm(model, enable_prefix_caching=True)
    assert _run(p) == ref  # computes and publishes the prompt's full blocks
    hits = p.engine.get_stats().kv_prefix_hits
    assert _run(p) == ref and _run(p, 8) == ref  # the prompt's prefix now comes from the cache
    assert p.engine.get_stats().kv_prefix_hits > hits
    del p
    s = _llm(model, speculative="ngram")
    assert _run(s) == ref and _run(s, 8) == ref
    # seeded speculation draws its randomness per draft (accept/reject), so it is its own
    # sample of the same distribution: the same one alone and in a batch
    spec_seeded = _run(s, 1, SEEDED)
    assert _run(s, 8, SEEDED) == spec_seeded and _run(s, 33, SEEDED, last=True) == spec_seeded
    del s
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _run(llm) == ref and _run(llm, 8) == ref, "1 thread"
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("weights,kv,det", [("int8", "auto", False), ("int4", "auto", False), ("bf16", "auto", True),
                                            ("fp32", "auto", True), ("gguf", "int8", False)])
def test_every_weight_format_and_int8_kv(weights, kv, det, bundled_gguf):
    llm = _llm("smollm2-135m-instruct", weights=weights, kv_cache_dtype=kv, deterministic=det)
    # what the start-up log reports: invariant as loaded (int8/int4: qmm takes every row count
    # on a CPU without AMX; on an AMX host only with deterministic=True)
    amx = cpu_features().amx
    assert invariant.batch_invariant(llm.engine.loaded.model)[0] is (det or not (amx and weights in ("int8", "int4")))
    if amx and weights in ("int8", "int4") and not det:
        return  # oneDNN's routes by row count: not claimed
    ref = _run(llm)
    assert _run(llm, 3) == ref and _run(llm, 8) == ref
    c = _llm("smollm2-135m-instruct", weights=weights, kv_cache_dtype=kv, max_num_batched_tokens=4,
             enable_prefix_caching=True, deterministic=det)
    assert _run(c) == ref, "chunk budget 4"
    assert _run(c, 3) == ref, "chunk budget 4, prefix hit"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (576, 4096), (2048, 8192)])
def test_the_dense_linear_gives_a_row_the_same_bits_at_every_row_count(dtype, k, n):
    """``invariant.linear``: the BLAS kernel classes (1 / 2-3 / >= 4 rows here) never show."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(80, k, generator=g).to(dtype)
    old = torch.get_num_threads()
    try:
        ref = invariant.linear(x[:1], w)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 4, 5, 8, 33, 80):
                assert torch.equal(invariant.linear(x[:m], w)[0], ref[0]), (threads, m)
    finally:
        torch.set_num_threads(old)


def test_fp32_is_invariant_only_when_asked(bundled_gguf):
    """The default leaves fp32 on the BLAS's fastest kernels (a GEMV at batch 1), whose rows
    differ by batch size; ``deterministic=True`` pads them (``RowFloorLinear``)."""
    from pagedkv.errors import ConfigError

    with pytest.raises(ConfigError, match="deterministic must be True or False"):
        LLM("smollm2-135m-instruct", deterministic="yes")
    llm = _llm("smollm2-135m-instruct", weights="fp32")
    layers = [mod for mod in llm.engine.loaded.model.modules() if isinstance(mod, torch.nn.Linear)]
    assert layers and not any(isinstance(mod, invariant.RowFloorLinear) for mod in layers)
    assert invariant.batch_invariant(llm.engine.loaded.model) == (
        False, "dense layers (F.linear), the tied LM head (F.linear)")
    on = _llm("smollm2-135m-instruct", weights="fp32", deterministic=True)
    assert all(isinstance(mod, invariant.RowFloorLinear) for mod in on.engine.loaded.model.modules()
               if isinstance(mod, torch.nn.Linear))
    assert invariant.batch_invariant(on.engine.loaded.model) == (True, "")
