"""The packed-matrix store (``pagedkv.model.packed_cache``): a GGUF's first ``weights="gguf"``
load stores its matrices in the kernels' layout; the next load maps them back (nothing read or
packed), byte for byte the same and with the same tokens; a damaged or mismatched store is
ignored and rewritten; ``use_cache=False`` neither reads nor writes one."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.model import gguf_native, packed_cache
from pagedkv.model.loader import load_model


def _linears(lm) -> dict[str, gguf_native.GGUFLinear]:
    return {n: m for n, m in lm.model.named_modules() if isinstance(m, gguf_native.GGUFLinear)}


def _store(root):
    files = sorted((root / "packed").glob("*"))
    assert [p.suffix for p in files] == [".bin", ".json"], files
    return files


@pytest.fixture(scope="module")
def first(bundled_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    lm = load_model(bundled_gguf, weights="gguf", cache_dir=root)
    packed_cache.wait_for_writes()
    return lm, root


def test_the_second_load_maps_every_matrix_with_the_same_bytes_and_tokens(first, bundled_gguf):
    lm, root = first
    assert lm.report.packed_from_cache == 0
    bin_, manifest = _store(root)
    a = _linears(lm)
    # 30 layers x (qkv, o, gate_up, down) + the tied Q8_0 head; no bias, no float copies
    assert len(a) == 121
    held = sum(m.packed.nbytes for m in a.values())
    assert held <= bin_.stat().st_size <= held + 64 * len(a)  # each array at a 64-byte aligned offset
    meta = json.loads(manifest.read_text())
    assert meta["format"] == packed_cache.FORMAT_VERSION and meta["size"] == bin_.stat().st_size
    assert len(meta["entries"]) == 121 and meta["entries"]["token_embd.weight"]["types"] == ["Q8_0"]
    again = load_model(bundled_gguf, weights="gguf", cache_dir=root)
    assert again.report.packed_from_cache == 121 and again.report.bytes_read < 1 << 20  # norms only
    b = _linears(again)
    assert a.keys() == b.keys()
    for name, m in a.items():
        n = b[name]
        assert (n.packed.fmt, n.packed.n, n.packed.k, n.types, n.out_features) == (
            m.packed.fmt, m.packed.n, m.packed.k, m.types, m.out_features)
        assert torch.equal(n.packed.codes, m.packed.codes), name
    g = torch.Generator().manual_seed(0)
    for name in ("layers.0.qkv_proj", "layers.29.down_proj", "lm_head"):  # the kernels on the mapped bytes
        for rows in (1, 5):
            x = torch.randn(rows, a[name].in_features, generator=g)
            assert torch.equal(b[name](x), a[name](x)), (name, rows)


def test_a_damaged_store_is_ignored_and_rewritten(first, bundled_gguf, tmp_path, caplog):
    lm, root = first
    bin_, manifest = _store(root)
    (tmp_path / "packed").mkdir()
    for p in (bin_, manifest):
        (tmp_path / "packed" / p.name).write_bytes(p.read_bytes())
    (tmp_path / "ids").mkdir()
    for p in (root / "ids").glob("*"):
        (tmp_path / "ids" / p.name).write_bytes(p.read_bytes())
    cut = tmp_path / "packed" / bin_.name
    cut.write_bytes(cut.read_bytes()[: 1 << 20])  # a truncated file: the manifest's size disagrees
    with caplog.at_level("WARNING", logger="pagedkv"):
        lm2 = load_model(bundled_gguf, weights="gguf", cache_dir=tmp_path)
    assert lm2.report.packed_from_cache == 0 and "unusable" in caplog.text
    packed_cache.wait_for_writes()
    assert cut.stat().st_size == bin_.stat().st_size
    assert load_model(bundled_gguf, weights="gguf", cache_dir=tmp_path).report.packed_from_cache == 121


def test_a_manifest_entry_of_another_shape_is_packed_again(first, bundled_gguf, tmp_path):
    lm, root = first
    bin_, manifest = _store(root)
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / bin_.name).write_bytes(bin_.read_bytes())
    meta = json.loads(manifest.read_text())
    meta["entries"]["blk.0.ffn_down.weight"]["k"] += 32
    (tmp_path / "packed" / manifest.name).write_text(json.dumps(meta))
    lm2 = load_model(bundled_gguf, weights="gguf", cache_dir=tmp_path)
    assert lm2.report.packed_from_cache == 120
    assert torch.equal(lm2.model.layers[0].down_proj.packed.codes, lm.model.layers[0].down_proj.packed.codes)
    packed_cache.wait_for_writes()  # the store was rewritten whole
    assert json.loads((tmp_path / "packed" / manifest.name).read_text())["entries"]["blk.0.ffn_down.weight"]["k"] == \
        meta["entries"]["blk.0.ffn_down.weight"]["k"] - 32


def test_a_new_store_removes_the_same_files_stores_of_other_layouts(first, bundled_gguf, tmp_path):
    """An upgrade changes the layout tag: the new store replaces the old one on disk (the old
    would never be read again); another model's store and a write in progress stay."""
    (tmp_path / "packed").mkdir()
    sha = _store(first[1])[0].name.split("-", 1)[0]
    old = [tmp_path / "packed" / f"{sha}-0123456789ab{ext}" for ext in (".bin", ".json")]
    other = [tmp_path / "packed" / f"{'f' * 32}-0123456789ab{ext}" for ext in (".bin", ".json")]
    busy = tmp_path / "packed" / f"{sha}-0123456789ab.bin.tmp-1-abcd"
    for p in old + other + [busy]:
        p.write_bytes(b"x" * 10)
    load_model(bundled_gguf, weights="gguf", cache_dir=tmp_path)
    packed_cache.wait_for_writes()
    names = sorted(p.name for p in (tmp_path / "packed").iterdir())
    assert names == sorted([busy.name, *(p.name for p in other), *(p.name for p in _store(first[1]))])


def test_without_the_cache_nothing_is_stored(bundled_gguf, tmp_path):
    lm = load_model(bundled_gguf, weights="gguf", cache_dir=tmp_path, use_cache=False)
    packed_cache.wait_for_writes()
    assert lm.report.packed_from_cache == 0 and not (tmp_path / "packed").exists()


def test_the_environment_switch(first, bundled_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_PACKED_CACHE", "0")
    lm = load_model(bundled_gguf, weights="gguf", cache_dir=tmp_path)
    packed_cache.wait_for_writes()
    assert lm.report.packed_from_cache == 0 and not (tmp_path / "packed").exists()
    monkeypatch.setenv("PAGEDKV_PACKED_CACHE", "yes")
    with pytest.raises(ConfigError, match="PAGEDKV_PACKED_CACHE: must be '0' or '1'"):
        load_model(bundled_gguf, weights="gguf", cache_dir=tmp_path)


def test_a_full_disk_stores_nothing(first, bundled_gguf, tmp_path, monkeypatch, caplog):
    lm, _ = first
    monkeypatch.setattr(packed_cache.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with caplog.at_level("WARNING", logger="pagedkv"):
        load_model(bundled_gguf, weights="gguf", cache_dir=tmp_path)
        packed_cache.wait_for_writes()
    assert "not storing packed weights" in caplog.text
    assert not list((tmp_path / "packed").glob("*"))


def test_the_layout_tag_follows_the_packers_source():
    tag = packed_cache.layout_tag()
    assert len(tag) == 12 and int(tag, 16) >= 0
    import hashlib

    from pagedkv.ops.build import source

    assert tag == hashlib.sha256(source("qmm.c").read_bytes()).hexdigest()[:12]
