"""DeepSeek-V2/V3 GGUF files (llama.cpp architecture ``deepseek2``) on their stored blocks
(``weights="gguf"``, ``pagedkv.model.gguf_mla``).

Tiny transformers DeepSeek-V2 and V3 (``builders.deepseek_gguf_model``: the builder of
``tests/model/test_deepseek.py`` with V2's ``q_lora_rank`` 64 so its ``q_b`` rows are whole
Q8_0 blocks, ``scoring_func`` set as DeepSeek's configs set it) are written to GGUF as
llama-cpp-python 0.3.36's ``convert_hf_to_gguf.py`` writes them (checked against that
converter's output for these models: the same keys, tensor names, types and shapes):
``head_count_kv`` 1, ``key_length`` ``r + rope`` / ``value_length`` ``r`` with the head sizes
in ``key_length_mla`` / ``value_length_mla``, ``kv_b_proj`` split into ``attn_k_b``
``[n, r, nope]`` (F16: its rows of 16 are no whole Q8_0 block, the converter's fallback) and
``attn_v_b`` ``[n, v, r]``, the experts stacked, ``exp_probs_b.bias`` (V3), shared experts
``ffn_*_shexp``; norms, the router and the bias F32, every other matrix Q8_0. The older form
(``attn_kv_b``, ``head_count_kv`` = heads, ``key_length`` the head size) is written too
(``builders.write_deepseek_gguf``). transformers then gets the file's dequantised values.
Checked: the config equals the HF directory's, the matrices are ``GGUFLinear`` on their stored
bytes and ``kv_b_proj`` the re-joined float values, logits against transformers' within the
int8-activation error, the engine's greedy tokens equal ``generate``'s on prompts with a clear
margin, and bad files raise ``ConfigError``.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention import get_backend
from pagedkv.attention.base import AttentionMetadata
from pagedkv.errors import ConfigError
from pagedkv.model.gguf_native import GGUFLinear, iter_linears
from pagedkv.model.loader import load_config, load_model
from pagedkv.testing.caches import allocate_kv_caches
from tests.model.builders import (
    E, K, MOE_I, NOPE, QLORA, RANK, ROPE, VDIM, chunked_logits, deepseek_gguf_model, hf_logits, margin_prompts, prompt,
    write_deepseek_gguf,
)

MARGIN = 0.5  # greedy top-2 logit gap of the compared prompts (measured: gaps <= 0.46 can flip)


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def case(request, tmp_path_factory):
    """(kind, transformers model holding the file's values, HF directory, GGUF path, LoadedModel)."""
    kind = request.param
    hf = deepseek_gguf_model(kind)
    out = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(out / "hf")
    path = out / f"tiny-{kind}.gguf"
    write_deepseek_gguf(hf, path)
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
    ids = prompt(30, 1, 0, 256)
    ref = hf_logits(hf, ids)
    backend = get_backend("cpu")

    def logits() -> torch.Tensor:
        return chunked_logits(lm.model, ids, 16, backend, chunks=((0, 13), (13, 29), (29, 30)), table=[2, 0],
                              num_blocks=4)

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
    prompts, refs = margin_prompts(hf, new=12, margin=MARGIN)
    assert len(prompts) == 2
    llm = LLM(lm, block_size=4, num_blocks=32, max_num_batched_tokens=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_older_files_with_one_kv_b_tensor(tmp_path):
    """``attn_kv_b`` ``[n (nope + v), r]`` and ``head_count_kv`` = heads: the same config, and
    ``kv_b_proj`` the stored tensor's values."""
    hf = deepseek_gguf_model("deepseek_v2")
    path = tmp_path / "old.gguf"
    write_deepseek_gguf(hf, path, legacy=True)
    new = tmp_path / "new.gguf"
    write_deepseek_gguf(deepseek_gguf_model("deepseek_v2"), new)
    assert load_config(path).to_dict() | {"model_id": "", "revision": ""} == \
        load_config(new).to_dict() | {"model_id": "", "revision": ""}
    lm = load_model(path, weights="gguf")
    for i in range(3):
        assert torch.equal(lm.model.layers[i].mla.kv_b_proj.weight, hf.model.layers[i].self_attn.kv_b_proj.weight)


def test_bad_files_raise_config_error(tmp_path):
    hf = deepseek_gguf_model("deepseek_v2")
    write_deepseek_gguf(hf, tmp_path / "gating.gguf", gating=3)
    with pytest.raises(ConfigError, match="expert_gating_func"):
        load_config(tmp_path / "gating.gguf")
    write_deepseek_gguf(deepseek_gguf_model("deepseek_v2"), tmp_path / "half.gguf", drop="blk.1.attn_v_b.weight")
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
    hf = deepseek_gguf_model("deepseek_v3", rope_parameters=yarn)
    hf.save_pretrained(tmp_path / "hf")
    write_deepseek_gguf(hf, tmp_path / "yarn.gguf")
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
    want = hf_logits(hf, ids)
    backend = get_backend("cpu")
    caches = allocate_kv_caches(lm.model, backend, num_blocks=8, block_size=16)
    md = AttentionMetadata.build([100], [100], [list(range(7))], 16)
    with torch.inference_mode():
        got = lm.model.compute_logits(lm.model(torch.tensor(ids), torch.arange(100), caches, md, backend))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)
