"""Bad config.json values of the MLA / mixture-of-experts families are a ``ConfigError`` naming
the config.json key (never a bare ``ValueError``, an ``AttributeError``, an internal field
name, or a silently different model); missing keys take transformers 5.24's config-class
defaults. The configs are the tiny ones of ``test_mla.py`` / ``test_families_moe.py``,
mutated one key at a time.
"""

from __future__ import annotations

import json
import shutil

import pytest

from pagedkv.errors import ConfigError
from pagedkv.model.config import ModelConfig
from pagedkv.model.loader import load_model

DEL = object()


def _hf(kind: str, **kw) -> dict:
    """The tiny config.json dict of ``kind`` with ``kw`` applied (``DEL``: key removed)."""
    if kind in ("qwen3_moe", "mixtral"):
        from tests.model.builders import moe_config as _hf_config
    else:
        from tests.model.test_mla import _hf_config
    d = _hf_config(kind)[0].to_dict()
    for k, v in kw.items():
        if v is DEL:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def _cfg(kind: str, **kw) -> ModelConfig:
    return ModelConfig.from_hf_config(_hf(kind, **kw))


@pytest.mark.parametrize("kind, kw, message", [
    # 1: the MLA field, not the derived head_dim
    ("deepseek_v3", dict(qk_rope_head_dim=7), "qk_rope_head_dim: must be even for RoPE, got 7"),
    ("minicpm3", dict(qk_rope_head_dim=7), "qk_rope_head_dim: must be even for RoPE, got 7"),
    ("deepseek_v3", dict(qk_nope_head_dim=-1), "qk_nope_head_dim: must be a positive integer, got -1"),
    # 2 / 3: null where transformers has no usable value, non-positive sizes
    ("deepseek_v3", dict(kv_lora_rank=None), "kv_lora_rank: missing (null)"),
    ("minicpm3", dict(kv_lora_rank=None), "kv_lora_rank: missing (null)"),
    ("deepseek_v3", dict(kv_lora_rank="32"), "kv_lora_rank: must be a positive integer, got '32'"),
    ("deepseek_v3", dict(v_head_dim=0), "v_head_dim: must be a positive integer, got 0"),
    ("minicpm3", dict(v_head_dim=-24), "v_head_dim: must be a positive integer, got -24"),
    ("deepseek_v3", dict(v_head_dim=None), "v_head_dim: missing (null)"),
    # 4: no bare ValueError
    ("deepseek_v3", dict(first_k_dense_replace="a"), "first_k_dense_replace: must be an integer >= 0, got 'a'"),
    ("deepseek_v3", dict(first_k_dense_replace=-1), "first_k_dense_replace: must be an integer >= 0, got -1"),
    ("minicpm3", dict(scale_emb="x"), "scale_emb: must be a positive number, got 'x'"),
    ("deepseek_v3", dict(rope_parameters="x"), "rope_parameters: must be a JSON object or null, got 'x'"),
    # 5
    ("minicpm3", dict(dim_model_base=0), "dim_model_base: must be a positive number, got 0"),
    ("deepseek_v3", dict(rope_interleave="yes"), "rope_interleave: must be true or false, got 'yes'"),
    # 6: the config's keys, as the family spells them
    ("qwen3_moe", dict(num_experts_per_tok=0), "num_experts_per_tok: must be a positive integer, got 0"),
    ("qwen3_moe", dict(num_experts_per_tok="2"), "num_experts_per_tok: must be a positive integer, got '2'"),
    ("qwen3_moe", dict(moe_intermediate_size=0), "moe_intermediate_size: must be a positive integer, got 0"),
    ("qwen3_moe", dict(num_experts=2.5), "num_experts: must be an integer >= 0, got 2.5"),
    ("mixtral", dict(num_local_experts=-3), "num_local_experts: must be a positive integer, got -3"),
    ("mixtral", dict(num_experts_per_tok=0), "num_experts_per_tok: must be a positive integer, got 0"),
    ("deepseek_v3", dict(first_k_dense_replace=1, n_routed_experts=-1),
     "n_routed_experts: must be an integer >= 0, got -1"),
    ("mixtral", dict(num_experts_per_tok=9), "num_experts_per_tok: 9 > num_local_experts 8"),
    ("qwen3_moe", dict(num_experts_per_tok=9), "num_experts_per_tok: 9 > num_local_experts 8"),  # 5.24's spelling
    ("qwen3_moe", dict(num_local_experts=DEL, num_experts=8, num_experts_per_tok=9),
     "num_experts_per_tok: 9 > num_experts 8"),
    ("deepseek_v3", dict(first_k_dense_replace=1, num_experts_per_tok=DEL),
     "num_experts_per_tok: 8 > n_routed_experts 4"),  # transformers' default top-k 8
    ("qwen3_moe", dict(norm_topk_prob="x"), "norm_topk_prob: must be true or false, got 'x'"),
    ("mixtral", dict(num_local_experts=0), "num_local_experts: must be a positive integer, got 0"),
    ("deepseek_v3", dict(first_k_dense_replace=1, n_routed_experts=0),
     "n_routed_experts: 0 experts, but layers 1.. are mixture-of-experts (first_k_dense_replace 1)"),
    # 10: HF keys, not ModelConfig's names
    ("deepseek_v3", dict(num_attention_heads=0), "num_attention_heads: must be a positive integer, got 0"),
    ("deepseek_v3", dict(num_hidden_layers=-1), "num_hidden_layers: must be a positive integer, got -1"),
    ("deepseek_v3", dict(num_key_value_heads=3), "num_key_value_heads: 3 does not divide num_attention_heads 4"),
    ("qwen3_moe", dict(head_dim=0), "head_dim: must be a positive integer, got 0"),
])
def test_bad_value_is_a_config_error_naming_the_key(kind, kw, message):
    with pytest.raises(ConfigError) as e:
        _cfg(kind, **kw)
    assert str(e.value).startswith(message), str(e.value)


def test_missing_mla_keys_take_the_config_class_defaults():
    """transformers 5.24: ``kv_lora_rank`` 512 (DeepSeek) / 256 (MiniCPM3), ``v_head_dim`` 128
    (DeepSeek) / ``hidden // heads`` (MiniCPM3), ``q_lora_rank`` 1536 / 768 when missing,
    MiniCPM3 ``dim_model_base`` 256 when missing and ``hidden_size`` when null."""
    v3 = _cfg("deepseek_v3", kv_lora_rank=DEL, v_head_dim=DEL, q_lora_rank=DEL)
    assert (v3.is_mla, v3.kv_lora_rank, v3.v_head_dim, v3.q_lora_rank) == (True, 512, 128, 1536)
    assert (v3.cache_head_dim, v3.cache_kv_heads) == (512 + 8, 1)  # latent + rope (qk_rope_head_dim 8)
    mc = _cfg("minicpm3", kv_lora_rank=DEL, v_head_dim=DEL, q_lora_rank=DEL, dim_model_base=DEL)
    assert (mc.is_mla, mc.kv_lora_rank, mc.v_head_dim, mc.q_lora_rank) == (True, 256, 64 // 4, 768)
    assert mc.logits_scaling == 64 / 256
    assert _cfg("minicpm3", dim_model_base=None).logits_scaling == 1.0
    assert _cfg("deepseek_v3", q_lora_rank=None).q_lora_rank is None  # explicit null: one q_proj
    assert _cfg("deepseek_v3", rope_interleave=False).rope_interleave is False
    assert _cfg("deepseek_v3", n_routed_experts=0).num_experts == 0  # every layer dense (first_k_dense_replace 3)
    assert _cfg("qwen3_moe", num_local_experts=0).num_experts == 0  # transformers: a dense Qwen3-MoE


@pytest.mark.parametrize("text, kind", [("[1]", "array"), ("null", "null"), ('"x"', "string")])
def test_config_json_that_is_not_an_object(tmp_path, text, kind):
    """The same message as the KV planner's (``pagedkv.kv.spec.load_hf_config``)."""
    from pagedkv.kv.spec import KVCacheSpec

    (tmp_path / "config.json").write_text(text)
    message = f"{tmp_path / 'config.json'}: not a config.json (a JSON object), got a JSON {kind}"
    for load in (load_model, KVCacheSpec.from_hf_config):
        with pytest.raises(ConfigError) as e:
            load(tmp_path)
        assert str(e.value) == message
    with pytest.raises(ConfigError, match=r"^config\.json: not a config \(a JSON object\)"):
        ModelConfig.from_hf_config(json.loads(text))


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """A saved tiny Qwen3-MoE (8 experts, seeded random weights)."""
    import torch

    from tests.model.builders import moe_config as _hf_config

    cfg, cls = _hf_config("qwen3_moe")
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("qwen3_moe")
    cls(cfg).save_pretrained(out)
    return out


def test_fewer_experts_than_the_checkpoint_names_num_experts(qwen3_moe_dir, tmp_path):
    bad = tmp_path / "m"
    shutil.copytree(qwen3_moe_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_experts"] = 4
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_model(bad)
    assert str(e.value).startswith("num_experts: the checkpoint has experts beyond num_experts=4: "
                                   "[(0, 'experts.4.gate'), (0, 'experts.4.up'), (0, 'experts.5.gate')]"), str(e.value)


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """The tiny qwen3moe GGUF of ``test_gguf_moe.py``."""
    from tests.model.builders import moe_gguf_model, write_moe_gguf

    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_moe_gguf(moe_gguf_model(), path)
    return path


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1", ""])
def test_lazy_experts_variable_takes_only_0_or_1(moe_gguf, monkeypatch, value):
    path = moe_gguf
    monkeypatch.setenv("PAGEDKV_LAZY_EXPERTS", value)
    with pytest.raises(ConfigError) as e:
        load_model(path, weights="gguf")
    assert str(e.value) == f"PAGEDKV_LAZY_EXPERTS: must be '0' or '1' (or unset), got {value!r}"


@pytest.mark.parametrize("kind, rank, rope", [("deepseek_v3", 512, 64), ("minicpm3", 256, 32)])
def test_planner_reads_the_same_mla_defaults_as_the_model(kind, rank, rope):
    """The KV planner (``KVCacheSpec.from_hf_config``) sizes a config.json without
    ``kv_lora_rank`` / ``qk_rope_head_dim`` as the model reads it; a null ``kv_lora_rank`` is
    refused by both."""
    from pagedkv.kv.spec import KVCacheSpec

    d = _hf(kind, kv_lora_rank=DEL, qk_rope_head_dim=DEL)
    spec, model = KVCacheSpec.from_hf_config(d, dtype="float32"), ModelConfig.from_hf_config(d)
    assert (spec.kv_lora_rank, spec.qk_rope_head_dim, spec.head_dim, spec.num_kv_heads) == (rank, rope, rank + rope, 1)
    assert (model.kv_lora_rank, model.qk_rope_head_dim, model.cache_head_dim, model.cache_kv_heads) == (
        rank, rope, rank + rope, 1)
    with pytest.raises(ConfigError, match="kv_lora_rank: missing"):  # one reader: pagedkv.attn_layout
        KVCacheSpec.from_hf_config({**d, "kv_lora_rank": None})
