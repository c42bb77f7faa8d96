"""Multi-head latent attention (``pagedkv.model.mla``) against transformers 5.24 (fp32, eager).

Three tiny random-weight families built with transformers and saved as HF directories:

* ``minicpm3``: MLA with a ``q_lora_rank`` (q_a_proj / q_a_layernorm / q_b_proj), rotate-half
  RoPE, ``scale_emb`` / ``scale_depth`` / ``dim_model_base`` scaling, tied embeddings;
* ``deepseek_v2``: every layer dense (``first_k_dense_replace`` = ``num_hidden_layers``), the
  complex (interleaved) rotary, yarn RoPE scaling with ``mscale_all_dim`` (softmax scale times
  mscale^2, cos/sin times the attention factor);
* ``deepseek_v3``: dense, ``q_lora_rank`` null (one ``q_proj``), ``rope_interleave``.

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

FAMILIES = ["minicpm3", "deepseek_v2", "deepseek_v3"]
VOCAB = 97
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
    kind = request.param
    cfg, cls = _hf_config(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms, and scores large enough that mistakes show
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif any(k in name for k in ("q_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj", "embed_tokens")):
                p.mul_(3.0)
    out = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(out)
    from tests.model.test_llama import _tiny_tokenizer

    _tiny_tokenizer().save_pretrained(out)
    return kind, hf, out, load_model(out)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


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
    equal transformers' one forward (atol = rtol = 1e-4). Chunks run the expanded form, decode
    rows the absorbed one."""
    kind, hf, _, lm = family
    ids = _prompt(40, 1)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    backend = get_backend("cpu")
    caches = lm.model.allocate_kv_caches(backend, num_blocks=16, block_size=4)
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
    assert rows[0] == {"absorbed": 0, "expanded": 13} and rows[-1] == {"absorbed": 1, "expanded": 0}
    assert lm.model._fused_state == lm.model.native_state == "off (MLA layers run eager)"
