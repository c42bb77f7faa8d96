"""The new families from GGUF files (the architectures the ``gguf`` package maps: qwen3,
gemma2, gemma3, phi3), against transformers on the same weights (fp32).

Each tiny transformers model of ``test_families`` is written to a GGUF the way llama.cpp's
``convert_hf_to_gguf.py`` writes that architecture (names from ``gguf``'s tensor map, Gemma's
norms stored as ``1 + w``, Phi-3's fused ``attn_qkv`` / ``ffn_up``, the window and soft caps as
metadata), then loaded through pagedkv's GGUF path; its logits over a chunked prefill must equal
the transformers model's (atol = rtol = 1e-4). GGUF has no ``query_pre_attn_scalar``, so the
Gemma-2 model here uses ``head_dim`` (llama.cpp's assumption). transformers' own GGUF reader
cannot be the oracle for these tiny models: it drops ``head_dim`` for qwen3 (defaults to 128),
the soft caps and ``query_pre_attn_scalar`` for Gemma, and ``pad_token_id`` for phi3.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import get_backend
from pagedkv.errors import ConfigError
from pagedkv.gguf_header import read_gguf_header
from pagedkv.model.loader import build_model
from pagedkv.model.weights import gguf_config, gguf_state_dict
from tests.model.builders import NORM_NOISE, chunked_logits, finish_gguf, hf_logits, match, prompt, seeded_model
from tests.model.test_families import _hf_config

_LAYER = {  # HF layer tensor -> llama.cpp's GGUF name
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
_TOP = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _write_gguf(hf, arch: str, path) -> None:
    import gguf

    c, gemma = hf.config, arch.startswith("gemma")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    for add, v in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                   (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                   (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                   (w.add_key_length, head_dim), (w.add_value_length, head_dim), (w.add_vocab_size, c.vocab_size),
                   (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_bos_token_id, c.bos_token_id),
                   (w.add_eos_token_id, c.eos_token_id)):
        add(v)
    rp = c.rope_parameters
    w.add_rope_freq_base(rp["full_attention"]["rope_theta"] if "full_attention" in rp else rp["rope_theta"])
    if getattr(c, "sliding_window", None) and arch != "qwen3":
        w.add_sliding_window(c.sliding_window)
    for key, add in (("attn_logit_softcapping", w.add_attn_logit_softcapping),
                     ("final_logit_softcapping", w.add_final_logit_softcapping)):
        if getattr(c, key, None):
            add(getattr(c, key))
    for name, t in hf.state_dict().items():
        key = name.removeprefix("model.")
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            part = rest.removesuffix(".weight")
            if part == "post_attention_layernorm":
                part = "post_attention_norm" if gemma else "ffn_norm"
            else:
                part = _LAYER[part]
            g = f"blk.{i}.{part}.weight"
        elif gemma and key == "lm_head.weight":
            continue  # tied
        else:
            g = _TOP[key]
        if gemma and key.endswith("norm.weight"):
            t = t + 1.0
        w.add_tensor(g, t.float().numpy())
    finish_gguf(w)


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_gguf_families_equal_transformers(tmp_path, kind):
    cfg, cls = _hf_config(kind)
    if kind == "gemma2":
        cfg.query_pre_attn_scalar = cfg.head_dim
    if kind == "qwen3":  # llama.cpp writes no window for qwen3: full attention on both sides
        cfg.use_sliding_window, cfg.sliding_window = False, None
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    hf = seeded_model(cfg, cls, [NORM_NOISE, (match(has=("q_proj", "k_proj", "qkv_proj", "embed_tokens")), "mul", 8.0)])
    path = tmp_path / "tiny.gguf"
    _write_gguf(hf, kind, path)
    header = read_gguf_header(path)
    config = gguf_config(path, header, "test")
    assert config.architecture == kind
    assert config.layer_windows() == {"qwen3": [None] * 3, "gemma2": [6, None, 6], "gemma3": [8, 8, 8],
                                      "phi3": [9] * 3}[kind]
    model = build_model(config, gguf_state_dict(path, header, config))
    ids = prompt(30, 1)
    if kind == "gemma3":  # GGUF knows only llama.cpp's pattern (every 6th layer full): all 3 slide
        hf.config.layer_types = ["sliding_attention"] * 3
        for layer in hf.model.layers:
            layer.self_attn.sliding_window, layer.self_attn.layer_type = 8, "sliding_attention"
            layer.attention_type = "sliding_attention"
    ref = hf_logits(hf, ids)
    got = chunked_logits(model, ids, 4, get_backend("cpu"), ((0, 11), (11, 29), (29, 30)),
                         table=[3, 7, 0, 9, 5, 1, 8, 2], num_blocks=10)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_phi3_longrope_gguf_is_refused(tmp_path):
    from pagedkv.model.config import ModelConfig

    meta = {"general.architecture": "phi3", "phi3.block_count": 2, "phi3.context_length": 128,
            "phi3.embedding_length": 64, "phi3.feed_forward_length": 96, "phi3.attention.head_count": 4,
            "phi3.attention.layer_norm_rms_epsilon": 1e-6, "phi3.vocab_size": 97, "tokenizer.ggml.eos_token_id": 2}
    assert ModelConfig.from_gguf_metadata(meta, ["token_embd.weight"]).architecture == "phi3"
    with pytest.raises(ConfigError, match="rope_factors_long"):
        ModelConfig.from_gguf_metadata(meta, ["token_embd.weight", "rope_factors_long.weight"])
