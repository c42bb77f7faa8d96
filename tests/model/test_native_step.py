"""The native decoder step (``pagedkv.model.native_step``): all layers of an eager CPU step in
one C call must give exactly what the per-layer Python path gives (same kernels, same order),
write the same K/V, decline the steps it does not take, and fail like the Python path."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata, BackendError
from pagedkv.testing.caches import allocate_kv_caches


@pytest.fixture(scope="module")
def int4_model(bundled_gguf):
    from pagedkv.model.loader import load_model

    return load_model(bundled_gguf, weights="int4")


def _step(lm, caches, ids: list[list[int]], starts: list[int], tables: list[list[int]], native: bool):
    """One forward of several sequences' new tokens ``ids[i]`` at positions ``starts[i]..``;
    returns the hidden states. ``native=False`` runs the per-layer Python path."""
    model = lm.model
    flat = torch.tensor([t for seq in ids for t in seq])
    pos = torch.tensor([s + j for seq, s in zip(ids, starts) for j in range(len(seq))])
    md = AttentionMetadata.build([s + len(q) for q, s in zip(ids, starts)], [len(q) for q in ids], tables, 16)
    if native:
        with torch.inference_mode():
            return model(flat, pos, caches, md, get_backend("cpu"))
    saved, model._native = model._native, None
    try:
        with torch.inference_mode():
            return model(flat, pos, caches, md, get_backend("cpu"))
    finally:
        model._native = saved


def _caches(lm):
    return allocate_kv_caches(lm.model, get_backend("cpu"), num_blocks=24, block_size=16)


def test_native_step_is_on_for_the_bundled_int4_model_and_rebuilt_after_a_re_prepare(int4_model):
    first = _native(int4_model)
    layer = int4_model.model.layers[3].o_proj
    layer.prepare(layer.route)  # new packed buffers: the old decoder would point at freed ones
    assert first.stale()
    assert _native(int4_model) is not first and not int4_model.model._native.stale()
    second = int4_model.model._native
    norm = int4_model.model.layers[5].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())  # a tensor it pointed into, replaced
    assert second.stale()
    assert _native(int4_model) is not second


def test_staleness_sees_slots_written_without_setattr_and_keeps_swapped_memory(int4_model):
    """``stale`` compares each slot the decoder reaches through (``_modules`` / ``_parameters``
    entries): a parameter written into its slot directly (as ``torch.func.functional_call``
    does) is seen, an unrelated module is not; a ``.data`` swap keeps the old storage alive."""
    native = _native(int4_model)
    torch.nn.Linear(4, 4)  # built elsewhere: nothing of the model's
    assert not native.stale()
    norm = int4_model.model.layers[7].input_layernorm
    saved = norm._parameters["weight"]
    norm._parameters["weight"] = torch.nn.Parameter(saved.detach() * 3)  # no setattr, no hook
    try:
        assert native.stale()
    finally:
        norm._parameters["weight"] = saved
    assert not native.stale()  # the same object back in its slot
    ptr = saved.data_ptr()
    assert any(isinstance(a, torch.UntypedStorage) and a.data_ptr() == ptr for a in native._alive)


def test_prefill_and_decode_equal_the_python_path_bit_for_bit(int4_model):
    tok = int4_model.tokenizer
    a = tok("The capital of France is Paris. The capital of Italy is")["input_ids"]  # crosses a block edge
    b = tok("def fibonacci(n):")["input_ids"]
    tables = [[3, 7, 1], [5, 2]]
    runs = {}
    for native in (True, False):
        caches = _caches(int4_model)
        h1 = _step(int4_model, caches, [a, b], [0, 0], tables, native)  # a mixed prefill of two sequences
        h2 = _step(int4_model, caches, [[a[-1]], [b[-1]]], [len(a), len(b)], tables, native)  # a decode step
        h3 = _step(int4_model, caches, [[42]], [len(a) + 1], tables[:1], native)  # batch 1
        runs[native] = (h1, h2, h3, [(c.key.clone(), c.value.clone()) for c in caches])
    for x, y in zip(runs[True][:3], runs[False][:3]):
        assert torch.equal(x, y)
    for (k1, v1), (k2, v2) in zip(runs[True][3], runs[False][3]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert runs[True][0].abs().sum() > 0


def test_engine_tokens_equal_with_and_without_the_native_step(int4_model, monkeypatch):
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.request import SamplingParams

    prompts = ["Once upon a time, a small robot " * 6, "Water boils at", "List three colours:"]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(int4_model, num_blocks=64, max_num_batched_tokens=32)  # chunked prefill of the long prompt
    native = [list(o.token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    saved = int4_model.model._native
    int4_model.model._native = None
    try:
        python = [list(o.token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        int4_model.model._native = saved
    assert native == python and all(len(t) == 20 for t in native)


def _native(lm):
    ids = lm.tokenizer("Hi")["input_ids"]
    _step(lm, _caches(lm), [ids], [0], [[0]], native=True)  # the first forward builds it
    assert lm.model.native_state == "on"
    return lm.model._native


def test_declines_steps_it_does_not_take(int4_model):
    native = _native(int4_model)
    ids = int4_model.tokenizer("Hello there")["input_ids"]
    t = len(ids)
    residual = torch.zeros(t, 576)
    cos = sin = torch.zeros(t, 1, 32)
    md = AttentionMetadata.build([t], [t], [[0]], 16)
    caches = _caches(int4_model)
    # a backend without native_step_args (the reference one)
    assert not native.run(residual, [(cos, sin)], caches, md, get_backend("reference"))
    # the profiler keeps the per-layer regions
    with torch.profiler.profile():
        assert not native.run(residual, [(cos, sin)], caches, md, get_backend("cpu"))
    # a row count the integer kernels do not take
    rows, native.rows = native.rows, t
    try:
        assert not native.run(residual, [(cos, sin)], caches, md, get_backend("cpu"))
    finally:
        native.rows = rows
    assert torch.equal(residual, torch.zeros(t, 576)) and all(c.key.abs().sum() == 0 for c in caches)


def test_a_slot_past_the_cache_is_a_backend_error_and_writes_nothing(int4_model):
    caches = _caches(int4_model)
    ids = int4_model.tokenizer("Hello")["input_ids"]
    with pytest.raises(BackendError, match="slot"):
        _step(int4_model, caches, [ids], [0], [[99]], native=True)  # block 99 of 24
    assert all(c.key.abs().sum() == 0 and c.value.abs().sum() == 0 for c in caches)


def test_off_switch_and_ineligible_models(monkeypatch, int4_model, loaded_model):
    from pagedkv.model.native_step import NativeDecoder

    monkeypatch.setenv("PAGEDKV_NATIVE_STEP", "0")
    assert NativeDecoder.create(int4_model.model) == (None, "off (PAGEDKV_NATIVE_STEP=0)")
    monkeypatch.delenv("PAGEDKV_NATIVE_STEP")
    loaded_model.model.prepare_step(again=True)
    decoder, why = NativeDecoder.create(loaded_model.model)  # fp32 weights: plain nn.Linear layers
    assert decoder is None and "integer-kernel" in why
