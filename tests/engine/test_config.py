"""EngineConfig (pagedkv/engine/config.py) on its own: defaults, each bad value -> ConfigError
naming the field, and the model-dependent helpers."""

import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigError


def test_defaults_validate_and_keep_documented_values():
    cfg = EngineConfig.from_kwargs({})
    assert (cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_n) == (16, 64, 512, 64)
    assert (cfg.policy, cfg.watermark, cfg.dtype, cfg.kv_cache_dtype) == ("fcfs", 0.01, "float32", "auto")
    assert cfg.num_blocks is None and cfg.kv_cache_memory is None and cfg.max_model_len is None
    assert cfg.enable_paging and cfg.enable_chunked_prefill and not cfg.enable_prefix_caching
    assert cfg.prefix_caching is False


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match=r"unknown engine option\(s\): \['blok_size', 'zz'\]"):
        EngineConfig.from_kwargs({"blok_size": 8, "zz": 1})


@pytest.mark.parametrize("name", ["block_size", "max_num_seqs", "max_num_batched_tokens", "max_n", "tensor_parallel_size"])
@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "4"])
def test_positive_integer_fields(name, bad):
    with pytest.raises(ConfigError, match=rf"^{name} must be a positive integer, got {bad!r}$".replace("(", r"\(")):
        EngineConfig.from_kwargs({name: bad})


@pytest.mark.parametrize("name", ["max_model_len", "num_blocks"])
def test_optional_positive_fields(name):
    with pytest.raises(ConfigError, match=f"{name} must be a positive integer or None, got 0"):
        EngineConfig.from_kwargs({name: 0})
    with pytest.raises(ConfigError, match=f"{name} must be a positive integer or None, got False"):
        EngineConfig.from_kwargs({name: False})
    assert getattr(EngineConfig.from_kwargs({name: 7}), name) == 7


def test_shuffle_blocks_accepts_zero_but_not_a_float():
    assert EngineConfig.from_kwargs({"shuffle_blocks": 0}).shuffle_blocks == 0
    with pytest.raises(ConfigError, match="shuffle_blocks must be a positive integer or None, got 1.5"):
        EngineConfig.from_kwargs({"shuffle_blocks": 1.5})


@pytest.mark.parametrize("bad", [-1, 2**63, True, 1.0])
def test_seed_range(bad):
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        EngineConfig.from_kwargs({"seed": bad})
    assert EngineConfig.from_kwargs({"seed": 2**63 - 1}).seed == 2**63 - 1


def test_watermark_type_and_range():
    with pytest.raises(ConfigError, match=r"watermark must be a number in \[0, 1\), got True"):
        EngineConfig.from_kwargs({"watermark": True})
    with pytest.raises(ConfigError, match=r"watermark must be a number in \[0, 1\), got '0.1'"):
        EngineConfig.from_kwargs({"watermark": "0.1"})
    with pytest.raises(ConfigError, match=r"watermark must be in \[0, 1\), got 1.0"):
        EngineConfig.from_kwargs({"watermark": 1.0})
    with pytest.raises(ConfigError, match=r"watermark must be in \[0, 1\), got -0.5"):
        EngineConfig.from_kwargs({"watermark": -0.5})
    assert EngineConfig.from_kwargs({"watermark": 0}).watermark == 0


def test_policy_names():
    assert EngineConfig.from_kwargs({"policy": "priority"}).policy == "priority"
    with pytest.raises(ConfigError, match="policy must be 'fcfs' or 'priority', got 'lifo'"):
        EngineConfig.from_kwargs({"policy": "lifo"})


@pytest.mark.parametrize("kw, fragment", [
    ({"dtype": "int3"}, "dtype: unsupported 'int3'"),
    ({"weights": "int2"}, "weights: unsupported 'int2'"),
    ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype: unknown 'fp4'"),
    ({"kv_quant_group_size": 0}, "kv_quant_group_size must be a positive integer or None, got 0"),
    ({"kv_quant_group_size": 8}, "kv_quant_group_size applies to a quantised kv_cache_dtype"),
    ({"device": "nonsense"}, "device: unknown device 'nonsense'"),
    ({"compile_decode": 1}, "compile_decode must be True or False, got 1"),
    ({"compile_decode": True, "tensor_parallel_size": 2}, "compile_decode: CPU and tensor_parallel_size 1 only"),
    ({"chat_template": "   "}, "chat_template: expected Jinja text or a file path"),
    ({"chat_template": 5}, "chat_template: expected Jinja text or a file path, got 5"),
    ({"kv_offload": ["bogus"]}, "kv_offload: 'bogus'"),
    ({"kv_offload": ["host:1MiB"], "tensor_parallel_size": 2}, "kv_offload: not supported with tensor_parallel_size > 1"),
    ({"kv_events": "http://x:1"}, "kv_events: expected a ZeroMQ endpoint"),
    ({"kv_events": "tcp://127.0.0.1:5557", "kv_events_replay": "udp://a"}, "kv_events_replay: expected a ZeroMQ endpoint"),
    ({"kv_events_replay": "tcp://127.0.0.1:5558"}, "kv_events_replay needs kv_events"),
])
def test_bad_values_raise_config_error_naming_the_field(kw, fragment):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(kw)
    assert fragment in str(e.value)


def test_quant_group_size_with_a_quantised_cache_is_accepted():
    cfg = EngineConfig.from_kwargs({"kv_cache_dtype": "int8", "kv_quant_group_size": 32})
    assert (cfg.kv_cache_dtype, cfg.kv_quant_group_size) == ("int8", 32)


def test_validate_on_a_constructed_config():
    cfg = EngineConfig(block_size=8)
    cfg.validate()
    cfg.block_size = -1
    with pytest.raises(ConfigError, match="block_size must be a positive integer, got -1"):
        cfg.validate()


def test_prefix_caching_turned_on_by_offload_or_events():
    assert EngineConfig(enable_prefix_caching=True).prefix_caching is True
    assert EngineConfig(kv_offload=["host:1MiB"]).prefix_caching is True
    assert EngineConfig(kv_events="tcp://127.0.0.1:5557").prefix_caching is True
    assert EngineConfig(kv_offload=[]).prefix_caching is False


def test_resolve_max_model_len():
    assert EngineConfig().resolve_max_model_len(2048) == 2048
    assert EngineConfig(max_model_len=100).resolve_max_model_len(2048) == 100
    with pytest.raises(ConfigError, match=r"max_model_len 4096 exceeds the model's context \(2048 tokens\)"):
        EngineConfig(max_model_len=4096).resolve_max_model_len(2048)
    with pytest.raises(ConfigError, match="max_model_len must be >= 2, got 1"):
        EngineConfig().resolve_max_model_len(1)
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens must be >= max_model_len \(512 < 1024\)"):
        EngineConfig(enable_chunked_prefill=False, max_model_len=1024).resolve_max_model_len(2048)
    assert EngineConfig(enable_chunked_prefill=False, max_model_len=512).resolve_max_model_len(2048) == 512


def test_max_concurrency_paged_and_contiguous():
    # paged: 100 blocks * 16 tokens / 200 tokens per request
    assert EngineConfig().max_concurrency(100, 200) == 8.0
    # contiguous: each request reserves ceil(200 / 16) = 13 blocks -> 100 // 13 = 7 whole requests
    assert EngineConfig(enable_paging=False).max_concurrency(100, 200) == 7
    assert EngineConfig(enable_paging=False, block_size=8).max_concurrency(100, 200) == 4
