"""Multi-head latent attention (``pagedkv.model.mla``) against transformers 5.24 (fp32, eager).

Three tiny random-weight families built with transformers and saved as HF directories:

* ``minicpm3``: MLA with a ``q_lora_rank`` (q_a_proj / q_a_layernorm / q_b_proj), rotate-half
  RoPE, ``scale_emb`` / ``scale_depth`` / ``dim_model_base`` scaling, tied embeddings;
* ``deepseek_v2``: every layer dense (``first_k_dense_replace`` = ``num_hidden_layers``; the
  mixture-of-experts forms: ``tests/model/test_deepseek.py``), the
  complex (interleaved) rotary, yarn RoPE scaling with ``mscale_all_dim`` (softmax scale times
  mscale^2, cos/sin times the attention factor);
* ``deepseek_v3``: dense, ``q_lora_rank`` null (one ``q_proj``), ``rope_interleave`` (and once
  without it: rotate-half).

``v_head_dim`` differs from ``qk_nope_head_dim`` in all three. The paged cache holds one latent
(``kv_lora_rank + qk_rope_head_dim`` elements) per token and layer; the allocated pool's bytes per
token equal the planner's (``KVCacheSpec``).
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.errors import ConfigError
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.model.loader import load_model
from pagedkv.testing.caches import allocate_kv_caches
from tests.model.builders import NORM_NOISE, VOCAB, hf_greedy_logprobs, hf_logits, match, save_tiny, seeded_model
from tests.model.builders import prompt as _prompt

FAMILIES = ["minicpm3", "deepseek_v2", "deepseek_v3"]
NEW = 16
RANK, ROPE, NOPE, VDIM = 32, 8, 16, 24


def _hf_config(kind: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, initializer_range=0.1, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VDIM,
    )
    if kind == "minicpm3":
        return tf.MiniCPM3Config(q_lora_rank=48, scale_emb=1.5, scale_depth=1.4, dim_model_base=32,
                                 **common), tf.MiniCPM3ForCausalLM
    if kind == "deepseek_v2":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
        return tf.DeepseekV2Config(q_lora_rank=48, first_k_dense_replace=3, n_routed_experts=4, rope_parameters=rope,
                                   **common), tf.DeepseekV2ForCausalLM
    if kind == "deepseek_v3":
        return tf.DeepseekV3Config(q_lora_rank=None, first_k_dense_replace=3, n_routed_experts=4, rope_interleave=True,
                                   **common), tf.DeepseekV3ForCausalLM
    raise AssertionError(kind)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(kind, transformers model, directory, pagedkv LoadedModel)."""
    return _build(request.param, tmp_path_factory.mktemp(request.param))


def _build(kind: str, out, **changes):
    cfg, cls = _hf_config(kind)
    for key, value in changes.items():
        setattr(cfg, key, value)
    # non-trivial norms, and scores large enough that mistakes show
    big = ("q_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj", "embed_tokens")
    hf = seeded_model(cfg, cls, [NORM_NOISE, (match(has=big), "mul", 3.0)])
    return kind, hf, save_tiny(hf, out), load_model(out)


def test_config_reads_the_mla_family(family):
    kind, hf, path, lm = family
    c = lm.config
    assert c.architecture == kind and c.is_mla
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim) == (RANK, ROPE, NOPE, VDIM)
    assert c.q_lora_rank == (None if kind == "deepseek_v3" else 48)
    assert c.head_dim == NOPE + ROPE and (c.cache_kv_heads, c.cache_head_dim) == (1, RANK + ROPE)
    assert c.rope_interleave == (kind != "minicpm3")
    if kind == "minicpm3":
        assert (c.embed_scale, c.residual_scale, c.logits_scaling) == (1.5, pytest.approx(1.4 / 3 ** 0.5), 2.0)
        assert c.tie_word_embeddings
    assert (c.rope_scaling or {}).get("rope_type") == ("yarn" if kind == "deepseek_v2" else None)
    # the planner reads the same directory as an MLA cache: (r + rope) fp32 elements per layer
    spec = KVCacheSpec.from_hf_config(path, dtype="fp32")
    assert spec.is_mla and spec.bytes_per_token == 3 * (RANK + ROPE) * 4 == 480


def test_logits_equal_transformers_over_paged_latents(family):
    """Prefill chunks across shuffled 4-token blocks, then decode steps: every position's logits
    equal transformers' one forward (atol = rtol = 1e-4), through both forms (``mla.absorb``)."""
    kind, hf, _, lm = family
    ids = _prompt(40, 1)
    ref = hf_logits(hf, ids)
    backend = get_backend("cpu")
    caches = allocate_kv_caches(lm.model, backend, num_blocks=16, block_size=4)
    assert all(c.value.numel() == 0 and tuple(c.key.shape) == (16, 4, 1, RANK + ROPE) for c in caches)
    table = [9, 2, 14, 0, 7, 11, 3, 5, 12, 1]
    got, rows = [], []
    for start, end in ((0, 13), (13, 24), (24, 37), (37, 38), (38, 39), (39, 40)):
        md = AttentionMetadata.build([end], [end - start], [table], 4)
        with torch.inference_mode():
            h = lm.model(torch.tensor(ids[start:end]), torch.arange(start, end), caches, md, backend)
            got.append(lm.model.compute_logits(h))
        rows.append(dict(lm.model.layers[0].mla.rows))
    torch.testing.assert_close(torch.cat(got), ref, rtol=1e-4, atol=1e-4)
    # the first chunk (13 rows over 13 tokens) is cheaper expanded, later chunks and decode rows absorbed
    assert rows == [{"absorbed": 0, "expanded": 13}, {"absorbed": 11, "expanded": 0}, {"absorbed": 13, "expanded": 0}] \
        + [{"absorbed": 1, "expanded": 0}] * 3
    assert lm.model.native_state == "off (a linear layer without integer-kernel weights)"
    assert lm.model.step_route == "eager"


def _check(outs, refs) -> None:
    for o, (toks, lps) in zip(outs, refs):
        c = o.outputs[0]
        assert c.token_ids == toks
        got = [step[t] for step, t in zip(c.logprobs, toks)]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4


def test_deepseek_v3_rotate_half_rope(tmp_path):
    """DeepSeek-V3 with ``rope_interleave`` false: plain rotate-half RoPE, logits == transformers'."""
    kind, hf, _, lm = _build("deepseek_v3", tmp_path, rope_interleave=False)
    assert not lm.config.rope_interleave
    ids = _prompt(24, 1)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
        backend = get_backend("cpu")
        caches = allocate_kv_caches(lm.model, backend, num_blocks=8, block_size=4)
        got = []
        for start, end in ((0, 20), (20, 21), (21, 24)):
            md = AttentionMetadata.build([end], [end - start], [list(range(6))], 4)
            got.append(lm.model.compute_logits(lm.model(torch.tensor(ids[start:end]), torch.arange(start, end),
                                                        caches, md, backend)))
    torch.testing.assert_close(torch.cat(got), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [1, 16])
def test_engine_greedy_equals_transformers(family, block_size):
    """Three requests batched with 8-token prefill chunks in a pool too small for them (the
    scheduler preempts and recomputes), then the third prompt again in an ample pool (a
    prefix-cache hit on its latents): greedy tokens == ``generate``'s, log-probabilities within
    1e-4, every block returned."""
    kind, hf, _, lm = family
    prompts = [_prompt(30, 2), _prompt(22, 3), _prompt(27, 4)]
    refs = hf_greedy_logprobs(hf, prompts, NEW)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1)
    pool = {1: 80, 16: 5}[block_size]  # each request ends at 38-46 tokens: 3 blocks of 16, or 46 of 1
    llm = LLM(lm, block_size=block_size, num_blocks=pool, max_num_batched_tokens=8, enable_prefix_caching=True,
              debug_invariants=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.kv.num_used_blocks == 0
    _check(outs, refs)
    big = LLM(lm, block_size=block_size, num_blocks=64 if block_size == 16 else 256, max_num_batched_tokens=8,
              enable_prefix_caching=True, debug_invariants=True)
    first = big.generate(prompts[2:], params, use_tqdm=False)
    again = big.generate(prompts[2:], params, use_tqdm=False)
    assert again[0].num_cached_tokens >= (16 if block_size == 16 else 26)
    _check(first + again, refs[2:] * 2)
    assert big.engine.kv.num_used_blocks == 0


def test_allocated_kv_bytes_per_token_equal_the_planner(family):
    """fp32 and int8 (one bf16 scale per latent): the engine's pool tensors' bytes / (blocks x
    block size) == ``KVCacheSpec`` of the same directory == the engine's own spec."""
    kind, hf, path, lm = family
    for kv_dtype, spec_dtype, per_layer in (("auto", "fp32", (RANK + ROPE) * 4), ("int8", "int8", RANK + ROPE + 2)):
        llm = LLM(lm, block_size=16, num_blocks=6, kv_cache_dtype=kv_dtype)
        eng = llm.engine
        held = sum(c.nbytes for c in eng.runner.shared_caches) / (6 * 16)
        planned = KVCacheSpec.from_hf_config(path, dtype=spec_dtype).bytes_per_token
        assert held == planned == eng.kv_spec.bytes_per_token == 3 * per_layer
        assert eng.kv_spec.is_mla and eng.kv_summary()["bytes_per_token"] == planned


@pytest.mark.parametrize("kv_dtype, group, bound", [("int8", None, 0.5), ("int8", 8, 0.5), ("fp8_e4m3", None, 2.0)])
def test_quantised_latent_cache(family, kv_dtype, group, bound):
    """An int8 / fp8 latent cache (codes + bf16 scales, one scale per latent or per 8 elements):
    every stored latent is within the quantiser's error bound of the fp32 one, and the logits stay
    within ``bound`` of transformers' (the quantisation error of the tiny model's inflated latents:
    measured 0.18-0.40 for int8, 0.71-1.44 for fp8_e4m3)."""
    from pagedkv.attention import quant as Q
    from pagedkv.model.mla import allocate_latent_cache, read_latent

    kind, hf, _, lm = family
    ids = _prompt(40, 1)
    ref = hf_logits(hf, ids)
    backend = get_backend("cpu")
    exact = allocate_kv_caches(lm.model, backend, num_blocks=10, block_size=4)
    quant = [allocate_latent_cache(backend, 10, 4, 1, RANK + ROPE, kv_dtype, "cpu", group) for _ in range(3)]
    assert quant[0].group_size == (group or RANK + ROPE) and quant[0].value.numel() == 0
    got = []
    for start, end in ((0, 20), (20, 21), (21, 22), (22, 40)):
        md = AttentionMetadata.build([end], [end - start], [list(range(10))], 4)
        with torch.inference_mode():
            lm.model(torch.tensor(ids[start:end]), torch.arange(start, end), exact, md, backend)
            got.append(lm.model.compute_logits(lm.model(torch.tensor(ids[start:end]), torch.arange(start, end),
                                                        quant, md, backend)))
    slots = torch.arange(40)
    for e, q in zip(exact[:1], quant[:1]):  # layer 0's latents depend on the tokens only
        x = read_latent(e, slots)[:, None]
        scales = q.layout.read(q.key_scale, slots, 4, 1, q.num_groups)
        err = (read_latent(q, slots)[:, None].double() - x.double()).abs()
        assert bool((err <= Q.error_bound(x, scales, q.quant)).all())
    diff = (torch.cat(got) - ref).abs().max().item()
    assert diff < bound


def test_fast_paths_are_not_selected_for_fp32_mla(family):
    """fp32 weights: MLA layers have no fused form, the native step loop says why it is off (its
    latent attention needs the integer kernels' weights: tests/model/test_native_mla.py), and a
    ``compile_decode`` engine runs every step eager (0 compiled steps) with transformers' tokens."""
    kind, hf, _, lm = family
    prompt = _prompt(30, 2)
    ref = hf_greedy_logprobs(hf, [prompt], NEW)
    llm = LLM(lm, block_size=16, num_blocks=8, compile_decode=True)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=NEW), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0][0]
    compiled = llm.engine.runner.compiled
    assert compiled.failed == "MLA layers run eager" and compiled.steps == 0
    assert lm.model.native_state == "off (a linear layer without integer-kernel weights)"
    assert lm.model.step_route == "eager"
    assert lm.model._native is None and all(layer.fused is None for layer in lm.model.layers)


def test_plan_and_engine_agree(family, capsys):
    """``pagedkv plan --model <dir>`` sizes the cache the engine allocates: 480 B/token (3 layers
    x 40 fp32 latent elements), the blocks of a 1 MiB budget, and the engine's pool of that budget."""
    from pagedkv.cli import main

    kind, hf, path, lm = family
    assert main(["plan", "--model", str(path), "--kv-budget", "1MiB", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    eng = LLM(lm, block_size=16, kv_cache_memory="1MiB").engine
    assert p["bytes_per_token"] == eng.kv_spec.bytes_per_token == 480
    assert p["num_blocks"] == eng.num_blocks == 2**20 // (16 * 480) == 136
    held = sum(c.nbytes for c in eng.runner.shared_caches)
    assert held == 136 * 16 * 480


def _raw_config(kind: str, **changes) -> dict:
    cfg, _ = _hf_config(kind)
    d = cfg.to_dict()
    d.update(changes)
    return d


def test_moe_layers_and_unsupported_options_raise_config_error():
    from pagedkv.model.config import ModelConfig

    for kind in ("deepseek_v2", "deepseek_v3"):  # mixture-of-experts layers: tests/model/test_deepseek.py
        assert ModelConfig.from_hf_config(_raw_config(kind, first_k_dense_replace=1, num_experts_per_tok=2,
                                                      n_group=1, topk_group=1)).moe_layers == [1, 2]
        moe = ModelConfig.from_hf_config({k: v for k, v in _raw_config(kind, num_hidden_layers=4, num_experts_per_tok=2,
                                                                      n_group=1, topk_group=1).items()
                                          if k != "first_k_dense_replace"})
        assert moe.moe_layers == ([3] if kind == "deepseek_v3" else None)  # transformers' default: 0 (V2) / 3 (V3)
        dense = ModelConfig.from_hf_config(_raw_config(kind, first_k_dense_replace=5))
        assert dense.is_mla and dense.num_experts == 0  # >= 3 layers: dense
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelConfig.from_hf_config(_raw_config("minicpm3", attention_bias=True))
    with pytest.raises(ConfigError, match="rope_scaling"):
        ModelConfig.from_hf_config(_raw_config("deepseek_v3", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                               "rope_theta": 10000.0}))


def test_deepseek_v2_lite_shape_allocation_equals_planner():
    """A DeepSeek-V2-Lite-shaped config (27 layers, 16 heads of 128 + 64, kv_lora_rank 512,
    qk_rope_head_dim 64; no weights: the model on the meta device) gets a pool of 576 bf16
    elements per token and layer from the engine's runner, == the planner's, 10.67x less than
    the same model with MHA (K and V of 16 heads x 192)."""
    from pagedkv.attention.cpu import CPUBackend
    from pagedkv.model.config import ModelConfig
    from pagedkv.model.llama import LlamaForCausalLM
    from pagedkv.worker.runner import ModelRunner

    lite = {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
            "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "eos_token_id": 100001,
            "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "first_k_dense_replace": 27, "n_routed_experts": 64, "torch_dtype": "bfloat16",
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                                "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                "beta_fast": 32, "beta_slow": 1}}
    mc = ModelConfig.from_hf_config(lite)
    model = LlamaForCausalLM(mc, torch.bfloat16, materialize=False)
    runner = ModelRunner(model, CPUBackend(), mc.num_layers, 4, 16, mc.cache_kv_heads, mc.cache_head_dim,
                         torch.bfloat16, latent=mc.is_mla)
    held = sum(c.nbytes for c in runner.shared_caches) // (4 * 16)
    planned = KVCacheSpec.from_hf_config(lite)
    assert held == planned.bytes_per_token == KVCacheSpec.from_model_config(mc, "bf16").bytes_per_token == 27 * 576 * 2
    mha = KVCacheSpec(num_layers=27, num_kv_heads=16, head_dim=192, dtype="bf16")
    assert mha.bytes_per_token == 27 * 2 * 16 * 192 * 2
    print(f"DeepSeek-V2-Lite KV bytes/token: MLA {held}, MHA {mha.bytes_per_token}, "
          f"ratio {mha.bytes_per_token / held:.2f}")
    assert round(mha.bytes_per_token / held, 2) == 10.67


@pytest.mark.parametrize("weights, bound", [("bf16", 0.25), ("int8", 0.6)])
def test_quantised_weights_keep_kv_b_proj_a_tensor(family, weights, bound):
    """``weights=bf16`` / ``int8``: the q, ``kv_a``, o and MLP projections take the format's
    modules, ``kv_b_proj`` (absorbed per head) stays a float ``nn.Linear``; the logits stay within
    the format's rounding of the fp32 model's (max |diff| over 40 positions, logits std ~1)."""
    from pagedkv.model.quant import QuantLinear

    kind, hf, path, lm = family
    q = load_model(path, weights=weights)
    layer = q.model.layers[0]
    assert type(layer.mla.kv_b_proj) is torch.nn.Linear
    projections = [layer.o_proj, layer.gate_up_proj, layer.down_proj, layer.mla.kv_a_proj_with_mqa,
                   *(m for m in (layer.mla.q_proj, layer.mla.q_a_proj, layer.mla.q_b_proj) if m is not None)]
    assert all(isinstance(m, QuantLinear) for m in projections)
    ids = _prompt(40, 1)

    def logits(model):
        backend = get_backend("cpu")
        caches = allocate_kv_caches(model, backend, num_blocks=10, block_size=4)
        md = AttentionMetadata.build([40], [40], [list(range(10))], 4)
        with torch.inference_mode():
            return model.compute_logits(model(torch.tensor(ids), torch.arange(40), caches, md, backend))

    assert (logits(q.model) - logits(lm.model)).abs().max().item() < bound


def test_parallel_sampling_copies_the_shared_latent_block(family):
    """n=2 on a 21-token prompt (one full and one half-full 16-token block): the branches share
    the prompt's latents, the half-full block is copied once before either writes into it (CoW),
    and each sampled branch equals an independent request with its seed; greedy n=2 gives
    transformers' tokens twice."""
    kind, hf, _, lm = family
    prompt = _prompt(21, 9)
    sp = dict(temperature=0.8, max_tokens=NEW, ignore_eos=True)
    llm = LLM(lm, block_size=16, num_blocks=16, debug_invariants=True)
    out = llm.generate([prompt], SamplingParams(n=2, seed=7, **sp), use_tqdm=False)[0]
    assert llm.engine.kv.stats.cow_copies == 1 and out.metrics.num_cow_copies == 1
    assert llm.engine.kv.num_used_blocks == 0
    alone = LLM(lm, block_size=16, num_blocks=16).generate(
        [prompt, prompt], [SamplingParams(seed=7, **sp), SamplingParams(seed=8, **sp)], use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in alone]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    greedy = llm.generate([prompt], SamplingParams(n=2, temperature=0.0, max_tokens=NEW), use_tqdm=False)[0]
    ref = hf_greedy_logprobs(hf, [prompt], NEW)[0][0]
    assert [c.token_ids for c in greedy.outputs] == [ref, ref]


def test_tensor_parallel_2_engine_equals_transformers(family, monkeypatch):
    """``tensor_parallel_size=2`` (two spawned ranks over gloo, heads split, latent replicated):
    greedy tokens == transformers' with 8-token chunks, preemption in a small pool and n=2
    sampling equal to one rank's; every rank's cache holds the whole latent (480 B/token). Sizes
    must divide the 4 heads: 3 is a ``ConfigError``."""
    from pagedkv.distributed.parallel import check_tp_size

    kind, hf, _, lm = family
    with pytest.raises(ConfigError, match="tensor_parallel_size 3"):
        check_tp_size(lm.config, 3)
    monkeypatch.setenv("PAGEDKV_TP_THREADS", "1")
    monkeypatch.setenv("PAGEDKV_TP_TIMEOUT", "60")
    prompts = [_prompt(30, 2), _prompt(22, 3), _prompt(27, 4)]
    refs = hf_greedy_logprobs(hf, prompts, NEW)
    opts = dict(block_size=16, num_blocks=5, max_num_batched_tokens=8, enable_prefix_caching=True)
    tp = LLM(lm, tensor_parallel_size=2, **opts)
    try:
        outs = tp.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs]
        assert tp.engine.scheduler.stats.num_preemptions > 0
        sp = SamplingParams(n=2, seed=7, temperature=0.8, max_tokens=8, ignore_eos=True)
        one = LLM(lm, **opts).generate(prompts[:1], sp, use_tqdm=False)[0]
        two = tp.generate(prompts[:1], sp, use_tqdm=False)[0]
        assert [c.token_ids for c in two.outputs] == [c.token_ids for c in one.outputs]
        ranks = tp.engine.executor.query_workers()
        assert [r["kv_bytes_per_token"] for r in ranks] == [480, 480] == [tp.engine.kv_spec.bytes_per_token] * 2
    finally:
        tp.engine.close()


def test_absorbed_form_for_decode_and_short_chunks_at_the_lite_shape():
    """The cost model at DeepSeek-V2-Lite's shape over 512 tokens of context: decode rows and a
    16-row chunk absorbed (measured 1.9 / 10.2 ms against 55.6 / 61.3 ms expanded), 256 rows
    expanded (91 ms against 153 ms)."""
    from pagedkv.model.mla import absorb

    lite = dict(context=512, heads=16, rank=512, nope=128, rope=64, v=128)
    assert [absorb(rows, **lite) for rows in (1, 16, 100, 200, 256)] == [True, True, True, False, False]


def test_host_tier_round_trips_latent_blocks(family):
    """Latent blocks evicted from a 16-block pool to a host tier come back on a prefix hit
    (1,920 bytes a block: 4 tokens x 480), and the tokens stay transformers'."""
    kind, hf, _, lm = family
    prompts = [_prompt(30, 2), _prompt(22, 3), _prompt(27, 4)]
    refs = hf_greedy_logprobs(hf, prompts, NEW)
    llm = LLM(lm, block_size=4, num_blocks=16, enable_prefix_caching=True, kv_offload=["host:1MiB"],
              debug_invariants=True)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW)
    outs = llm.generate(prompts, sp, use_tqdm=False) + llm.generate(prompts[:1], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in refs + refs[:1]]
    tiers = llm.engine.get_stats().kv_tiers
    host, moved = tiers["tiers"]["host"], tiers["transfer"]
    assert host["hit_blocks"] > 0 and outs[-1].num_cached_tokens >= 28
    assert moved["bytes"]["pool->host"] == moved["blocks"]["pool->host"] * 4 * 480
    assert moved["bytes"]["host->pool"] == moved["blocks"]["host->pool"] * 4 * 480
    llm.engine.close()
