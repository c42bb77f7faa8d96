"""The planner's config reader (``pagedkv.kv.spec.load_hf_config``) on malformed files: a
``ConfigError`` naming the file, never an ``AttributeError`` / ``TypeError`` from inside
(before: a JSON array gave ``'list' object has no attribute 'get'``, ``null`` a
``TypeError``), through ``KVCacheSpec.from_hf_config`` and ``pagedkv plan``."""

from __future__ import annotations

import pytest

from pagedkv.cli import main
from pagedkv.errors import ConfigError
from pagedkv.kv.spec import KVCacheSpec, load_hf_config


@pytest.mark.parametrize("content, kind", [
    (b"[1, 2]", "a JSON array"), (b"null", "a JSON null"), (b'"llama"', "a JSON string"), (b"7", "a JSON number"),
    (b"\xff\xfe\x00garbage", "not a readable config.json"), (b"{", "not a readable config.json"),
])
def test_a_config_json_that_is_no_object_is_a_config_error(tmp_path, content, kind):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match="config.json") as err:
        load_hf_config(tmp_path)
    assert kind in str(err.value)
    with pytest.raises(ConfigError, match=kind):
        KVCacheSpec.from_hf_config(tmp_path, dtype="fp32")


def test_pagedkv_plan_reports_it_without_a_traceback(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[]")
    code = main(["plan", "--model", str(tmp_path), "--kv-budget", "1MiB"])
    err = capsys.readouterr().err
    assert code not in (0, None) and "a JSON array" in err and "Traceback" not in err
