"""ModelConfig from GGUF metadata and HF config.json: real values, variants and errors."""

from __future__ import annotations

import json

import pytest

from pagedkv.errors import ConfigError
from pagedkv.model.config import ModelConfig

# HuggingFaceTB/SmolLM2-135M-Instruct config.json (the fields we read).
SMOLLM2_HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000,
    "rope_scaling": None, "rms_norm_eps": 1e-05, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False,
    "mlp_bias": False, "pretraining_tp": 1,
}

# The bundled GGUF's metadata (scalars only) and a plausible tensor list.
SMOLLM2_GGUF = {
    "general.architecture": "llama", "llama.block_count": 30, "llama.context_length": 8192,
    "llama.embedding_length": 576, "llama.feed_forward_length": 1536, "llama.attention.head_count": 9,
    "llama.attention.head_count_kv": 3, "llama.rope.freq_base": 100000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-05, "llama.vocab_size": 49152,
    "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
}
TENSORS = ["token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight"]


def test_config_from_bundled_gguf(bundled_gguf):
    from pagedkv._bundled import BUNDLED_MODEL_ID
    from pagedkv.model.loader import file_sha256, load_config

    c = load_config(bundled_gguf)
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 30, 9, 3, 64)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (49152, 576, 1536)
    assert c.q_size == 576 and c.kv_size == 192
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 8192
    assert c.tie_word_embeddings is True and c.attention_bias is False
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]  # <|im_start|>, <|im_end|>
    assert c.model_id == BUNDLED_MODEL_ID
    assert c.revision == file_sha256(bundled_gguf)[:16] and len(c.revision) == 16
    assert load_config(None) == c


def test_gguf_and_hf_configs_agree():
    g = ModelConfig.from_gguf_metadata(SMOLLM2_GGUF, TENSORS, model_id="m", revision="r")
    h = ModelConfig.from_hf_config(SMOLLM2_HF, model_id="m", revision="r")
    assert g == h


def test_roundtrip_through_json():
    c = ModelConfig.from_hf_config(
        {**SMOLLM2_HF, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, model_id="x", revision="abc"
    )
    again = ModelConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and again.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ConfigError, match="num_layers"):
        ModelConfig.from_dict({k: v for k, v in c.to_dict().items() if k != "num_layers"})
    with pytest.raises(ConfigError, match="bogus"):
        ModelConfig.from_dict({**c.to_dict(), "bogus": 1})


def test_gguf_variants():
    untied_bias = ModelConfig.from_gguf_metadata(
        {**SMOLLM2_GGUF, "tokenizer.ggml.eot_token_id": 7},
        TENSORS + ["output.weight", "blk.0.attn_q.bias"],
    )
    assert untied_bias.tie_word_embeddings is False and untied_bias.attention_bias is True
    assert untied_bias.eos_token_ids == [2, 7]
    qwen = {k.replace("llama.", "qwen2."): v for k, v in SMOLLM2_GGUF.items()}
    qwen["general.architecture"] = "qwen2"
    assert ModelConfig.from_gguf_metadata(qwen, TENSORS).architecture == "qwen2"
    linear = ModelConfig.from_gguf_metadata(
        {**SMOLLM2_GGUF, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, TENSORS
    )
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    factors = ModelConfig.from_gguf_metadata(SMOLLM2_GGUF, TENSORS, rope_freq_factors=[1.0] * 32)
    assert factors.rope_scaling == {"rope_type": "freq_factors", "factors": [1.0] * 32}
    no_vocab = {k: v for k, v in SMOLLM2_GGUF.items() if k != "llama.vocab_size"}
    assert ModelConfig.from_gguf_metadata({**no_vocab, "tokenizer.ggml.tokens": ["a"] * 49152}).vocab_size == 49152
    no_kv = {k: v for k, v in SMOLLM2_GGUF.items() if k != "llama.attention.head_count_kv"}
    assert ModelConfig.from_gguf_metadata(no_kv, TENSORS).num_kv_heads == 9


def test_hf_variants():
    qwen = ModelConfig.from_hf_config({**SMOLLM2_HF, "model_type": "qwen2", "use_sliding_window": False,
                                       "sliding_window": 4096})
    assert qwen.architecture == "qwen2" and qwen.attention_bias is True and qwen.max_position_embeddings == 8192
    assert qwen.layer_windows() == [None] * 30
    mistral = ModelConfig.from_hf_config({**SMOLLM2_HF, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.max_position_embeddings == 8192  # the window is real: it no longer caps the context
    assert mistral.layer_windows() == [4096] * 30
    no_window = ModelConfig.from_hf_config({**SMOLLM2_HF, "model_type": "mistral", "sliding_window": None})
    assert no_window.max_position_embeddings == 8192 and no_window.layer_windows() == [None] * 30
    qwen_w = ModelConfig.from_hf_config({**SMOLLM2_HF, "model_type": "qwen2", "use_sliding_window": True,
                                         "sliding_window": 512, "max_window_layers": 28})
    assert qwen_w.layer_windows() == [None] * 28 + [512, 512]
    # Gemma-2 without layer_types: every 2nd layer full; Gemma-3: every 6th (sliding_window_pattern)
    gemma2 = ModelConfig.from_hf_config({**SMOLLM2_HF, "model_type": "gemma2", "sliding_window": 4096,
                                         "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 144,
                                         "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert gemma2.layer_windows()[:4] == [4096, None, 4096, None]
    assert (gemma2.attn_scale, gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (144 ** -0.5, 50.0, 30.0)
    assert (gemma2.norm_offset, gemma2.sandwich_norms, gemma2.embed_scale) == (1.0, True, 576 ** 0.5)
    gemma3 = ModelConfig.from_hf_config({**SMOLLM2_HF, "model_type": "gemma3_text", "sliding_window": 1024,
                                         "hidden_activation": "gelu_pytorch_tanh", "rope_local_base_freq": 10000.0,
                                         "rope_theta": 1e6})
    assert gemma3.layer_windows()[:6] == [1024] * 5 + [None] and gemma3.qk_norm
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (1e6, 10000.0)
    assert ModelConfig.from_dict(gemma3.to_dict()) == gemma3
    llama3 = ModelConfig.from_hf_config(
        {**SMOLLM2_HF, "eos_token_id": [128001, 128009], "rope_theta": None,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
         "vocab_size": 128256, "bos_token_id": 128000},
        generation_config={"eos_token_id": [128001, 128008, 128009]},
    )
    assert llama3.rope_theta == 500000.0 and llama3.rope_scaling["rope_type"] == "llama3"
    assert llama3.eos_token_ids == [128001, 128009, 128008]
    v5 = ModelConfig.from_hf_config(
        {**{k: v for k, v in SMOLLM2_HF.items() if k not in ("rope_theta", "rope_scaling", "head_dim")},
         "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
    )
    assert v5.rope_theta == 100000.0 and v5.rope_scaling is None and v5.head_dim == 64


@pytest.mark.parametrize(
    "change, field",
    [
        ({"general.architecture": "gpt2"}, "general.architecture"),
        ({"general.architecture": None}, "general.architecture"),
        ({"llama.block_count": None}, "llama.block_count"),
        ({"llama.attention.layer_norm_rms_epsilon": None}, "llama.attention.layer_norm_rms_epsilon"),
        ({"llama.context_length": None}, "llama.context_length"),
        ({"tokenizer.ggml.eos_token_id": None}, "tokenizer.ggml.eos_token_id"),
        ({"llama.attention.head_count_kv": 4}, "num_kv_heads"),
        ({"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.type"),
        ({"llama.block_count": 2.5}, "llama.block_count"),
        ({"tokenizer.ggml.eos_token_id": 10**6}, "eos_token_ids"),
    ],
)
def test_gguf_errors_name_the_field(change, field):
    meta = {**SMOLLM2_GGUF, **change}
    meta = {k: v for k, v in meta.items() if v is not None}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_gguf_metadata(meta, TENSORS)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"model_type": None, "architectures": ["GPT2LMHeadModel"]}, "model_type"),
        ({"hidden_size": None}, "hidden_size"),
        ({"rms_norm_eps": None}, "rms_norm_eps"),
        ({"max_position_embeddings": None}, "max_position_embeddings"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
        ({"eos_token_id": None}, "eos_token_id"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 32,
                                                 "long_factor": [1.0] * 32}}, "rope_scaling"),
        ({"model_type": "phi3", "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ({"model_type": "gemma3", "text_config": {}}, "model_type"),
        ({"model_type": "gemma2", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
        ({"model_type": "gemma2", "sliding_window": 8, "layer_types": ["full_attention"]}, "layer_types"),
        ({"model_type": "gemma2", "attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
        ({"model_type": "gemma3_text", "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "rope_parameters.sliding_attention"),
    ],
)
def test_hf_errors_name_the_field(change, field):
    cfg = {k: v for k, v in {**SMOLLM2_HF, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_hf_config(cfg)


def test_unknown_architecture_at_construction():
    c = ModelConfig.from_hf_config(SMOLLM2_HF).to_dict()
    with pytest.raises(ConfigError, match="architecture"):
        ModelConfig(**{**c, "architecture": "falcon"})
