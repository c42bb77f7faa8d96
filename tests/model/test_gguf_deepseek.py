"""DeepSeek-V2/V3 GGUF files (llama.cpp architecture ``deepseek2``) on their stored blocks
(``weights="gguf"``, ``pagedkv.model.gguf_mla``).

Tiny transformers DeepSeek-V2 and V3 (the builders of ``tests/model/test_deepseek.py``; V2's
``q_lora_rank`` 64 so its ``q_b`` rows are whole Q8_0 blocks, ``scoring_func`` set as
DeepSeek's configs set it) are written to GGUF as llama-cpp-python 0.3.36's
``convert_hf_to_gguf.py`` writes them (checked against that converter's output for these
models: the same keys, tensor names, types and shapes): ``head_count_kv`` 1, ``key_length``
``r + rope`` / ``value_length`` ``r`` with the head sizes in ``key_length_mla`` /
``value_length_mla``, ``kv_b_proj`` split into ``attn_k_b`` ``[n, r, nope]`` (F16: its rows of
16 are no whole Q8_0 block, the converter's fallback) and ``attn_v_b`` ``[n, v, r]``, the
experts stacked, ``exp_probs_b.bias`` (V3), shared experts ``ffn_*_shexp``; norms, the router
and the bias F32, every other matrix Q8_0. The older form (``attn_kv_b``, ``head_count_kv`` =
heads, ``key_length`` the head size) is written too. transformers then gets the file's
dequantised values. Checked: the config equals the HF directory's, the matrices are
``GGUFLinear`` on their stored bytes and ``kv_b_proj`` the re-joined float values, logits
against transformers' within the int8-activation error, the engine's greedy tokens equal
``generate``'s on prompts with a clear margin, and bad files raise ``ConfigError``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.errors import ConfigError
from pagedkv.model.gguf_native import GGUFLinear, iter_linears
from pagedkv.model.loader import load_config, load_model
from pagedkv.testing.caches import allocate_kv_caches
from tests.model.test_gguf_types import _vocab

E, K, RANK, ROPE, NOPE, VDIM, MOE_I, QLORA = 8, 2, 32, 8, 16, 24, 32, 64
SCALE = 1.5  # attention projections' multiplier (scores grow with its 4th power)
MARGIN = 0.5  # greedy top-2 logit gap of the compared prompts (measured: gaps <= 0.46 can flip)


def _hf_model(kind: str, **extra):
    """The tiny model (``extra``: more config keys, e.g. ``rope_parameters``)."""
    import transformers as tf

    vocab = len(_vocab())
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=vocab - 3,
        eos_token_id=vocab - 2, pad_token_id=vocab - 1, initializer_range=0.1, kv_lora_rank=RANK,
        qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VDIM, first_k_dense_replace=1, n_routed_experts=E,
        num_experts_per_tok=K, moe_intermediate_size=MOE_I, n_group=2, topk_group=1, tie_word_embeddings=False,
        **extra,
    )
    if kind == "deepseek_v2":
        cfg = tf.DeepseekV2Config(q_lora_rank=QLORA, topk_method="group_limited_greedy", n_shared_experts=2,
                                  routed_scaling_factor=1.5, norm_topk_prob=False, scoring_func="softmax", **common)
        cls = tf.DeepseekV2ForCausalLM
    else:
        cfg = tf.DeepseekV3Config(q_lora_rank=None, n_shared_experts=1, rope_interleave=True, scoring_func="sigmoid",
                                  **common)
        cls = tf.DeepseekV3ForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms, large enough scores, decisive routers and logits
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif any(k in name for k in ("q_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj", "embed_tokens")):
                p.mul_(SCALE)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(10.0)
            elif name.endswith("lm_head.weight"):
                p.mul_(10.0)
        for layer in hf.model.layers[1:]:
            if kind == "deepseek_v3":  # a bias that changes choices (transformers initialises it to zeros)
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.5)
    return hf


def _write(hf, path, legacy: bool = False, gating: int | None = None, drop: str | None = None) -> None:
    """The GGUF as the converter writes ``hf`` (module doc); ``legacy``: the older one-tensor
    ``attn_kv_b`` form; ``gating``: another ``expert_gating_func``; ``drop``: leave out the
    tensors whose names end so. ``hf`` then holds the file's dequantised values."""
    import gguf

    c = hf.config
    v3 = c.model_type == "deepseek_v3"
    q8, f16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "deepseek2")
    n = c.num_attention_heads
    for add, v in ((w.add_block_count, 3), (w.add_context_length, 256), (w.add_embedding_length, 64),
                   (w.add_feed_forward_length, 96), (w.add_head_count, n), (w.add_head_count_kv, n if legacy else 1),
                   (w.add_rope_freq_base, 10000.0), (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_expert_count, E),
                   (w.add_expert_used_count, K), (w.add_expert_group_count, 2), (w.add_expert_group_used_count, 1),
                   (lambda v: w.add_uint32("deepseek2.expert_gating_func", v), gating or (2 if v3 else 1)),
                   (w.add_key_length, NOPE + ROPE if legacy else RANK + ROPE), (w.add_value_length, VDIM if legacy else RANK),
                   (w.add_leading_dense_block_count, 1), (w.add_vocab_size, c.vocab_size)):
        add(v)
    if not v3:
        w.add_q_lora_rank(QLORA)
    w.add_kv_lora_rank(RANK)
    if not legacy:
        w.add_key_length_mla(NOPE + ROPE)
        w.add_value_length_mla(VDIM)
    w.add_expert_feed_forward_length(MOE_I)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if v3:  # written only when true
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(ROPE)
    rp = c.rope_parameters
    if rp.get("rope_type") == "yarn":  # the converter's yarn keys (log multiplier: 0.1 * mscale_all_dim)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    tokens = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    w.add_token_merges(["h i"])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_add_bos_token(False)

    def put(name: str, t: torch.Tensor) -> torch.Tensor:
        """Write ``t`` under GGUF ``name`` (F32 for norms, the router and the bias; Q8_0, or F16
        where a row is no whole block, for matrices); returns the values the file holds."""
        if drop is not None and name.endswith(drop):
            return t
        x = t.detach().float().contiguous().numpy()
        if x.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(name, x)
            return t
        qt = q8 if x.shape[-1] % 32 == 0 else f16
        w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)
        return torch.from_numpy(gguf.dequantize(gguf.quants.quantize(x, qt), qt).reshape(x.shape).astype(np.float32))

    def name_of(hf_name: str) -> str:
        hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")  # -> exp_probs_b.bias
        out = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert out is not None, hf_name
        return out

    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if ".mlp.experts." in name:  # stacked [E, 2I, H] / [E, H, I]: the converter's merged names
                base = name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
                if name.endswith("gate_up_proj"):
                    t[:, :MOE_I] = put(name_of(f"{base}.gate_proj.weight"), t[:, :MOE_I])
                    t[:, MOE_I:] = put(name_of(f"{base}.up_proj.weight"), t[:, MOE_I:])
                else:
                    t.copy_(put(name_of(f"{base}.down_proj.weight"), t))
            elif name.endswith("kv_b_proj.weight") and not legacy:  # split as the converter splits it
                kv = t.view(n, NOPE + VDIM, RANK)
                k_b = put(name_of(name.replace("kv_b_proj", "k_b_proj")), kv[:, :NOPE].transpose(1, 2))
                v_b = put(name_of(name.replace("kv_b_proj", "v_b_proj")), kv[:, NOPE:])
                t.copy_(torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(t.shape))
            else:
                t.copy_(put(name_of(name), t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def case(request, tmp_path_factory):
    """(kind, transformers model holding the file's values, HF directory, GGUF path, LoadedModel)."""
    kind = request.param
    hf = _hf_model(kind)
    out = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(out / "hf")
    path = out / f"tiny-{kind}.gguf"
    _write(hf, path)
    hf.generation_config.eos_token_id = None  # the references run all their tokens, as ignore_eos
    return kind, hf, out / "hf", path, load_model(path, weights="auto")


def test_config_equals_the_hf_directory_config(case):
    kind, _, hf_dir, path, lm = case
    c = lm.config
    assert lm.weights == "gguf"
    assert c.architecture == kind and load_config(path) == c
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_nope_head_dim, c.v_head_dim, c.rope_interleave) == (
        RANK, QLORA if kind == "deepseek_v2" else None, NOPE, VDIM, True)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_layers, c.moe_n_group, c.moe_topk_group) == (E, K, [1, 2], 2, 1)
    ref = load_config(hf_dir).to_dict()
    got = c.to_dict()
    for key in ("model_id", "revision"):
        ref.pop(key), got.pop(key)
    assert got.pop("rms_norm_eps") == pytest.approx(ref.pop("rms_norm_eps"), rel=1e-7)  # a float32 in the file
    assert got == ref


def test_weights_hold_the_stored_blocks(case):
    kind, hf, _, _, lm = case
    v3 = kind == "deepseek_v3"
    net = lm.model
    for i in range(3):
        mla, ref = net.layers[i].mla, hf.model.layers[i].self_attn
        names = ("q_proj",) if v3 else ("q_a_proj", "q_b_proj")
        for attr in (*names, "kv_a_proj_with_mqa"):
            lin = getattr(mla, attr)
            assert isinstance(lin, GGUFLinear) and lin.types == ("Q8_0",)
            torch.testing.assert_close(lin.dequantize(), getattr(ref, attr).weight, rtol=0, atol=1e-6)
        assert isinstance(net.layers[i].o_proj, GGUFLinear)
        # the re-joined kv_b_proj: the F16 attn_k_b and Q8_0 attn_v_b values, exactly
        assert mla.kv_b_proj.weight.dtype == torch.float32
        assert torch.equal(mla.kv_b_proj.weight, ref.kv_b_proj.weight)
    assert isinstance(net.layers[0].gate_up_proj, GGUFLinear) and net.layers[0].mlp is None
    for i in (1, 2):
        mlp, ref = net.layers[i].mlp, hf.model.layers[i].mlp
        gu = mlp.shared.gate_up_proj
        assert isinstance(gu, GGUFLinear) and gu.out_features == 2 * MOE_I * hf.config.n_shared_experts
        # stored bytes: 34 per 32 values
        assert gu.packed.nbytes == gu.out_features * 64 // 32 * 34
        torch.testing.assert_close(gu.dequantize(), torch.cat([ref.shared_experts.gate_proj.weight,
                                                               ref.shared_experts.up_proj.weight]), rtol=0, atol=1e-6)
        assert torch.equal(mlp.router.weight, ref.gate.weight)
        assert isinstance(mlp.experts[5].down_proj, GGUFLinear)
        if v3:
            assert torch.equal(mlp.e_score_correction_bias, ref.gate.e_score_correction_bias)
        else:
            assert mlp.e_score_correction_bias is None


def test_logits_close_and_greedy_tokens_equal_transformers(case):
    """The stored blocks dequantised (route ``fallback``: ``F.linear`` on the dequantised
    weights) give transformers' logits (1e-4): every weight is the file's value in the right
    place. On the integer kernels (route ``fast``) the activations are int8 blocks of 32 too;
    the MLA projections' errors are amplified by the attention (measured: median error per
    position ~1.5% of the largest logit, a few routing/attention flips higher), so greedy tokens
    are compared on prompts with a clear margin."""
    _, hf, _, _, lm = case
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    backend = get_backend("cpu")

    def logits() -> torch.Tensor:
        caches = allocate_kv_caches(lm.model, backend, num_blocks=4, block_size=16)
        got = []
        for start, end in ((0, 13), (13, 29), (29, 30)):
            md = AttentionMetadata.build([end], [end - start], [[2, 0]], 16)
            with torch.inference_mode():
                got.append(lm.model.compute_logits(lm.model(torch.tensor(ids[start:end]), torch.arange(start, end),
                                                            caches, md, backend)))
        return torch.cat(got)

    linears = list(iter_linears(lm.model))
    routes = [m.route for m in linears]
    try:
        for m in linears:
            m.prepare("fallback")
        torch.testing.assert_close(logits(), ref, rtol=1e-4, atol=2e-4)
    finally:
        for m, route in zip(linears, routes):
            m.prepare(route)
    got = logits()
    err = (got - ref).abs().amax(-1)
    assert err.median().item() < 0.02 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    # the first two of 20 seeded prompts whose greedy path in transformers keeps the top two logits
    # > MARGIN apart at every step (a nearer tie could flip either way under the int8 activations)
    prompts, refs = [], []
    for seed in range(20):
        p = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(seed)).tolist()
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                          max_new_tokens=12, pad_token_id=hf.config.pad_token_id, output_logits=True,
                          return_dict_in_generate=True)
        if min((lg[0].topk(2).values[0] - lg[0].topk(2).values[1]).item() for lg in out.logits) > MARGIN:
            prompts.append(p)
            refs.append(out.sequences[0, len(p):].tolist())
        if len(prompts) == 2:
            break
    assert len(prompts) == 2
    llm = LLM(lm, block_size=4, num_blocks=32, max_num_batched_tokens=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_older_files_with_one_kv_b_tensor(tmp_path):
    """``attn_kv_b`` ``[n (nope + v), r]`` and ``head_count_kv`` = heads: the same config, and
    ``kv_b_proj`` the stored tensor's values."""
    hf = _hf_model("deepseek_v2")
    path = tmp_path / "old.gguf"
    _write(hf, path, legacy=True)
    new = tmp_path / "new.gguf"
    _write(_hf_model("deepseek_v2"), new)
    assert load_config(path).to_dict() | {"model_id": "", "revision": ""} == \
        load_config(new).to_dict() | {"model_id": "", "revision": ""}
    lm = load_model(path, weights="gguf")
    for i in range(3):
        assert torch.equal(lm.model.layers[i].mla.kv_b_proj.weight, hf.model.layers[i].self_attn.kv_b_proj.weight)


def test_bad_files_raise_config_error(tmp_path):
    hf = _hf_model("deepseek_v2")
    _write(hf, tmp_path / "gating.gguf", gating=3)
    with pytest.raises(ConfigError, match="expert_gating_func"):
        load_config(tmp_path / "gating.gguf")
    _write(_hf_model("deepseek_v2"), tmp_path / "half.gguf", drop="blk.1.attn_v_b.weight")
    with pytest.raises(ConfigError, match="attn_k_b / attn_v_b"):
        load_model(tmp_path / "half.gguf", weights="gguf")
    for fmt in ("fp32", "int8"):  # the formats that dequantise a GGUF
        with pytest.raises(ConfigError, match="weights='gguf'"):
            load_model(tmp_path / "half.gguf", weights=fmt)


def test_yarn_scaling_reads_as_transformers(tmp_path):
    """A V3 with yarn RoPE (factor 4 over 64 positions, ``mscale`` = ``mscale_all_dim`` 0.707,
    as DeepSeek-V2/V3 configure it): the file's ``rope.scaling.*`` keys give the HF directory's
    RoPE frequencies and softmax scale, and the dequantised route's logits over 100 positions
    (past the original 64) equal transformers' (1e-4)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
            "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    hf = _hf_model("deepseek_v3", rope_parameters=yarn)
    hf.save_pretrained(tmp_path / "hf")
    _write(hf, tmp_path / "yarn.gguf")
    from pagedkv.model.mla import softmax_scale, yarn_inv_freq

    lm, ref = load_model(tmp_path / "yarn.gguf", weights="gguf"), load_config(tmp_path / "hf")
    rs = lm.config.rope_scaling
    assert (rs["rope_type"], rs["factor"], rs["original_max_position_embeddings"]) == ("yarn", 4.0, 64)
    assert rs["mscale_all_dim"] == pytest.approx(0.707, rel=1e-6)
    inv, att = yarn_inv_freq(rs, ROPE, lm.config.rope_theta)
    ref_inv, ref_att = yarn_inv_freq(ref.rope_scaling, ROPE, ref.rope_theta)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)
    assert att == pytest.approx(ref_att, rel=1e-6)
    assert softmax_scale(lm.config) == pytest.approx(softmax_scale(ref), rel=1e-6)
    assert softmax_scale(lm.config) != pytest.approx((NOPE + ROPE) ** -0.5)  # the mscale bites
    for m in iter_linears(lm.model):
        m.prepare("fallback")
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float()
    backend = get_backend("cpu")
    caches = allocate_kv_caches(lm.model, backend, num_blocks=8, block_size=16)
    md = AttentionMetadata.build([100], [100], [list(range(7))], 16)
    with torch.inference_mode():
        got = lm.model.compute_logits(lm.model(torch.tensor(ids), torch.arange(100), caches, md, backend))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)
