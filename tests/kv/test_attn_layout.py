"""One reader of a model config's layout and window rules (``pagedkv.attn_layout``): the KV cache spec a
plan sizes (``KVCacheSpec.from_hf_config`` / ``from_gguf``) has the windows of the model the
engine runs (``ModelConfig.layer_windows``), and both are transformers' windows; and one
``blocks_needed`` for the blocks a request holds."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.attn_layout import hf_layer_windows
from pagedkv.engine.request import SamplingParams
from pagedkv.engine.sequence_group import request_blocks
from pagedkv.errors import ConfigError
from pagedkv.examples.capacity_plan import grouped_blocks
from pagedkv.gguf_header import read_gguf_metadata
from pagedkv.kv.block_table import blocks_needed
from pagedkv.kv.groups import LayerGroups
from pagedkv.kv.spec import KVCacheSpec, known_config, known_configs
from pagedkv.model.config import ModelConfig
from tests.model.test_families import FAMILIES, _hf_config

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "eos_token_id": 2}


def _spec_windows(spec: KVCacheSpec) -> list:
    return list(spec.layer_windows) if spec.layer_windows is not None else [None] * spec.num_layers


def _transformers_windows(cfg: dict) -> list:
    """Per layer the window transformers' own config class gives (its ``layer_types``;
    Mistral / Phi-3 have none and slide every layer)."""
    import transformers as tf

    c = tf.AutoConfig.for_model(**cfg).get_text_config()
    # a key the config class has no field for (Llama's sliding_window, Mistral's layer_types) is
    # kept as an attribute but unused by the model
    w = getattr(c, "sliding_window", None) if hasattr(type(c), "sliding_window") else None
    types = getattr(c, "layer_types", None) if hasattr(type(c), "layer_types") else None
    if w is None:
        return [None] * c.num_hidden_layers
    return [w] * c.num_hidden_layers if types is None else [w if t == "sliding_attention" else None for t in types]


def _model_windows(cfg: dict) -> list:
    eos = cfg.get("eos_token_id")
    cfg = dict(cfg.get("text_config") or cfg)  # a multimodal checkpoint: the engine runs its text model
    if cfg.get("eos_token_id") is None:  # some shipped configs keep it in generation_config.json only
        cfg["eos_token_id"] = 1 if eos is None else eos
    return ModelConfig.from_hf_config(cfg).layer_windows()


@pytest.mark.parametrize("name", known_configs())
def test_shipped_config_spec_windows_equal_model_and_transformers_windows(name):
    cfg = known_config(name)
    spec = _spec_windows(KVCacheSpec.from_hf_config(name))
    assert spec == _transformers_windows(cfg)
    assert _model_windows(cfg) == spec  # DeepSeek-V3: MLA + mixture-of-experts layers 3..60
    want = {"gemma-2-9b": [4096, None] * 21, "gemma-3-12b": ([1024] * 5 + [None]) * 8,
            "mistral-7b": [4096] * 32, "qwen2.5-7b": [None] * 28, "llama-2-7b": [None] * 32,
            "llama-3-8b": [None] * 32, "deepseek-v3": [None] * 61}[name]
    assert spec == want


@pytest.mark.parametrize("kind", FAMILIES)
def test_tiny_family_spec_windows_equal_model_windows(kind):
    hf_cfg, _ = _hf_config(kind)
    cfg = hf_cfg.to_dict()
    spec = _spec_windows(KVCacheSpec.from_hf_config(cfg, dtype="fp32"))
    want = {"qwen3": [None, 7, 7], "mistral": [10] * 3, "phi3": [9] * 3, "gemma2": [6, None, 6],
            "gemma3": [8, None, 8]}[kind]
    assert spec == ModelConfig.from_hf_config(cfg).layer_windows() == _transformers_windows(cfg) == want


def _window_cfg(model_type: str, layers: int, **kw) -> dict:
    return {**BASE, "model_type": model_type, "num_hidden_layers": layers, **kw}


@pytest.mark.parametrize("cfg, want", [
    # Qwen2, sliding on, no max_window_layers: transformers' default 28, so 4 layers have none
    (_window_cfg("qwen2", 4, use_sliding_window=True, sliding_window=64), [None] * 4),
    (_window_cfg("qwen2", 32, use_sliding_window=True, sliding_window=64), [None] * 28 + [64] * 4),
    (_window_cfg("qwen2", 4, use_sliding_window=True, sliding_window=64, max_window_layers=1), [None] + [64] * 3),
    (_window_cfg("qwen2", 4, use_sliding_window=False, sliding_window=64, max_window_layers=0), [None] * 4),
    (_window_cfg("qwen3", 3, use_sliding_window=True, sliding_window=16, max_window_layers=0,
                 layer_types=["full_attention", "sliding_attention", "full_attention"]), [None, 16, None]),
    # Gemma-3: five sliding layers, then a full one
    (_window_cfg("gemma3_text", 12, sliding_window=512), ([512] * 5 + [None]) * 2),
    (_window_cfg("gemma3_text", 4, sliding_window=512, sliding_window_pattern=2), [512, None, 512, None]),
    (_window_cfg("gemma2", 4, sliding_window=32, sliding_window_pattern=3), [32, None, 32, None]),
    # Mistral: one window on every layer (layer_types is not a Mistral field: ignored)
    (_window_cfg("mistral", 4, sliding_window=4096), [4096] * 4),
    (_window_cfg("mistral", 2, sliding_window=8, layer_types=["full_attention", "sliding_attention"]), [8, 8]),
    (_window_cfg("mistral", 4, sliding_window=None), [None] * 4),
    # Llama: no sliding layers, whatever the dict says
    (_window_cfg("llama", 4, sliding_window=64), [None] * 4),
])
def test_window_rules_match_transformers(cfg, want):
    assert hf_layer_windows(cfg, cfg["num_hidden_layers"]) == want
    assert _transformers_windows(cfg) == want
    assert _spec_windows(KVCacheSpec.from_hf_config(cfg)) == want
    assert ModelConfig.from_hf_config(cfg).layer_windows() == want


@pytest.mark.parametrize("cfg, match", [
    (_window_cfg("mistral", 2, sliding_window=0), "sliding_window"),
    (_window_cfg("gemma2", 2, sliding_window=8, layer_types=["sliding_attention"]), "layer_types"),
    (_window_cfg("gemma3_text", 2, sliding_window=8, layer_types=["local", "global"]), "layer_types"),
    (_window_cfg("qwen2", 2, use_sliding_window=True, sliding_window=8, max_window_layers=-1), "max_window_layers"),
])
def test_bad_window_fields_raise_on_both_sides(cfg, match):
    with pytest.raises(ConfigError, match=match):
        KVCacheSpec.from_hf_config(cfg)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_config(cfg)


def _write_gguf_header(path, arch: str, layers: int, window: int | None) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for add, v in ((w.add_block_count, layers), (w.add_context_length, 256), (w.add_embedding_length, 64),
                   (w.add_feed_forward_length, 96), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                   (w.add_key_length, 16), (w.add_value_length, 16), (w.add_vocab_size, 100),
                   (w.add_layer_norm_rms_eps, 1e-6), (w.add_eos_token_id, 2)):
        add(v)
    if window is not None:
        w.add_sliding_window(window)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch, window, want", [
    ("gemma3", 16, [16] * 5 + [None] + [16] * 2),
    ("gemma2", 16, [16, None] * 4),
    ("phi3", 9, [9] * 8),
    ("qwen2", 16, [None] * 8),  # llama.cpp runs qwen2 full attention
    ("llama", None, [None] * 8),
])
def test_gguf_spec_windows_equal_model_windows(tmp_path, arch, window, want):
    path = tmp_path / f"{arch}.gguf"
    _write_gguf_header(path, arch, 8, window)
    spec = KVCacheSpec.from_gguf(path)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (8, 2, 16)
    assert _spec_windows(spec) == ModelConfig.from_gguf_metadata(read_gguf_metadata(path)).layer_windows() == want


def test_from_model_config_is_the_engines_spec():
    mc = ModelConfig.from_hf_config(_window_cfg("gemma3_text", 12, sliding_window=512))
    spec = KVCacheSpec.from_model_config(mc, "int8", quant_group_size=8)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (12, 2, 16, "int8")
    assert spec.layer_windows == (512,) * 5 + (None,) + (512,) * 5 + (None,)
    assert spec.quant_group_size == 8
    assert KVCacheSpec.from_model_config(ModelConfig.from_hf_config(_window_cfg("llama", 3)), "fp32").layer_windows is None


def test_blocks_needed_exact_counts():
    # full attention: ceil(T / bs), block boundaries included
    assert [blocks_needed(t, 16) for t in (0, 1, 15, 16, 17, 32, 33, 32768)] == [0, 1, 1, 1, 2, 2, 3, 2048]
    # a window of 8 tokens, blocks of 4: after a decode at position T-1 the live positions are T-8 .. T-1
    assert [blocks_needed(t, 4, 8) for t in (0, 1, 4, 8, 9, 12, 13, 16, 100)] == [0, 1, 1, 2, 3, 2, 3, 2, 2]
    # Gemma-2 at 32k: a 4096-token window in 16-token blocks holds 256 blocks (257 one token later)
    assert (blocks_needed(32768, 16, 4096), blocks_needed(32769, 16, 4096)) == (256, 257)
    # the most it holds at any step with 512-token chunks: ceil((4096 - 1 + 512) / 16) + 1
    assert blocks_needed(32768, 16, 4096, chunk=512) == 289
    assert (blocks_needed(100, 4, 8, chunk=4), blocks_needed(6, 4, 8, chunk=4)) == (4, 2)
    assert blocks_needed(100, 4, None, chunk=4) == 25  # chunk does not matter to a full group


def test_blocks_needed_equals_the_live_positions_blocks():
    """The window count is the blocks of positions ``T - W .. T - 1``, and the chunk bound
    covers every step that computes up to ``chunk`` positions at once."""
    for bs in (1, 3, 4):
        for w in (1, 3, 4, 5, 8, 13):
            groups = LayerGroups.from_layer_windows([None, w])
            for t in range(0, 60):
                live = {p // bs for p in range(max(0, t - w), t)}
                assert blocks_needed(t, bs, w) == len(live) == groups.blocks_held(1, t, bs), (bs, w, t)
                for c in (1, 4, 7):  # a step computing positions s .. s+c-1 needs s-w+1 .. s+c-1
                    most = max((len({p // bs for p in range(max(0, s - w + 1), min(t, s + c))})
                                for s in range(t)), default=0)
                    assert most <= blocks_needed(t, bs, w, chunk=c) <= -(-t // bs), (bs, w, t, c)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, layer_windows=(None, 8))
    lengths = np.arange(0, 40, dtype=np.int64)
    blocks, _ = grouped_blocks(spec, lengths, 4)
    assert blocks.tolist() == [blocks_needed(int(t), 4) + blocks_needed(int(t), 4, 8) for t in lengths]
    assert spec.blocks_per_request(30, 4) == 8 + 3 and spec.blocks_per_request(30, 4, chunk=4) == 8 + 4


def test_blocks_needed_of_an_array_is_the_scalar_count_per_element():
    """Capacity simulations (examples/capacity_plan.py, bench/capacity/sim.py) count many requests at once
    through the same function; each element equals the scalar count."""
    t = np.arange(0, 70, dtype=np.int64)
    for bs, w, c in ((4, None, None), (4, 8, None), (3, 13, None), (4, 8, 4), (16, 4096, 512)):
        got = blocks_needed(t, bs, w, chunk=c)
        assert got.tolist() == [blocks_needed(int(x), bs, w, chunk=c) for x in t], (bs, w, c)
    assert blocks_needed(np.array([0, 9, 13, 100]), 4, 8).tolist() == [0, 3, 3, 2]
    with pytest.raises(ConfigError, match="num_tokens"):
        blocks_needed(np.array([3, -1]), 4)
    with pytest.raises(ConfigError, match="num_tokens"):
        blocks_needed(np.array([3.0]), 4)


@pytest.mark.parametrize("args, match", [
    ((10, 0), "block_size"), ((-1, 4), "num_tokens"), ((10, 4, 0), "window"), ((10, 4, 8, 0), "chunk"),
    ((True, 4), "num_tokens"), ((10.0, 4), "num_tokens"),
])
def test_blocks_needed_rejects_bad_input(args, match):
    with pytest.raises(ConfigError, match=match):
        blocks_needed(*args)


def test_request_blocks_per_group_beams_and_reservation():
    greedy = SamplingParams(max_tokens=90)
    # 100 tokens in blocks of 4: a full group 25 blocks; an 8-token window with 4-token steps 4
    assert request_blocks(10, 100, greedy, 4, True, 256) == 25
    assert request_blocks(10, 100, greedy, 4, True, 256, (None, 8), chunk=4) == 25 + 4
    # paging off: the whole max_model_len reserved per sequence, a window group included up to its bound
    assert request_blocks(10, 100, greedy, 4, False, 256) == 64
    assert request_blocks(10, 100, greedy, 4, False, 256, (None, 8), chunk=4) == 64 + 4
    beam = SamplingParams(max_tokens=90, beam_width=3)
    # shared prompt (3 blocks) + per beam its 90 output tokens (23 blocks) and one partly filled copy
    assert request_blocks(10, 100, beam, 4, True, 256) == 3 + 3 * 24
    assert request_blocks(10, 100, beam, 4, True, 256, (None, 8), chunk=4) == 75 + 4 * 4


def test_one_reader_of_layers_heads_and_head_dim_for_hf_and_gguf():
    from pagedkv.attn_layout import gguf_heads, gguf_mla_ranks, gguf_num_layers, hf_heads, hf_mla_ranks, hf_num_layers

    cfg = {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}
    assert (hf_num_layers(cfg), hf_heads("llama", cfg)) == (3, (8, 2, 64))
    assert hf_heads("llama", {**cfg, "head_dim": 80}) == (8, 2, 80)
    assert hf_heads("deepseek_v3", cfg) == (8, 2, 128 + 64)  # MLA: qk_nope + qk_rope defaults
    assert hf_mla_ranks("minicpm3", {}) == (256, 32) and hf_mla_ranks("deepseek_v2", {"kv_lora_rank": 16}) == (16, 64)
    with pytest.raises(ConfigError, match="num_key_value_heads: 3 does not divide"):
        hf_heads("llama", {**cfg, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="kv_lora_rank: missing"):
        hf_mla_ranks("deepseek_v3", {"kv_lora_rank": None})
    meta = {"llama.block_count": 4, "llama.attention.head_count": 8, "llama.attention.head_count_kv": [2, 2, 2, 2],
            "llama.embedding_length": 256}
    assert (gguf_num_layers("llama", meta), gguf_heads("llama", meta)) == (4, (8, 2, 32))
    assert gguf_heads("llama", {**meta, "llama.attention.key_length": 48}) == (8, 2, 48)
    assert gguf_mla_ranks("deepseek2", {"deepseek2.attention.kv_lora_rank": 512, "deepseek2.rope.dimension_count": 64}) == (512, 64)
    with pytest.raises(ConfigError, match="per-layer KV head counts"):
        gguf_heads("llama", {**meta, "llama.attention.head_count_kv": [2, 4, 2, 2]})
    with pytest.raises(ConfigError, match="llama.attention.head_count: missing"):
        gguf_heads("llama", {"llama.block_count": 4})
