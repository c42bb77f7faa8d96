"""KV sizing (seed §01) against published figures, plus bad input."""

from __future__ import annotations

import json

import pytest

from pagedkv.errors import ConfigError
from pagedkv.kv import KVCacheSpec, known_config, known_configs, parse_size
from pagedkv.kv.spec import read_gguf_metadata

KiB = 1024


def test_known_configs_shipped():
    assert known_configs() == [
        "deepseek-v3", "gemma-2-9b", "gemma-3-12b", "llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-7b",
    ]
    assert known_config("llama-3-8b")["num_key_value_heads"] == 8


def test_llama2_7b_fp16_512kib_per_token():
    s = KVCacheSpec.from_hf_config("llama-2-7b")
    assert s.dtype == "fp16"
    assert (s.num_layers, s.num_kv_heads, s.head_dim) == (32, 32, 128)
    assert s.bytes_per_token == 512 * KiB == 524_288


def test_llama3_8b_bf16_128kib_per_token():
    s = KVCacheSpec.from_hf_config("llama-3-8b")
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype) == (32, 8, 128, "bf16")
    assert s.bytes_per_token == 128 * KiB == 131_072
    assert s.bytes_per_token_per_layer == 4096
    assert s.page_size_bytes(16) == 65_536
    assert s.block_bytes(16) == 2_097_152
    assert s.num_blocks("20GiB", 16) == 10_240
    assert s.num_blocks(2_097_152, 16) == 1


def test_deepseek_v3_mla_70272_bytes_per_token():
    s = KVCacheSpec.from_hf_config("deepseek-v3")
    assert s.is_mla and (s.num_layers, s.kv_lora_rank, s.qk_rope_head_dim) == (61, 512, 64)
    assert s.bytes_per_token == 70_272 == 61 * (512 + 64) * 2
    # The latent has no heads: replicated on every TP rank.
    t = KVCacheSpec.from_hf_config("deepseek-v3", tp_size=8)
    assert t.bytes_per_token == 70_272
    assert t.bytes_per_token_total == 8 * 70_272
    assert t.replication == 8


def test_other_shipped_configs():
    assert KVCacheSpec.from_hf_config("qwen2.5-7b").bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344
    assert KVCacheSpec.from_hf_config("mistral-7b").bytes_per_token == 131_072
    g = KVCacheSpec.from_hf_config("gemma-2-9b", dtype="bf16")
    assert g.head_dim == 256  # explicit head_dim, not hidden/heads = 224
    assert g.bytes_per_token == 2 * 42 * 8 * 256 * 2 == 344_064
    # dtype=None takes torch_dtype (gemma-2-9b ships float32).
    assert KVCacheSpec.from_hf_config("gemma-2-9b").dtype == "fp32"


def test_bundled_smollm2_from_gguf():
    from pagedkv._bundled import bundled_model_path

    path = bundled_model_path()
    s32 = KVCacheSpec.from_gguf(path)
    assert (s32.num_layers, s32.num_kv_heads, s32.head_dim, s32.dtype) == (30, 3, 64, "fp32")
    assert s32.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    s16 = KVCacheSpec.from_gguf(path, dtype="bf16")
    assert s16.bytes_per_token == 23_040
    assert s16.page_size_bytes(16) == 16 * 768 == 12_288


def test_quantised_dtypes_count_scales():
    base = dict(num_layers=32, num_kv_heads=8, head_dim=128)
    # fp8 as the engine stores it: 1 byte/element + one bf16 scale per head vector, like int8.
    assert KVCacheSpec(**base, dtype="fp8").bytes_per_token == 2 * 32 * 8 * 130 == 66_560
    assert KVCacheSpec(**base, dtype="fp8_e5m2").bytes_per_token == 66_560
    # int8: + one bf16 scale per head vector (128 elements): 130 bytes per vector.
    assert KVCacheSpec(**base, dtype="int8").bytes_per_token == 2 * 32 * 8 * 130 == 66_560
    # int4 packed: 64 bytes + 2-byte scale per vector.
    assert KVCacheSpec(**base, dtype="int4").bytes_per_token == 2 * 32 * 8 * 66 == 33_792
    # Group of 32 elements: 4 scales per vector.
    assert KVCacheSpec(**base, dtype="int4", quant_group_size=32).bytes_per_token == 2 * 32 * 8 * 72
    # MLA int8: one scale over the 576-element latent.
    mla = KVCacheSpec(num_layers=61, num_kv_heads=1, head_dim=576, dtype="int8",
                      kv_lora_rank=512, qk_rope_head_dim=64)
    assert mla.bytes_per_token == 61 * 578 == 35_258


def test_tensor_parallel_split_and_replication():
    s = KVCacheSpec.from_hf_config("llama-3-8b", tp_size=4)  # 8 heads / 4 ranks
    assert s.kv_heads_per_rank == 2 and s.replication == 1
    assert s.bytes_per_token == 32_768 and s.bytes_per_token_total == 131_072
    r = KVCacheSpec.from_hf_config("llama-3-8b", tp_size=16)  # 8 heads < 16 ranks
    assert r.kv_heads_per_rank == 1 and r.replication == 2
    assert r.bytes_per_token == 16_384 and r.bytes_per_token_total == 262_144
    with pytest.raises(ConfigError, match="tp_size"):
        KVCacheSpec(num_layers=1, num_kv_heads=8, head_dim=8, tp_size=3)


def test_parse_size():
    assert parse_size("20GiB") == 21_474_836_480
    assert parse_size("512MiB") == 536_870_912
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size(123) == 123
    assert parse_size("1.5GiB") == 1_610_612_736
    assert parse_size("64k") == 65_536
    for bad in ("-1GiB", "lots", "", -5, True):
        with pytest.raises(ConfigError, match="size"):
            parse_size(bad)


def test_bad_input_is_typed_and_names_the_field():
    s = KVCacheSpec.from_hf_config("llama-3-8b")
    for bs in (0, -16):
        with pytest.raises(ConfigError, match="block_size"):
            s.page_size_bytes(bs)
    with pytest.raises(ConfigError, match="kv_budget"):
        s.num_blocks(2_097_151, 16)
    with pytest.raises(ConfigError, match="model_type"):
        KVCacheSpec.from_hf_config({"model_type": "rwkv", "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="num_attention_heads"):
        KVCacheSpec.from_hf_config({"model_type": "llama", "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        KVCacheSpec.from_hf_config({"model_type": "deepseek_v3", "num_hidden_layers": 2, "kv_lora_rank": None})
    with pytest.raises(ConfigError, match="dtype"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="fp12")
    with pytest.raises(ConfigError, match="num_layers"):
        KVCacheSpec(num_layers=0, num_kv_heads=1, head_dim=8)
    with pytest.raises(ConfigError, match="unknown config name"):
        KVCacheSpec.from_hf_config("llama-9-1t")


def test_hf_config_from_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(known_config("qwen2.5-7b")))
    assert KVCacheSpec.from_hf_config(tmp_path).bytes_per_token == 57_344
    assert KVCacheSpec.from_hf_config(tmp_path / "config.json", dtype="fp32").bytes_per_token == 114_688


def _write_gguf(path, kv: dict):
    """A minimal GGUF v3 header with the given uint32/string metadata and no tensors."""
    import struct

    out = [b"GGUF", struct.pack("<IQQ", 3, 0, len(kv))]
    for key, val in kv.items():
        kb = key.encode()
        out.append(struct.pack("<Q", len(kb)) + kb)
        if isinstance(val, str):
            vb = val.encode()
            out.append(struct.pack("<IQ", 8, len(vb)) + vb)
        else:
            out.append(struct.pack("<II", 4, val))
    path.write_bytes(b"".join(out))


def test_gguf_without_needed_keys(tmp_path):
    p = tmp_path / "m.gguf"
    _write_gguf(p, {"general.architecture": "llama", "llama.block_count": 4})
    with pytest.raises(ConfigError, match="llama.attention.head_count"):
        KVCacheSpec.from_gguf(p)
    _write_gguf(p, {"general.name": "x"})
    with pytest.raises(ConfigError, match="general.architecture"):
        KVCacheSpec.from_gguf(p)
    _write_gguf(p, {"general.architecture": "llama", "llama.block_count": 4,
                    "llama.attention.head_count": 8, "llama.attention.head_count_kv": 2,
                    "llama.embedding_length": 512})
    assert read_gguf_metadata(p)["llama.block_count"] == 4
    s = KVCacheSpec.from_gguf(p, dtype="fp16")
    assert (s.num_kv_heads, s.head_dim, s.bytes_per_token) == (2, 64, 2 * 4 * 2 * 64 * 2)
    (tmp_path / "bad.gguf").write_bytes(b"NOPE")
    with pytest.raises(ConfigError, match="not a GGUF"):
        KVCacheSpec.from_gguf(tmp_path / "bad.gguf")
