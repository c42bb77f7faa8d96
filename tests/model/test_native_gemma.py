"""Gemma-2/3 layers in the native decoder step (``pagedkv.model.native_step``, ``decoder.c``):
sandwich norms, the local RoPE table of Gemma-3's sliding layers, attention soft-caps and one
set of attention arguments per KV layer group (hybrid sliding-window caches). The native step
must give exactly what the per-layer fused Python path gives (same kernels, same order): hidden
states and K/V bit for bit, and the engine's greedy tokens.

* The bundled Gemma-3-270M (``gemma3_gguf``, Q4_K_M as stored): 18 layers, 15 sliding (window
  512, local RoPE base 1e4) and 3 full, q/k norms, two KV layer groups.
* A tiny Gemma-2 (``test_families``' random model written as a GGUF by ``test_families_gguf``,
  int8 weights): attention soft-cap 3 (final 0.5), window 6 on every other layer, no local RoPE.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.testing.caches import allocate_kv_caches


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf):
    from pagedkv.model.loader import load_model

    return load_model(gemma3_gguf, weights="auto")


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from types import SimpleNamespace

    from pagedkv.gguf_header import read_gguf_header
    from pagedkv.model.loader import build_model
    from pagedkv.model.quantize import quantize_state
    from pagedkv.model.weights import gguf_config, gguf_state_dict
    from tests.model.builders import NORM_NOISE, match, seeded_model
    from tests.model.test_families import _hf_config
    from tests.model.test_families_gguf import _write_gguf

    cfg, cls = _hf_config("gemma2")
    cfg.query_pre_attn_scalar = cfg.head_dim
    hf = seeded_model(cfg, cls, [NORM_NOISE, (match(has=("q_proj", "k_proj", "embed_tokens")), "mul", 8.0)])
    path = tmp_path_factory.mktemp("gemma2") / "tiny-gemma2.gguf"
    _write_gguf(hf, "gemma2", path)  # (no tokenizer in it: the model is built from its tensors)
    header = read_gguf_header(path)
    config = gguf_config(path, header, "test")
    model = build_model(config, quantize_state(gguf_state_dict(path, header, config), config, "int8"))
    return SimpleNamespace(model=model, config=config)


def _calls(monkeypatch):
    """Count the native step's calls (every ``DecoderStep``, one rebuilt mid-run included)."""
    from pagedkv.ops.decoder import DecoderStep

    seen, call = [], DecoderStep.__call__

    def counted(self, *a, **k):
        seen.append(1)
        return call(self, *a, **k)

    monkeypatch.setattr(DecoderStep, "__call__", counted)
    return seen


def _step(lm, caches, ids, starts, tables, native: bool):
    """One forward of sequences' new tokens ``ids[i]`` at positions ``starts[i]..``: the sliding
    layers take ``tables[0]`` (one metadata object), the full layers ``tables[1]`` (another), as
    the runner hands a model with two KV layer groups. ``native=False``: the per-layer path."""
    model = lm.model
    flat = torch.tensor([t for seq in ids for t in seq])
    pos = torch.tensor([s + j for seq, s in zip(ids, starts) for j in range(len(seq))])
    lens, qlens = [s + len(q) for q, s in zip(ids, starts)], [len(q) for q in ids]
    md = {w: AttentionMetadata.build(lens, qlens, tables[w is None], 16) for w in set(lm.config.layer_windows())}
    per_layer = [md[w] for w in lm.config.layer_windows()]
    saved = model._native
    if not native:
        model._native = None
    try:
        with torch.inference_mode():
            return model(flat, pos, caches, per_layer, get_backend("cpu"))
    finally:
        model._native = saved


def _native_equals_python(lm, ids_a, ids_b, vocab, monkeypatch):
    """Prefill two sequences (one over a block edge), decode both, then one alone: the native
    step (counted) and the Python path give equal hidden states and caches."""
    model = lm.model
    model.prepare_step(again=True)
    assert model.native_state == "on" and model.step_route == "native"
    calls = _calls(monkeypatch)
    tables = ([[3, 7, 1], [5, 2]], [[9, 4, 6], [8, 0]])  # sliding group, full group
    runs = {}
    for native in (True, False):
        caches = allocate_kv_caches(model, get_backend("cpu"), num_blocks=24, block_size=16)
        h1 = _step(lm, caches, [ids_a, ids_b], [0, 0], tables, native)
        h2 = _step(lm, caches, [[ids_a[-1]], [ids_b[-1]]], [len(ids_a), len(ids_b)], tables, native)
        h3 = _step(lm, caches, [[vocab - 1]], [len(ids_a) + 1], ([tables[0][0]], [tables[1][0]]), native)
        runs[native] = (h1, h2, h3, [(c.key.clone(), c.value.clone()) for c in caches])
    assert len(calls) == 3  # the native runs took the C loop, each step once
    for x, y in zip(runs[True][:3], runs[False][:3]):
        assert torch.equal(x, y)
    for (k1, v1), (k2, v2) in zip(runs[True][3], runs[False][3]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert runs[True][0].abs().sum() > 0 and runs[True][3][0][0].abs().sum() > 0


def test_gemma3_native_step_equals_the_python_path(gemma3, monkeypatch):
    c = gemma3.config
    assert (c.sandwich_norms, c.qk_norm, c.rope_local_theta, c.norm_offset) == (True, True, 1e4, 1.0)
    layers = gemma3.model.layers
    assert [layer.local_rope for layer in layers] == [w is not None for w in c.layer_windows()]
    assert sum(layer.local_rope for layer in layers) == 15
    tok = gemma3.tokenizer
    a = tok("The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain is")["input_ids"]
    assert len(a) > 16  # its prefill crosses a block edge
    _native_equals_python(gemma3, a, tok("def fibonacci(n):")["input_ids"], c.vocab_size, monkeypatch)


def test_gemma2_native_step_equals_the_python_path(gemma2, monkeypatch):
    c = gemma2.config
    assert (c.sandwich_norms, c.attn_logit_softcap, c.rope_local_theta, c.layer_windows()) == (True, 3.0, None,
                                                                                               [6, None, 6])
    assert not any(layer.local_rope for layer in gemma2.model.layers)
    _native_equals_python(gemma2, [(i * 37 + 5) % 90 + 3 for i in range(21)], [7, 9, 11, 13], c.vocab_size, monkeypatch)


def test_gemma3_engine_tokens_equal_with_and_without_the_native_step(gemma3, monkeypatch):
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.request import SamplingParams

    prompts = ["Once upon a time, in a quiet village by the sea, " * 4, "The three primary colours are",
               "def fibonacci(n):"]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(gemma3, num_blocks=96, max_num_batched_tokens=32)  # chunked prefill of the long prompt
    # the 3 full layers one KV layer group, the 15 sliding ones five groups of 3 (equal group sizes)
    assert llm.engine.runner.groups.num_groups == 6
    calls, forwards, forward = _calls(monkeypatch), [], type(gemma3.model).forward
    monkeypatch.setattr(type(gemma3.model), "forward", lambda self, *a: forwards.append(1) or forward(self, *a))
    native = [list(o.token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert len(calls) == len(forwards) > 16  # every step took the C loop
    with monkeypatch.context() as m:  # the per-layer path
        m.setattr(gemma3.model, "_native", None)
        python = [list(o.token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert native == python and all(len(t) == 16 for t in native)


def test_a_layer_without_its_groups_arguments_or_local_table_fails_before_writing(gemma3):
    """``decoder.c`` checks every layer's KV group index against the attention arguments it was
    given, and a local-RoPE layer's table, before it writes anything (code -6, the layer)."""
    model = gemma3.model
    model.prepare_step(again=True)
    step, n = model._native._step, len(model.layers)
    caches = allocate_kv_caches(model, get_backend("cpu"), num_blocks=4, block_size=16)
    md = AttentionMetadata.build([3], [3], [[0]], 16)
    q, kv = torch.empty(3, 4, 256), torch.empty(3, 1, 256)
    args = get_backend("cpu").native_step_args(q, kv, kv, caches, md)[2]
    step.set_caches([p for c in caches for p in (c.key.data_ptr(), c.value.data_ptr())])
    (cos, sin), (cl, sl) = [(x.contiguous(), y.contiguous()) for x, y in model._rope_rows(torch.arange(3))]
    residual = torch.randn(3, gemma3.config.hidden_size)
    before = residual.clone()
    ptrs = (residual.data_ptr(), cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
    untouched = lambda: torch.equal(residual, before) and all(c.key.abs().sum() == 0 for c in caches)  # noqa: E731
    try:
        step.set_groups([0] * (n - 1) + [1])  # the last layer in a group with no arguments
        assert step([args], 3, *ptrs, cl.data_ptr(), sl.data_ptr()) == (-6, n - 1) and untouched()
        step.set_groups([0] * n)
        assert step([args], 3, *ptrs, None, None) == (-6, 0) and untouched()  # layer 0 slides: needs the table
        assert step([args], 3, *ptrs, cl.data_ptr(), sl.data_ptr()) == (0, n - 1)  # all given: it runs
    finally:
        model.prepare_step(again=True)  # a new native step: nothing keeps these caches' addresses
    assert not torch.equal(residual, before)
    assert all(c.key[1:].abs().sum() == 0 for c in caches) and caches[0].key[0].abs().sum() > 0
