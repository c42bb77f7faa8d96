"""Backends are selectable by name; unknown names fail with the list of valid ones."""

import pytest
import torch

from pagedkv.attention import AttentionBackend, get_backend, list_backends
from pagedkv.errors import BackendError, ConfigError


def test_every_listed_backend_implements_the_protocol():
    names = list_backends()
    assert {"reference", "cpu", "cpu-hnd", "cpu-ascend"} <= set(names)
    for name in names:
        try:
            be = get_backend(name)
        except BackendError as exc:  # e.g. triton not installed
            assert name.startswith("triton"), exc
            continue
        assert isinstance(be, AttentionBackend)
        assert be.name == name


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ConfigError, match="cpu-hnd"):
        get_backend("nope")


@pytest.mark.parametrize("bad", [dict(num_blocks=0), dict(block_size=-1), dict(dtype=torch.int32)])
def test_allocate_rejects_bad_sizes(bad):
    args = dict(num_blocks=4, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    args.update(bad)
    with pytest.raises(ConfigError):
        get_backend("cpu").allocate_kv_cache(**args)
