"""Multi-head latent attention and DeepSeek's shared experts in the native decoder step
(``pagedkv.model.native_step``, ``decoder.c``'s ``mla_attention`` and ``moe_ffn``).

A tiny DeepSeek-V2 with greedy (not group-limited) softmax routing, 2 shared experts, a
``q_lora_rank``, yarn RoPE and adjacent-pair rotary (DeepSeek-V2-Lite's kind of routing), and a
tiny DeepSeek-V3 in one expert group (sigmoid routing whose choice a bias steers, as
Moonlight-16B-A3B routes), and a tiny MiniCPM3 (dense MLA, rotate-half rotary, both branches
scaled by ``scale_depth / sqrt(layers)``), loaded with int8 weights, run their steps in one C call. The native step takes
every step whose sequences the Python path runs in the absorbed form (decode rows, short
chunks): its hidden states and the latents it writes equal the per-layer Python path's to
float rounding (the C loops sum in another order than torch's einsum), the engine's greedy
tokens are equal, and a step the Python path runs expanded (a long prefill chunk) or an fp8
latent cache is declined and runs per layer. An int8 latent cache runs natively: decoder.c writes
the codes and bf16 scales ``pagedkv.attention.quant.quantize`` gives and dequantises as it reads.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata, BackendError
from pagedkv.model.loader import load_model
from pagedkv.model.mla import absorb
from pagedkv.model.native_step import MLA_ROWS
from pagedkv.testing.caches import allocate_kv_caches
from tests.model.builders import NORM_NOISE, deepseek_model, match, prompt, save_tiny, seeded_model
from tests.model.test_native_gemma import _calls
from tests.model.test_native_step import _step


def _minicpm3():
    import transformers as tf

    cfg = tf.MiniCPM3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, initializer_range=0.1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=24, q_lora_rank=64, scale_emb=1.5, scale_depth=1.4, dim_model_base=32)
    big = ("q_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj", "embed_tokens")
    return seeded_model(cfg, tf.MiniCPM3ForCausalLM, [NORM_NOISE, (match(has=big), "mul", 3.0)])


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def _deepseek_v2():
    # a q_lora the int8 kernels take (K % 32); yarn: cos/sin and the softmax scale carry its factors
    hf = deepseek_model("deepseek_v2", v2=dict(q_lora_rank=64), rope_parameters=YARN)
    hf.config.n_group, hf.config.topk_group, hf.config.topk_method = 1, 1, "greedy"
    return hf


def _deepseek_v3():
    """The tiny DeepSeek-V3 (sigmoid routing with a random choice bias, 1 shared expert, no
    ``q_lora_rank``, ``rope_interleave``) in one expert group, as Moonlight-16B-A3B routes."""
    hf = deepseek_model("deepseek_v3")
    hf.config.n_group, hf.config.topk_group = 1, 1
    return hf


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3", "minicpm3"])
def mla_int8(request, tmp_path_factory):
    hf = {"deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3, "minicpm3": _minicpm3}[request.param]()
    return request.param, load_model(save_tiny(hf, tmp_path_factory.mktemp(request.param)), weights="int8")


def _caches(lm, **kw):
    return allocate_kv_caches(lm.model, get_backend("cpu"), num_blocks=24, block_size=16, **kw)


def _latents(caches):
    """The caches' latents: float32 values, or int8 codes then their bf16 scales."""
    return [t.clone() for c in caches for t in ((c.key,) if c.quant is None else (c.key, c.key_scale))]


def _run(lm, native: bool, dtype=None, groups: int = 1):
    """A prefill of two sequences (expanded at these sizes: declined), a decode step of both
    (one crossing into its second 16-token block), a batch-1 step, a 10-token chunk over 28
    tokens of context (absorbed, but more rows than ``MLA_ROWS``: declined), a 6-token chunk
    (absorbed: native) and one more decode row: hidden states and the latent caches
    (:func:`_latents`; ``dtype``: the caches', ``groups``: an int8 cache's scales per latent)."""
    caches = _caches(lm, dtype=dtype)
    if groups > 1:
        from pagedkv.model.mla import allocate_latent_cache

        c = caches[0]
        caches = [allocate_latent_cache(get_backend("cpu"), c.num_blocks, c.block_size, 1, c.head_dim, dtype,
                                        quant_group_size=c.head_dim // groups) for _ in caches]
    a, b = prompt(40, 1, high=97), [7, 90, 3]
    tables = [[3, 7, 1], [5, 2]]
    hs = [_step(lm, caches, [a[:16], b], [0, 0], tables, native),
          _step(lm, caches, [[a[16]], [11]], [16, 3], tables, native),
          _step(lm, caches, [[a[17]]], [17], tables[:1], native),
          _step(lm, caches, [a[18:28]], [18], tables[:1], native),
          _step(lm, caches, [a[28:34]], [28], tables[:1], native),
          _step(lm, caches, [[a[34]]], [34], tables[:1], native)]
    return hs, _latents(caches)


def test_mla_layers_run_natively_and_agree_with_the_python_path(mla_int8, monkeypatch):
    kind, lm = mla_int8
    model = lm.model
    model.prepare_step(again=True)
    assert model.native_state == "on" and model.step_route == "native"
    if kind == "deepseek_v2":
        assert [layer.mlp is not None and layer.mlp.shared is not None for layer in model.layers] == [False, True, True]
        a = model.layers[0].mla  # yarn: the softmax scale times mscale^2 (and cos/sin times its factor)
        assert model.config.rope_scaling["rope_type"] == "yarn" and a.scale > 1.01 * (a.nope + a.rope_dim) ** -0.5
    elif kind == "deepseek_v3":
        moe = [layer.mlp for layer in model.layers[1:]]
        assert all(m.spec.routing == "sigmoid" and m.spec.n_group == 1 and m.native_ok for m in moe)
        assert all(m.e_score_correction_bias.abs().max() > 0.1 for m in moe)  # the bias steers the choice
    else:
        assert model.layers[0].residual_scale == pytest.approx(1.4 / 3 ** 0.5)
    a = model.layers[0].mla
    dims = (a.num_heads, a.rank, a.nope, a.rope_dim, a.v_dim)
    assert not absorb(16, 16, *dims) and not absorb(3, 3, *dims) and absorb(10, 28, *dims) and absorb(6, 34, *dims)
    assert MLA_ROWS == 8
    calls = _calls(monkeypatch)
    hs, latents = _run(lm, native=True)
    assert len(calls) == 4  # every step but the prefill took the C loop
    ref_hs, ref_latents = _run(lm, native=False)
    assert len(calls) == 4
    for got, want in zip(hs, ref_hs):
        assert got.abs().max() > 0.5
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(latents, ref_latents):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_engine_tokens_equal_with_and_without_the_native_step(mla_int8, kv_dtype, monkeypatch):
    _, lm = mla_int8
    lm.model.prepare_step(again=True)
    prompts = [prompt(n, n, high=97) for n in (13, 5, 9)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(lm, block_size=4, num_blocks=64, max_num_batched_tokens=16, kv_cache_dtype=kv_dtype)
    assert (llm.engine.runner.kv_caches[0].quant is not None) == (kv_dtype == "int8")
    calls = _calls(monkeypatch)
    native = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert len(calls) >= 11  # every decode step at least
    with monkeypatch.context() as m:
        m.setattr(lm.model, "_native", None)
        python = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert native == python and all(len(t) == 12 for t in native)


@pytest.mark.parametrize("groups", [1, 2])
def test_an_int8_latent_cache_runs_natively(mla_int8, groups, monkeypatch):
    """int8 latents (codes + bf16 scales per token, one group or two): the native step takes the
    same steps as over float32 latents; the codes and scales it writes are the Python path's
    within a rounding boundary (the C and torch norms and RoPE round differently by ~1e-6: a
    code at most 1 apart on under 1% of entries, a scale at most one bf16 step; on this host
    they are equal), its hidden states equal the Python path's to float rounding. Exactly:
    layer 0's latents (the same embedding rows in) quantised by ``quant.quantize`` from the
    native step's float32 latents are the codes and scales it writes into an int8 cache."""
    from pagedkv.attention import quant as Q

    _, lm = mla_int8
    lm.model.prepare_step(again=True)
    calls = _calls(monkeypatch)
    hs, latents = _run(lm, native=True, dtype="int8", groups=groups)
    assert len(calls) == 4
    ref_hs, ref_latents = _run(lm, native=False, dtype="int8", groups=groups)
    assert len(calls) == 4
    for got, want in zip(hs, ref_hs):
        assert got.abs().max() > 0.5
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    codes, scales = latents[0::2], latents[1::2]
    assert codes[0].dtype == torch.int8 and scales[0].dtype == torch.bfloat16 and scales[0].shape[-1] == groups
    for got, want in zip(latents, ref_latents):  # the two paths' floats differ by ~1e-6: a code or a
        assert got.float().abs().sum() > 0  # scale may sit on the other side of a rounding boundary
        if got.dtype == torch.int8:
            diff = (got.int() - want.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01
        else:  # bf16 scales: at most one bf16 step apart
            torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=0.0)
    floats = _run(lm, native=True)[1][0]
    assert len(calls) == 8
    d = floats.shape[-1]
    want_codes, want_scales = Q.quantize(floats.reshape(-1, 1, d), Q.FORMATS["int8"], d // groups)
    assert torch.equal(codes[0].reshape(-1, 1, d), want_codes)
    assert torch.equal(scales[0].reshape(-1, 1, groups), want_scales)


def test_decoder_c_quantises_latents_as_quant_quantize():
    """decoder.c's int8 latent writer against ``quant.quantize`` on hard rows: all zeros, tiny
    (the 2^-126 floor), subnormal, huge, exact half-way codes (ties to even), a bf16-exact
    max|x| / 127 and values one float ulp either side; one and four groups."""
    import ctypes

    from pagedkv.attention import quant as Q
    from pagedkv.ops import decoder

    fn = decoder.get()
    assert fn is not None
    g = torch.Generator().manual_seed(3)
    d = 48
    rows = [torch.randn(d, generator=g) * 10.0 ** e for e in range(-8, 9)]
    rows += [torch.zeros(d), torch.full((d,), 1e-39), torch.full((d,), -3e-45), torch.full((d,), 1e30)]
    half = torch.arange(d, dtype=torch.float32) - d / 2 + 0.5  # k + 0.5 codes at scale 1
    half[0] = 127.0
    rows += [half, half * 0.25, -half * 2.0 ** -20]
    base = torch.randn(d, generator=g)
    base[5] = 1.0
    rows += [base * 127, torch.nextafter(base * 127, torch.tensor(0.0)), torch.nextafter(base * 127, torch.tensor(1e9))]
    x = torch.stack(rows).contiguous()
    for groups in (1, 4):
        codes = torch.empty(x.shape, dtype=torch.int8)
        scales = torch.empty(x.shape[0], groups, dtype=torch.bfloat16)
        assert fn.quantize_latent(x.data_ptr(), x.shape[0], d, groups, codes.data_ptr(), scales.data_ptr()) == 0
        want_codes, want_scales = Q.quantize(x.unsqueeze(1), Q.FORMATS["int8"], d // groups)
        assert torch.equal(codes, want_codes[:, 0]) and torch.equal(scales, want_scales[:, 0])
    assert fn.quantize_latent(x.data_ptr(), 1, d, 5, ctypes.c_void_p(0), ctypes.c_void_p(0)) == -2


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_latent_cache_is_declined(mla_int8, dtype, monkeypatch):
    """fp8 latents are the Python path's: the native step returns ``False``."""
    _, lm = mla_int8
    lm.model.prepare_step(again=True)
    calls = _calls(monkeypatch)
    caches = _caches(lm, dtype=dtype)
    _step(lm, caches, [[5, 6]], [0], [[0]], True)
    h = _step(lm, caches, [[7]], [2], [[0]], True)
    assert calls == [] and h.abs().max() > 0 and caches[0].key[0, :3].float().abs().sum() > 0


def test_latent_caches_of_two_geometries_are_declined(mla_int8, monkeypatch):
    """``latent_step_args`` takes the step's latent caches and compares their memoized
    geometry: one cache with another block count than the rest gives ``None``, and the
    native step runs none of that step's layers (the Python path does, and writes the
    latents of every layer)."""
    _, lm = mla_int8
    lm.model.prepare_step(again=True)
    caches = _caches(lm)
    odd = allocate_kv_caches(lm.model, get_backend("cpu"), num_blocks=25, block_size=16)[0]
    mixed = caches[:-1] + [odd]
    md = AttentionMetadata.build([1], [1], [[0]], 16)
    backend = get_backend("cpu")
    assert backend.latent_step_args(caches, md, 1) is not None
    assert backend.latent_step_args(mixed, md, 1) is None
    calls = _calls(monkeypatch)
    h = _step(lm, mixed, [[5]], [0], [[0]], True)
    assert calls == [] and h.abs().max() > 0 and all(c.key[0, 0].abs().sum() > 0 for c in mixed)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_slot_past_the_cache_raises_and_writes_nothing(mla_int8, kv_dtype, monkeypatch):
    """A decode row (absorbed: the native step takes it) whose slot is past the cache: decoder.c
    checks every slot before it writes (-4), the step raises ``BackendError``, no latent written."""
    _, lm = mla_int8
    model = lm.model
    model.prepare_step(again=True)
    a = model.layers[0].mla
    assert absorb(1, 3, a.num_heads, a.rank, a.nope, a.rope_dim, a.v_dim)
    calls = _calls(monkeypatch)
    caches = allocate_kv_caches(model, get_backend("cpu"), num_blocks=2, block_size=4, dtype=kv_dtype)
    md = AttentionMetadata.build([3], [1], [[1]], 4)
    md.slot_mapping[0] = 8  # 2 blocks x 4 slots
    with pytest.raises(BackendError, match="slot"):
        with torch.inference_mode():
            model(torch.tensor([5]), torch.tensor([2]), caches, md, get_backend("cpu"))
    assert len(calls) == 1 and all(t.float().abs().sum() == 0 for t in _latents(caches))


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_native_mla_gives_the_same_bits_on_one_and_two_threads(mla_int8, kv_dtype):
    """With fewer rows than threads decoder.c splits each row's heads among the threads; every
    head is computed alike either way, so the hidden states and latents are bit-equal."""
    _, lm = mla_int8
    lm.model.prepare_step(again=True)
    before = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(_run(lm, native=True, dtype=kv_dtype))
    finally:
        torch.set_num_threads(before)
    for x, y in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert torch.equal(x, y)


@pytest.fixture(scope="module")
def tiny_mla_gguf(tmp_path_factory):
    """``pagedkv bench models``' test-sized ``deepseek2`` shape (1 dense + 1 MoE layer with a
    shared expert, 4 heads, r 32, nope / rope / v 32 / 16 / 32), random Q8_0 weights."""
    from pagedkv.bench.models import make as mm

    path = tmp_path_factory.mktemp("tiny-mla") / "tiny-mla-q8_0.gguf"
    mm.write_random_gguf(path, mm.SHAPES["tiny-mla"], "q8_0")
    return load_model(path, weights="gguf")


def test_gguf_mla_multiplies_attn_k_b_and_v_b_as_stored(tiny_mla_gguf, monkeypatch):
    """A GGUF's ``attn_k_b`` / ``attn_v_b`` are kept as stored beside the float ``kv_b_proj``;
    the native step multiplies them head by head (``qmm.row_blocks``, int8 activations), so a
    decode step reads their stored bytes: its hidden states stay within the activations'
    rounding of the Python path's (float ``kv_b``), and without the stored matrices (the step
    rebuilt: ``stale``) it multiplies the float ``kv_b`` and agrees to float rounding."""
    from pagedkv.model.native_step import _stored_heads

    model = tiny_mla_gguf.model
    model.prepare_step(again=True)
    assert model.native_state == "on"
    for layer in model.layers:
        a = layer.mla
        assert (a.k_b_stored.out_features, a.v_b_stored.out_features) == (4 * 32, 4 * 32)
        kb, vb = _stored_heads(a)
        assert [(m.n, m.k) for m in kb] == [(32, 32)] * 4 and [(m.n, m.k) for m in vb] == [(32, 32)] * 4
    calls = _calls(monkeypatch)
    stored, _ = _run(tiny_mla_gguf, native=True)
    python, _ = _run(tiny_mla_gguf, native=False)
    for layer in model.layers:
        layer.mla.k_b_stored = layer.mla.v_b_stored = None
    floats, _ = _run(tiny_mla_gguf, native=True)
    assert len(calls) == 8  # 4 native steps (module doc of _run) in each native run
    for s, p, f in zip(stored, python, floats):
        scale = p.abs().max()
        assert scale > 0.1
        assert (s - p).abs().max() < 2e-2 * scale  # int8 activations into the stored blocks
        torch.testing.assert_close(f, p, rtol=1e-5, atol=1e-5 * scale)
    assert any(not torch.equal(s, f) for s, f in zip(stored, floats))  # the stored route was taken


def test_mla_models_say_they_are_not_batch_invariant(tiny_mla_gguf):
    """The start-up log's batch-invariance answer (docs/determinism.md) names MLA: its form, and
    whether the native step runs, follow each chunk's rows."""
    from pagedkv.model.invariant import batch_invariant

    ok, why = batch_invariant(tiny_mla_gguf.model)
    assert not ok and why.startswith("multi-head latent attention (its absorbed or expanded form")


def test_preemption_prefix_hits_and_forks_on_the_native_step(mla_int8, monkeypatch):
    """The engine's hard cases with MLA layers in the native step: three batched requests in a
    pool too small for them (preempted and recomputed), a later request hitting the prefix one of
    them cached, and n=2 forks sharing a prompt's latent blocks (copy-on-write), block invariants
    checked every step: the same tokens as the Python path, every block freed."""
    _, lm = mla_int8
    lm.model.prepare_step(again=True)
    shared = prompt(32, 7, high=97)
    prompts = [prompt(45, 2, high=97), prompt(37, 3, high=97), shared + prompt(11, 4, high=97)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    forks = SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)

    def run():
        llm = LLM(lm, block_size=4, num_blocks=40, max_num_batched_tokens=16, enable_prefix_caching=True,
                  debug_invariants=True)
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        preempted = llm.engine.scheduler.stats.num_preemptions
        hit = llm.generate([shared + prompt(13, 5, high=97)], greedy, use_tqdm=False)[0]
        two = llm.generate([prompts[1]], forks, use_tqdm=False)[0]
        assert llm.engine.kv.num_used_blocks == 0
        return outs, preempted, hit.num_cached_tokens, list(hit.outputs[0].token_ids), [list(c.token_ids) for c in two.outputs]

    calls = _calls(monkeypatch)
    native = run()
    assert len(calls) > 40  # the decode steps of every phase
    with monkeypatch.context() as m:
        m.setattr(lm.model, "_native", None)
        python = run()
    assert native[1] > 0 and native[2] >= 28  # preempted; the 32-token prefix hit (whole blocks)
    assert native[4][0] == native[4][1] == native[0][1]  # greedy forks = the same prompt alone
    assert native == python
