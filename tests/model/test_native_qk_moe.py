"""Qwen3's q/k norms and mixture-of-experts layers on the fused and native CPU paths
(``pagedkv.ops.fused_ops.head_rms_norm``, ``pagedkv/csrc/decoder.c``).

A tiny Qwen3 (3 layers, hidden 64, q/k norms with non-trivial weights) loaded with int8 weights
runs natively: its steps must equal the fused Python path bit for bit (same kernels, same
order; hidden states and the K/V written), and the engine's greedy tokens must equal the eager
torch path's on the same weights. The fp32 model on the fused path is compared with
transformers by tests/model/test_families.py.

The tiny ``qwen3moe`` and ``llama`` (Mixtral) GGUFs of tests/model/test_gguf_moe.py (Q8_0
experts, 8 of them, 2 routed) run their MoE layers in decoder.c: the hidden states of a prefill
chunk, a two-sequence batch and a one-token decode step equal the eager torch path's to float
rounding (router dot products, softmax and SiLU round differently; measured <= 2.4e-7 at values
~4), the K/V written agrees likewise, the engine's greedy tokens are equal, and a decode step
reads only the routed experts (the others' weight pointers set to NULL: the step still succeeds
and agrees; a routed one NULL is a RuntimeError).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.model.loader import load_model
from tests.model.builders import (
    NORM_NOISE, match, moe_config, moe_gguf_model, prompt, save_tiny, seeded_model, write_moe_gguf,
)
from tests.model.test_native_step import _caches, _step


@pytest.fixture(scope="module")
def qwen3_int8(tmp_path_factory):
    from tests.model.test_families import _hf_config

    rules = [NORM_NOISE, (match(has=("q_proj", "k_proj", "embed_tokens")), "mul", 8.0)]
    hf = seeded_model(*_hf_config("qwen3"), rules, eager=False)
    return load_model(save_tiny(hf, tmp_path_factory.mktemp("qwen3")), weights="int8")


def _eager(model):
    """Turn ``model`` (a LlamaForCausalLM that ran once) to the torch ops; returns an undo."""
    saved = model._native, [layer.fused for layer in model.layers]
    model._native = None
    for layer in model.layers:
        layer.fused = None

    def undo():
        model._native = saved[0]
        for layer, f in zip(model.layers, saved[1]):
            layer.fused = f
    return undo


def _native_and_eager_tokens(lm, prompts: list[list[int]]) -> tuple[list, list]:
    """One engine's 12 greedy tokens per prompt (4-token blocks, 16-token chunks) on the native
    step loop (asserted on), then on the eager torch ops: ``(native, eager)``."""
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(lm, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert lm.model.native_state == "on"
    undo = _eager(lm.model)
    try:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        undo()
    return native, eager


def test_qwen3_runs_natively_and_equals_the_fused_path_bit_for_bit(qwen3_int8):
    lm = qwen3_int8
    a = torch.randint(3, 97, (21,), generator=torch.Generator().manual_seed(3)).tolist()  # crosses a block edge
    b = [5, 9, 11, 40, 2]
    tables = [[3, 7, 1], [5, 2]]
    runs = {}
    for native in (True, False):
        caches = _caches(lm)
        h1 = _step(lm, caches, [a, b], [0, 0], tables, native)
        h2 = _step(lm, caches, [[a[-1]], [b[-1]]], [len(a), len(b)], tables, native)
        h3 = _step(lm, caches, [[42]], [len(a) + 1], tables[:1], native)
        runs[native] = (h1, h2, h3, [(c.key.clone(), c.value.clone()) for c in caches])
    assert lm.model.native_state == "on" and all(layer.q_norm is not None for layer in lm.model.layers)
    for x, y in zip(runs[True][:3], runs[False][:3]):
        assert torch.equal(x, y)
    for (k1, v1), (k2, v2) in zip(runs[True][3], runs[False][3]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # the eager torch path on the same weights agrees to float rounding
    undo = _eager(lm.model)
    try:
        eager = _step(lm, _caches(lm), [a, b], [0, 0], tables, native=False)
    finally:
        undo()
    torch.testing.assert_close(runs[True][0], eager, rtol=1e-4, atol=1e-4)


def test_qwen3_native_engine_tokens_equal_the_eager_path(qwen3_int8):
    native, eager = _native_and_eager_tokens(qwen3_int8, [prompt(n, n) for n in (37, 9, 20)])
    assert native == eager and all(len(t) == 12 for t in native)


def test_head_rms_norm_normalises_each_head_in_place_as_torch():
    from pagedkv.ops import fused_ops as fused
    from pagedkv.model.llama import _rms_norm

    ops = fused.get()
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, (4 + 2 * 2) * 16, generator=g) * 5
    wq, wk = torch.randn(16, generator=g), torch.randn(16, generator=g)
    want = qkv.clone().view(9, 8, 16)
    want[:, :4] = _rms_norm(want[:, :4], wq, 1e-6)
    want[:, 4:6] = _rms_norm(want[:, 4:6], wk, 1e-6)
    got = qkv.clone()
    ops.head_rms_norm(got, 0, 4, 16, wq, 1e-6)
    ops.head_rms_norm(got, 4, 2, 16, wk, 1e-6)
    torch.testing.assert_close(got.view(9, 8, 16), want, rtol=2e-6, atol=2e-6)
    assert torch.equal(got[:, 6 * 16:], qkv[:, 6 * 16:])  # v untouched
    with pytest.raises(ValueError, match="exceed"):
        ops.head_rms_norm(got, 6, 3, 16, wk, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        ops.head_rms_norm(got, 0, 4, 16, torch.ones(8), 1e-6)


@pytest.fixture(scope="module", params=["qwen3moe", "llama"])
def moe_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "tiny-moe.gguf"
    write_moe_gguf(moe_gguf_model(request.param), path, request.param)
    return load_model(path, weights="auto")


def _moe_steps(lm, native: bool):
    """A prefill chunk of two sequences, their decode tokens, then a batch-1 step: hidden states
    and the caches, on the native path or (``native=False``) the eager torch ops."""
    undo = None if native else _eager(lm.model)
    try:
        caches = _caches(lm)
        a, b = list(range(5, 23)), [7, 90, 3, 50]
        tables = [[3, 7], [5, 2]]
        hs = [_step(lm, caches, [a, b], [0, 0], tables, True),
              _step(lm, caches, [[a[-1]], [b[-1]]], [len(a), len(b)], tables, True),
              _step(lm, caches, [[42]], [len(a) + 1], tables[:1], True)]
        return hs, caches
    finally:
        if undo is not None:
            undo()


def test_moe_native_steps_equal_the_eager_moe_to_float_rounding(moe_gguf):
    lm = moe_gguf
    (native, nc), (eager, ec) = _moe_steps(lm, True), _moe_steps(lm, False)
    assert lm.model.native_state == "on" and all(layer.mlp is not None for layer in lm.model.layers)
    assert sorted(lm.model._native.experts) == [0, 1, 2]
    for x, y in zip(native, eager):
        assert x.abs().max() > 1
        torch.testing.assert_close(x, y, rtol=0, atol=2e-6)
        assert torch.equal(lm.model.compute_logits(x).argmax(-1), lm.model.compute_logits(y).argmax(-1))
    for c1, c2 in zip(nc, ec):
        torch.testing.assert_close(c1.key, c2.key, rtol=0, atol=2e-6)
        torch.testing.assert_close(c1.value, c2.value, rtol=0, atol=2e-6)


def test_moe_native_steps_are_the_same_bits_on_one_or_two_threads(moe_gguf):
    """With few tokens decoder.c runs the routed experts side by side (one expert per thread)
    and adds their rows afterwards in increasing expert id; on one thread it runs them one at
    a time: the same hidden states and caches, bit for bit."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two, c2 = _moe_steps(moe_gguf, True)
        torch.set_num_threads(1)
        one, c1 = _moe_steps(moe_gguf, True)
    finally:
        torch.set_num_threads(threads)
    assert moe_gguf.model.native_state == "on"
    for x, y in zip(two, one):
        assert torch.equal(x, y)
    for a, b in zip(c2, c1):
        assert torch.equal(a.key, b.key) and torch.equal(a.value, b.value)


def test_a_long_moe_chunk_runs_its_experts_one_at_a_time_on_every_thread_with_the_same_bits(moe_gguf):
    """Past 64 tokens (``EXPERT_PAR_T``) decoder.c runs the experts one at a time, each matmul
    on all threads (outside any parallel region of its own): the same bits on two threads as
    on one."""
    lm, threads = moe_gguf, torch.get_num_threads()
    a = [(7 * i + 3) % 250 + 5 for i in range(70)]

    def chunk():
        caches = _caches(lm)
        return _step(lm, caches, [a], [0], [[3, 7, 1, 4, 6]], True), caches

    try:
        torch.set_num_threads(2)
        (two, c2) = chunk()
        torch.set_num_threads(1)
        (one, c1) = chunk()
    finally:
        torch.set_num_threads(threads)
    assert lm.model.native_state == "on" and two.shape[0] == 70 and two.abs().max() > 1
    assert torch.equal(two, one) and all(torch.equal(x.key, y.key) for x, y in zip(c2, c1))


def test_moe_native_engine_tokens_equal_the_eager_path(moe_gguf):
    native, eager = _native_and_eager_tokens(moe_gguf, [prompt(n, n, 0, 256) for n in (30, 7, 12)])
    assert native == eager and all(len(t) == 12 for t in native)


def test_a_native_decode_step_reads_only_the_routed_experts(moe_gguf):
    lm = moe_gguf
    net = lm.model
    prompt = list(range(30, 41))
    routed: dict[int, list[int]] = {}
    undo = _eager(net)  # the eager run says which experts the decode token routes to
    handles = [layer.mlp.register_forward_pre_hook(
        lambda m, args, i=i: routed.__setitem__(i, sorted(set(m.route(args[0])[1].flatten().tolist()))))
        for i, layer in enumerate(net.layers)]
    try:
        caches = _caches(lm)
        _step(lm, caches, [prompt], [0], [[1]], True)
        want = _step(lm, caches, [[77]], [len(prompt)], [[1]], True)
    finally:
        for h in handles:
            h.remove()
        undo()
    native = net._native
    caches, again = _caches(lm), _caches(lm)
    for c in (caches, again):
        _step(lm, c, [prompt], [0], [[1]], True)
    saved = {i: (list(g), list(d)) for i, (g, d) in native.experts.items()}
    try:
        for i, (g, d) in native.experts.items():  # every expert not routed to: no weights
            assert len(routed[i]) == 2
            for e in range(len(g)):
                if e not in routed[i]:
                    g[e] = d[e] = None
        got = _step(lm, caches, [[77]], [len(prompt)], [[1]], True)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
        native.experts[1][1][routed[1][0]] = None  # a routed expert of layer 1 without weights
        with pytest.raises(RuntimeError, match="routed expert of layer 1"):
            _step(lm, again, [[77]], [len(prompt)], [[1]], True)
    finally:
        for i, (g, d) in native.experts.items():
            for e in range(len(g)):
                g[e], d[e] = saved[i][0][e], saved[i][1][e]


def test_int8_qwen3_moe_with_a_dense_layer_runs_natively_like_the_eager_path(tmp_path):
    """transformers' Qwen3-MoE with layer 1 dense (``mlp_only_layers``), experts quantised to
    int8 (``Int8Linear`` modules, not GGUF): dense and MoE layers mixed in one native loop."""
    hf = seeded_model(*moe_config("qwen3_moe"), [(match(ends=("gate.weight",)), "mul", 20.0)], eager=False)
    lm = load_model(save_tiny(hf, tmp_path), weights="int8")
    (native, _), (eager, _) = _moe_steps(lm, True), _moe_steps(lm, False)
    assert lm.model.native_state == "on" and sorted(lm.model._native.experts) == [0, 2]
    assert lm.model.layers[1].mlp is None
    for x, y in zip(native, eager):
        # measured <= 6e-7; int8 activation blocks: a rounding-level change (SiLU, router) can
        # move one block's code (~1e-3, seen on a larger random model), so the bound allows it
        torch.testing.assert_close(x, y, rtol=0, atol=5e-3)
        assert torch.equal(lm.model.compute_logits(x).argmax(-1), lm.model.compute_logits(y).argmax(-1))
