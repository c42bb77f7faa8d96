"""gpt-oss layers in the native decoder step (``pagedkv.model.native_step``, ``decoder.c``):
attention sinks (the attention kernel joins each query head's sink to its softmax), q/k/v and
``o_proj`` biases (inside the packed weights), sliding and full layers as two KV layer groups,
and the mixture of experts with a biased router, ``topk_softmax`` routing, biased experts and the
clamped SwiGLU (``moe_ffn``).

The tiny gpt-oss of tests/model/test_families_gptoss.py (3 layers: window 8, full, window 8;
4 experts, 2 routed; decisive routers) loaded with ``weights="int8"`` runs natively:

* its hidden states equal the per-layer Python path's (fused ops, the same attention kernel,
  the MoE's torch ops) to float rounding (router dot products, the routing softmax and the
  SwiGLU round differently; measured <= 5e-6 at values ~5), and the K/V written likewise, over a
  prefill of two sequences (one over a block edge), their decode steps and a batch-1 step, at
  block sizes 1 and 16; the eager torch path (torch attention with the sink as a score column)
  agrees to 5e-5 (measured <= 2.2e-6), and zeroed sinks move the states well past that;
* the same bits on one or two threads;
* the engine's greedy tokens are equal with ``PAGEDKV_NATIVE_STEP=0`` and ``=1`` (every step of
  the native run in the C loop), at block sizes 1 and 16;
* the fp32 model (whose tokens tests/model/test_families_gptoss.py compares with transformers)
  runs the fused path and declines the native step (no integer-kernel weights), as do expert
  groups and sinks of another dtype.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.attention.cpu import CPUBackend
from pagedkv.model.loader import load_model
from pagedkv.model.native_step import NativeDecoder
from pagedkv.testing.caches import allocate_kv_caches
from tests.model.builders import GPTOSS_RULES, gptoss_config, prompt, save_tiny, seeded_model
from tests.model.test_native_gemma import _calls


@pytest.fixture(scope="module")
def gptoss_dir(tmp_path_factory):
    return save_tiny(seeded_model(*gptoss_config(), GPTOSS_RULES), tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def gptoss_int8(gptoss_dir):
    return load_model(gptoss_dir, weights="int8")


def _tables(lens: list[int], block: int, offset: int) -> list[list[int]]:
    """Block tables of sequences of ``lens`` tokens, blocks numbered from ``offset`` (a KV group's own)."""
    out, at = [], offset
    for n in lens:
        k = -(-n // block)
        out.append(list(range(at + k - 1, at - 1, -1)))  # descending: a table is not the identity
        at += k
    return out


def _step(lm, caches, ids, starts, block: int, native: bool, backend=None):
    """One forward of sequences' new tokens ``ids[i]`` at positions ``starts[i]..``: the sliding
    layers and the full layer each with their own metadata (two KV layer groups), tables for the
    sequences' final lengths; ``native=False``: the per-layer path."""
    model = lm.model
    flat = torch.tensor([t for seq in ids for t in seq])
    pos = torch.tensor([s + j for seq, s in zip(ids, starts) for j in range(len(seq))])
    lens, qlens = [s + len(q) for q, s in zip(ids, starts)], [len(q) for q in ids]
    final = [23, 7][:len(ids)]
    md = {w: AttentionMetadata.build(lens, qlens, _tables(final, block, 0 if w else 2), block)
          for w in set(lm.config.layer_windows())}
    per_layer = [md[w] for w in lm.config.layer_windows()]
    saved = model._native
    if not native:
        model._native = None
    try:
        with torch.inference_mode():
            return model(flat, pos, caches, per_layer, backend or get_backend("cpu"))
    finally:
        model._native = saved


def _run(lm, block: int, native: bool, backend=None):
    """Prefill a (21 tokens) and b (5), decode both, then a alone: hidden states and caches."""
    a, b = prompt(21, 3), prompt(5, 4)
    caches = allocate_kv_caches(lm.model, get_backend("cpu"), num_blocks=2 * 23 + 4, block_size=block)
    hs = [_step(lm, caches, [a, b], [0, 0], block, native, backend),
          _step(lm, caches, [[a[-1]], [b[-1]]], [21, 5], block, native, backend),
          _step(lm, caches, [[42]], [22], block, native, backend)]
    return hs, caches


@pytest.mark.parametrize("block", [1, 16])
def test_native_steps_equal_the_python_path(gptoss_int8, block, monkeypatch):
    lm, model = gptoss_int8, gptoss_int8.model
    model.prepare_step(again=True)
    assert model.native_state == "on" and model.step_route == "native" and sorted(model._native.experts) == [0, 1, 2]
    assert all(layer.sinks is not None and layer.qkv_proj.bias is not None and layer.o_proj.bias is not None
               for layer in model.layers)
    calls = _calls(monkeypatch)
    native, nc = _run(lm, block, True)
    assert len(calls) == 3  # each step one C call
    python, pc = _run(lm, block, False)
    assert len(calls) == 3
    for x, y in zip(native, python):
        assert x.abs().max() > 1
        torch.testing.assert_close(x, y, rtol=0, atol=2e-5)
        assert torch.equal(model.compute_logits(x).argmax(-1), model.compute_logits(y).argmax(-1))
    for c1, c2 in zip(nc, pc):
        torch.testing.assert_close(c1.key, c2.key, rtol=0, atol=2e-5)
        torch.testing.assert_close(c1.value, c2.value, rtol=0, atol=2e-5)
    saved = [layer.fused for layer in model.layers]  # the eager torch ops, torch attention
    try:
        for layer in model.layers:
            layer.fused = None
        eager, _ = _run(lm, block, False, CPUBackend(use_kernel=False))
    finally:
        for layer, f in zip(model.layers, saved):
            layer.fused = f
    for x, y in zip(native, eager):
        torch.testing.assert_close(x, y, rtol=0, atol=5e-5)


def test_native_steps_are_the_same_bits_on_one_or_two_threads(gptoss_int8):
    """The routed experts side by side (one per thread) or one at a time, the sinks joined per
    row: the same hidden states and caches on any thread count."""
    gptoss_int8.model.prepare_step(again=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two, c2 = _run(gptoss_int8, 4, True)
        torch.set_num_threads(1)
        one, c1 = _run(gptoss_int8, 4, True)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(two, one))
    assert all(torch.equal(a.key, b.key) and torch.equal(a.value, b.value) for a, b in zip(c2, c1))


def test_zeroed_sinks_change_the_native_step(gptoss_int8):
    model = gptoss_int8.model
    model.prepare_step(again=True)
    want, _ = _run(gptoss_int8, 16, True)
    saved = [layer.sinks.detach().clone() for layer in model.layers]
    try:
        with torch.no_grad():
            for layer in model.layers:
                layer.sinks.zero_()  # in place: the native step reads them where they are
        got, _ = _run(gptoss_int8, 16, True)
    finally:
        with torch.no_grad():
            for layer, s in zip(model.layers, saved):
                layer.sinks.copy_(s)
    assert model.native_state == "on"
    assert (got[0] - want[0]).abs().max() > 0.05


@pytest.mark.parametrize("block", [1, 16])
def test_engine_tokens_equal_with_and_without_the_native_step(gptoss_int8, block, monkeypatch):
    model = gptoss_int8.model
    prompts = [prompt(37, 2), prompt(9, 3), prompt(20, 4)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PAGEDKV_NATIVE_STEP", flag)
        model.prepare_step(again=True)
        llm = LLM(gptoss_int8, block_size=block, num_blocks=512 // block, max_num_batched_tokens=16)
        calls, forwards, forward = _calls(monkeypatch), [], type(model).forward
        monkeypatch.setattr(type(model), "forward", lambda self, *a: forwards.append(1) or forward(self, *a))
        tokens[flag] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
        monkeypatch.setattr(type(model), "forward", forward)
        assert model.native_state == ("on" if flag == "1" else "off (PAGEDKV_NATIVE_STEP=0)")
        assert len(calls) == (len(forwards) if flag == "1" else 0) and len(forwards) > 16
    assert tokens["0"] == tokens["1"] and all(len(t) == 16 for t in tokens["1"])
    assert len({t for r in tokens["1"] for t in r}) > 8


def test_declined_cases_still_decline(gptoss_dir, gptoss_int8, monkeypatch):
    fp32 = load_model(gptoss_dir).model
    fp32.prepare_step(again=True)
    assert fp32.fused_state == "on" and all(layer.fusable for layer in fp32.layers)
    assert fp32._native is None and "integer-kernel" in fp32.native_state
    model = gptoss_int8.model
    layer = model.layers[1]
    spec, sinks = layer.mlp.spec, layer.sinks
    try:
        layer.mlp.spec = dataclasses.replace(spec, n_group=2, topk_group=1)  # group-limited routing
        assert NativeDecoder.create(model) == (None, "off (an MoE layer outside the native path: expert groups)")
        layer.mlp.spec = spec
        layer.sinks = torch.nn.Parameter(sinks.detach().double())  # not the float32 the C loop reads
        assert NativeDecoder.create(model) == (None, "off (weights of other shapes than the layer's config)")
    finally:
        layer.mlp.spec, layer.sinks = spec, sinks
    assert NativeDecoder.create(model)[1] == "on"
    monkeypatch.setenv("PAGEDKV_NATIVE_STEP", "0")
    assert NativeDecoder.create(model) == (None, "off (PAGEDKV_NATIVE_STEP=0)")
