"""Qwen3's q/k norms and mixture-of-experts layers on the fused and native CPU paths
(``pagedkv.model.fused.head_rms_norm``, ``pagedkv/csrc/decoder.c``).

A tiny Qwen3 (3 layers, hidden 64, q/k norms with non-trivial weights) loaded with int8 weights
runs natively: its steps must equal the fused Python path bit for bit (same kernels, same
order; hidden states and the K/V written), and the engine's greedy tokens must equal the eager
torch path's on the same weights. The fp32 model on the fused path is compared with
transformers by tests/model/test_families.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.model.loader import load_model
from tests.model.test_native_step import _caches, _step


@pytest.fixture(scope="module")
def qwen3_int8(tmp_path_factory):
    from tests.model.test_families import _hf_config
    from tests.model.test_llama import _tiny_tokenizer

    cfg, cls = _hf_config("qwen3")
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif any(k in name for k in ("q_proj", "k_proj", "embed_tokens")):
                p.mul_(8.0)
    out = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(out)
    _tiny_tokenizer().save_pretrained(out)
    return load_model(out, weights="int8")


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
    lm = qwen3_int8
    prompts = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 9, 20)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(lm, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert lm.model.native_state == "on"
    undo = _eager(lm.model)
    try:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        undo()
    assert native == eager and all(len(t) == 12 for t in native)


def test_head_rms_norm_normalises_each_head_in_place_as_torch():
    from pagedkv.model import fused
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
