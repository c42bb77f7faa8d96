"""Loading: no weight cache (weights stream from the GGUF on every load, bit-identical), the
tokenizer's cache entry (reuse, corruption -> rebuild, atomic writes), the HF safetensors path
against the GGUF path, the tokenizer, and bad inputs."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import read_gguf_header
from pagedkv.model import loader, weight_cache
from pagedkv.model.loader import load_model


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _replace_file(path, data: bytes) -> None:
    """Write a new file instead of modifying in place (the cache copy is hard-linked)."""
    path.unlink()
    path.write_bytes(data)


@pytest.fixture
def seeded_cache(tmp_path, loaded_model):
    """A private cache root holding a hard-linked copy of the session's tokenizer entry."""
    if loaded_model.cache_dir is None:
        pytest.skip("the default tokenizer cache could not be written")
    root = tmp_path / "cache"
    shutil.copytree(loaded_model.cache_dir, root / loaded_model.cache_dir.name, copy_function=os.link)
    return root


def _stored_bytes(path, config) -> int:
    """Bytes of the tensors the model is made of (a tied ``output.weight`` and ``rope_freqs``
    are not read)."""
    from pagedkv.model.gguf_read import stored_bytes
    from pagedkv.model.weights import gguf_groups

    header = read_gguf_header(path)
    used = {n for g in gguf_groups([t.name for t in header.tensors], config) for n, _ in g.parts}
    return sum(stored_bytes(t) for t in header.tensors if t.name in used)


@pytest.mark.slow
def test_a_second_load_reads_the_tokenizer_entry_and_streams_the_same_weights(bundled_gguf, loaded_model,
                                                                            seeded_cache):
    """No weight cache: the weights stream from the file again (each stored byte read once),
    bit-identical; the tokenizer comes from its entry; nothing but that entry and the file's
    identity is on disk."""
    t0 = time.perf_counter()
    again = load_model(bundled_gguf, cache_dir=seeded_cache)
    elapsed = time.perf_counter() - t0
    entry = seeded_cache / f"{loaded_model.config.revision}-tokenizer"
    assert again.from_cache and again.cache_dir == entry == seeded_cache / loaded_model.cache_dir.name
    assert elapsed < 20, elapsed  # ~3 s on an idle machine; generous for a shared CI box
    assert again.config == loaded_model.config
    assert _same_weights(again.model, loaded_model.model)
    assert again.report.fmt is None and again.report.dtype == torch.float32
    assert again.report.bytes_read == _stored_bytes(bundled_gguf, again.config)
    assert again.report.state_bytes == sum(v.numel() * 4 for v in loaded_model.model.state_dict().values())
    text = "Hello, world! <|im_start|>user\nDéjà vu 12345"
    assert again.tokenizer(text)["input_ids"] == loaded_model.tokenizer(text)["input_ids"]
    assert again.tokenizer.chat_template == loaded_model.tokenizer.chat_template
    assert sorted(p.name for p in seeded_cache.iterdir()) == sorted([entry.name, "ids"])
    big = [p for p in seeded_cache.rglob("*.safetensors") if p.stat().st_size > 1024]
    assert big == []  # the tokenizer entry's model.safetensors is an empty state dict


@pytest.mark.slow
def test_a_damaged_tokenizer_entry_is_rebuilt(bundled_gguf, loaded_model, seeded_cache, monkeypatch):
    # Building the tokenizer from the GGUF takes ~10 s and is covered by the session fixture and
    # test_tokenizer_matches_transformers_gguf_tokenizer; this test is about the entry.
    monkeypatch.setattr(loader, "load_tokenizer", lambda directory, gguf_file=None: loaded_model.tokenizer)
    entry = seeded_cache / loaded_model.cache_dir.name
    vocab = entry / "tokenizer" / "tokenizer.json"
    data = vocab.read_bytes()
    _replace_file(vocab, b"\xff" * 8 + data[8:])  # same size, unreadable (bit rot)
    rebuilt = load_model(bundled_gguf, cache_dir=seeded_cache)
    assert not rebuilt.from_cache and rebuilt.cache_dir == entry
    assert vocab.read_bytes()[:8] == data[:8]
    assert _same_weights(rebuilt.model, loaded_model.model)
    # no temp/stale dirs left (ids/: the file's stored sha256, pagedkv.model.weight_cache.file_identity)
    assert sorted(p.name for p in seeded_cache.iterdir()) == sorted([entry.name, "ids"])
    assert load_model(bundled_gguf, cache_dir=seeded_cache).from_cache


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage", ["truncated_tokenizer", "missing_tokenizer", "manifest_format", "other_source", "weights_kind",
               "no_manifest"]
)
def test_damaged_entries_are_detected(loaded_model, seeded_cache, damage):
    entry = seeded_cache / loaded_model.cache_dir.name
    manifest = json.loads((entry / "manifest.json").read_text())
    sha = manifest["source_sha256"]
    assert weight_cache.read_tokenizer_entry(entry, sha) is not None  # intact: reads
    if damage == "truncated_tokenizer":
        vocab = entry / "tokenizer" / "tokenizer.json"
        _replace_file(vocab, vocab.read_bytes()[: vocab.stat().st_size // 2])
    elif damage == "missing_tokenizer":
        (entry / "tokenizer" / "tokenizer.json").unlink()
    elif damage == "manifest_format":
        _replace_file(entry / "manifest.json", json.dumps({**manifest, "format": -1}).encode())
    elif damage == "other_source":
        _replace_file(entry / "manifest.json", json.dumps({**manifest, "source_sha256": "0" * 64}).encode())
    elif damage == "weights_kind":  # an entry of earlier versions' fp32 weights is not a tokenizer entry
        _replace_file(entry / "manifest.json", json.dumps({**manifest, "weights": "fp32"}).encode())
    else:
        (entry / "manifest.json").unlink()
    with pytest.raises(Exception):
        weight_cache.read_tokenizer_entry(entry, sha)


def test_cache_write_is_atomic(tmp_path, monkeypatch):
    """A crash half-way through writing leaves neither the entry nor temp files."""
    from pagedkv.model.config import ModelConfig

    cfg = ModelConfig(
        architecture="llama", vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=2, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=16,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2],
    )

    class ExplodingTokenizer:
        def save_pretrained(self, directory):
            os.makedirs(directory)
            open(os.path.join(directory, "tokenizer.json"), "w").write("{")
            raise OSError("disk full")

    entry = tmp_path / "abcd"
    with pytest.raises(OSError, match="disk full"):
        weight_cache.write_cache_entry(entry, "ab" * 32, tmp_path / "x.gguf", cfg, {"w": torch.ones(3)}, ExplodingTokenizer())
    assert list(tmp_path.iterdir()) == []

    class Tokenizer:
        def save_pretrained(self, directory):
            os.makedirs(directory)
            open(os.path.join(directory, "tokenizer.json"), "w").write("{}")

    weight_cache.write_cache_entry(entry, "ab" * 32, tmp_path / "x.gguf", cfg, {"w": torch.ones(3)}, Tokenizer())
    assert sorted(p.name for p in entry.iterdir()) == ["config.json", "manifest.json", "model.safetensors", "tokenizer"]
    assert [p.name for p in tmp_path.iterdir()] == ["abcd"]
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["files"]["model.safetensors"] == (entry / "model.safetensors").stat().st_size
    assert ModelConfig.from_dict(json.loads((entry / "config.json").read_text())) == cfg

    # A second writer (a concurrent loader that lost the race) keeps the valid entry ...
    created = manifest["created_unix"]
    weight_cache.write_cache_entry(entry, "ab" * 32, tmp_path / "x.gguf", cfg, {"w": torch.zeros(3)}, Tokenizer())
    assert json.loads((entry / "manifest.json").read_text())["created_unix"] == created
    # ... but a rebuild after a failed load replaces it.
    weight_cache.write_cache_entry(
        entry, "ab" * 32, tmp_path / "x.gguf", cfg, {"w": torch.zeros(3)}, Tokenizer(), replace=True
    )
    assert json.loads((entry / "manifest.json").read_text())["created_unix"] != created
    assert [p.name for p in tmp_path.iterdir()] == ["abcd"]


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(loaded_model, hf_tokenizer):
    tok = loaded_model.tokenizer
    for text in ["The quick brown fox", "  leading spaces\n\ttabs", "<|im_start|>user\nhi<|im_end|>", "数字 123 émoji 🙂"]:
        assert tok(text)["input_ids"] == hf_tokenizer(text)["input_ids"]
    msgs = [{"role": "user", "content": "What is a KV cache?"}]
    ours = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours == hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") in loaded_model.config.eos_token_ids


@pytest.mark.slow
def test_a_generic_fast_tokenizer_entry_loads_without_auto_tokenizer(loaded_model, tmp_path, monkeypatch):
    """The cached SmolLM2 entry (``tokenizer_class`` ``TokenizersBackend``) is loaded by that
    class directly, equal to ``AutoTokenizer``'s; a model-specific class still goes through
    ``AutoTokenizer``."""
    import transformers

    from pagedkv.model.tokenizer import load_tokenizer

    loaded_model.tokenizer.save_pretrained(str(tmp_path / "tok"))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("AutoTokenizer"))
    direct = load_tokenizer(tmp_path / "tok")
    assert type(direct) is type(auto) and direct.all_special_ids == auto.all_special_ids
    for text in ["The quick brown fox", "<|im_start|>user\nhi<|im_end|>", "数字 123 émoji 🙂"]:
        assert direct(text)["input_ids"] == auto(text)["input_ids"]
        assert direct.decode(direct(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    msgs = [{"role": "user", "content": "What is a KV cache?"}]
    assert direct.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GemmaTokenizer"}))
    with pytest.raises(pytest.fail.Exception, match="AutoTokenizer"):
        load_tokenizer(tmp_path / "tok")


@pytest.mark.slow
def test_hf_directory_gives_the_same_model(tmp_path, hf_model, hf_tokenizer, loaded_model):
    """transformers' own GGUF reader (its Q/K un-permutation) saved as safetensors, loaded by
    our HF path: bit-identical to our GGUF path."""
    from safetensors.torch import save_file

    out = tmp_path / "smollm2-hf"
    out.mkdir()
    hf_model.config.to_json_file(out / "config.json")  # (save_pretrained refuses GGUF-loaded models)
    tied = hf_model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_tokenizer.save_pretrained(out)
    lm = load_model(out)
    assert lm.path == out and lm.cache_dir is None and not lm.from_cache
    ours, theirs = lm.config.to_dict(), loaded_model.config.to_dict()
    for key in ("model_id", "revision"):
        ours.pop(key), theirs.pop(key)
    assert ours == theirs
    assert lm.config.model_id == "smollm2-hf" and len(lm.config.revision) == 16
    assert _same_weights(lm.model, loaded_model.model)


# ---- bad input ---------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path)


def test_hf_directory_with_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="model_type"):
        load_model(tmp_path)


def test_hf_directory_without_weights(tmp_path):
    config = {
        "model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64, "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="safetensors"):
        load_model(tmp_path)


def test_gguf_with_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_gguf_header(path)
    assert header.metadata["general.architecture"] == "gpt2" and header.tensors[0].shape == (4, 8)
    with pytest.raises(ConfigError, match="general.architecture"):
        load_model(path, cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match="general.architecture"):
        loader.load_config(path)


def test_gguf_header_matches_the_gguf_package(bundled_gguf):
    """Our header reader (kept because gguf.GGUFReader takes seconds on the bundled model)
    agrees with the gguf package on every metadata value and on the tensor table."""
    import gguf

    from pagedkv.gguf_header import GGUFStringArray
    from pagedkv.kv.spec import read_gguf_metadata

    ours, theirs = read_gguf_header(bundled_gguf), gguf.GGUFReader(bundled_gguf)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert sorted(ours.metadata) == sorted(fields)
    for key, value in fields.items():
        mine = ours.metadata[key]
        if isinstance(mine, GGUFStringArray):
            assert len(mine) == len(value), key
        elif isinstance(mine, np.ndarray):
            assert np.array_equal(mine, np.asarray(value)), key
        else:
            assert mine == value, key
    table = [(t.name, tuple(int(d) for d in reversed(t.shape)), int(t.tensor_type), int(t.data_offset))
             for t in theirs.tensors]
    assert [(t.name, t.shape, t.ggml_type, t.offset) for t in ours.tensors] == table
    assert read_gguf_metadata(bundled_gguf)["llama.block_count"] == 30


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ConfigError, match="GGUF"):
        load_model(path)


def test_truncated_gguf(tmp_path, bundled_gguf):
    path = tmp_path / "cut.gguf"
    with open(bundled_gguf, "rb") as src:
        path.write_bytes(src.read(40 << 20))
    with pytest.raises(ConfigError, match="past the end"):
        load_model(path, cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match="past the end"):
        load_model(path, weights="gguf", cache_dir=tmp_path / "cache")
    # no weight or tokenizer entry: only the file's identity (its sha256, hashed once) is kept
    left = sorted(p.relative_to(tmp_path / "cache").parts[0] for p in (tmp_path / "cache").rglob("*"))
    assert set(left) <= {"ids"}


def test_bad_dtype():
    with pytest.raises(ConfigError, match="dtype"):
        load_model(None, dtype=torch.int8)


def test_load_model_accepts_dtype_names(bundled_gguf):
    import torch

    from pagedkv.errors import ConfigError
    from pagedkv.model.loader import load_model

    lm = load_model(bundled_gguf, dtype="float32")
    assert next(lm.model.parameters()).dtype == torch.float32
    with pytest.raises(ConfigError, match="int8"):
        load_model(bundled_gguf, dtype="int8")


@pytest.mark.parametrize("align", [0, -32])
def test_a_gguf_alignment_that_is_not_positive_is_a_config_error(tmp_path, align):
    import gguf

    path = tmp_path / "align.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_key_value("general.alignment", align, gguf.GGUFValueType.INT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=f"general.alignment must be a positive integer, got {align}"):
        read_gguf_header(path)
