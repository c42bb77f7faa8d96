"""The fast tokenizer of a weight-cache tokenizer entry (``pagedkv.model.fast_tokenizer``): it
answers as transformers' tokenizer of the same directory, it is used only where a recorded
check says so (a damaged or changed entry goes back to transformers), it hands everything else
to transformers' tokenizer built on first use; and the GGUF header helpers a warm start uses
without the ``gguf`` package agree with it."""

from __future__ import annotations

import json
import os
import pickle
import sys

import numpy as np
import pytest

from pagedkv.model import weight_cache
from pagedkv.model.fast_tokenizer import (BACKEND, MARKER, FastTokenizer, check_agreement, open_fast, read_marker,
                                          write_marker)

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]


def _hf_tokenizer(post_bos: bool = True):
    """A byte-level BPE tokenizer (trained here, ~300 merges) as transformers' generic fast
    tokenizer, with a chat template and, if ``post_bos``, a post-processor adding ``<s>``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ["The quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x * 2\n",
              "Paged attention keeps the KV cache in fixed-size blocks; 12345 67890.", "Déjà vu, naïve café 中文"]
    tk.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if post_bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", tk.token_to_id("<s>"))])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="</s>", chat_template=CHAT)


@pytest.fixture(scope="module")
def hf_tok():
    return _hf_tokenizer()


@pytest.fixture
def saved(tmp_path, hf_tok):
    d = tmp_path / "tok"
    hf_tok.save_pretrained(str(d))
    return d


def test_answers_as_transformers_does(hf_tok, saved):
    fast = FastTokenizer(saved)
    assert check_agreement(hf_tok, fast) is None
    bos, eos = hf_tok.convert_tokens_to_ids("<s>"), hf_tok.convert_tokens_to_ids("</s>")
    assert (fast.bos_token, fast.bos_token_id, fast.eos_token, fast.eos_token_id) == ("<s>", bos, "</s>", eos)
    assert (fast.pad_token_id, fast.unk_token_id) == (eos, hf_tok.unk_token_id) and bos == 0 and eos == 1
    text = "The lazy dog<|im_end|> café"
    ids = fast(text)["input_ids"]
    assert ids == list(hf_tok(text)["input_ids"]) and ids[0] == bos
    assert fast(text, add_special_tokens=False)["input_ids"] == ids[1:]
    assert fast(text)["attention_mask"] == [1] * len(ids)
    assert hf_tok.convert_tokens_to_ids("<|im_end|>") in ids
    assert fast.decode(ids) == "<s>" + text and fast.decode(ids, skip_special_tokens=True) == "The lazy dog café"
    assert fast.decode(np.array(ids)) == fast.decode(ids) and fast.decode(ids[1]) == hf_tok.decode(ids[1])
    assert fast.encode(text) == ids and fast([text, "dog"])["input_ids"] == [ids, hf_tok("dog")["input_ids"]]
    assert fast.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    assert fast.convert_ids_to_tokens(bos) == "<s>" and fast.convert_tokens_to_ids(["</s>"]) == [eos]
    assert fast.get_added_vocab() == hf_tok.get_added_vocab() == {t: i for i, t in enumerate(SPECIAL)}
    assert len(fast) == len(hf_tok) and fast.vocab_size == hf_tok.vocab_size == 375
    assert fast.chat_template == CHAT and fast.backend_tokenizer.token_to_id("<|im_start|>") == 3


def test_the_calls_people_make_answer_as_transformers_does(hf_tok, saved):
    """Unknown pieces, nested and flat batches, text pairs, the private backend name, copies."""
    import copy

    fast = FastTokenizer(saved)
    assert fast.convert_tokens_to_ids("<|no such token|>") == hf_tok.convert_tokens_to_ids("<|no such token|>") == 2
    assert fast.convert_tokens_to_ids(["dog", "<|x|>"]) == hf_tok.convert_tokens_to_ids(["dog", "<|x|>"])
    nested = [[5, 6], [7]]
    assert fast.decode(nested) == hf_tok.decode(nested) == [hf_tok.decode([5, 6]), hf_tok.decode([7])]
    assert fast.batch_decode([5, 6]) == hf_tok.batch_decode([5, 6]) == [hf_tok.decode([5, 6])]
    assert fast.batch_decode(nested) == hf_tok.batch_decode(nested)
    assert fast._hf is None  # none of these needed transformers
    assert fast._tokenizer is fast.backend_tokenizer
    shallow = copy.copy(fast)
    assert isinstance(shallow, FastTokenizer) and shallow is not fast and shallow("dog")["input_ids"] == fast("dog")["input_ids"]
    assert fast.encode("a b", "c") == hf_tok.encode("a b", "c")  # a pair goes to transformers
    assert fast("a b", "c")["input_ids"] == hf_tok("a b", "c")["input_ids"]


def test_writers_racing_on_one_entry_never_record_a_false_verdict(tmp_path, hf_tok):
    """Two starts of one model record the same entry at once: each writes its own temp files,
    so neither reads the other's half-written backend (which once recorded "differs" for good)."""
    import threading

    entry, _sha = _entry(tmp_path, hf_tok)
    results = []

    def record() -> None:
        for _ in range(5):
            results.append(weight_cache.record_fast_tokenizer(entry, hf_tok))

    threads = [threading.Thread(target=record) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 15 and read_marker(entry, entry / "tokenizer") is True
    assert sorted(p.name for p in entry.iterdir() if p.name.startswith(".")) == []  # no temp file left


def test_everything_else_goes_to_transformers_built_on_first_use(hf_tok, saved):
    fast = FastTokenizer(saved)
    assert fast._hf is None  # not built by the hot path
    fast("warm up")
    fast.decode([5, 6])
    assert fast._hf is None
    msgs = [{"role": "user", "content": "hi"}]
    ours = fast.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    assert fast._hf is not None and type(fast.hf).__name__ == type(hf_tok).__name__
    ids = ours["input_ids"] if hasattr(ours, "keys") else ours
    assert list(ids) == list(hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert fast.all_special_ids == hf_tok.all_special_ids
    assert fast("a b", padding="max_length", max_length=6)["input_ids"] == hf_tok("a b", padding="max_length",
                                                                                  max_length=6)["input_ids"]
    copy = pickle.loads(pickle.dumps(fast))  # Ray ships it to the ingress as transformers' tokenizer
    assert type(copy) is type(fast.hf) and copy("a b")["input_ids"] == fast("a b")["input_ids"]
    with pytest.raises(AttributeError):
        fast._no_such_field


def test_a_difference_is_found_and_recorded(tmp_path, hf_tok, saved):
    """A backend that differs from transformers' (here: without the BOS post-processor) fails
    the check, with the first difference named; the entry keeps transformers' tokenizer."""
    other = _hf_tokenizer(post_bos=False)
    why = check_agreement(hf_tok, _fast_of(tmp_path, other))
    assert why is not None and why.startswith("encoding") and "add_special_tokens=True" in why
    entry = tmp_path / "entry"
    entry.mkdir()
    assert write_marker(entry, _Lying(hf_tok, other), saved) is False
    rec = json.loads((entry / MARKER).read_text())
    assert rec["agrees"] is False and rec["why"].startswith("encoding")
    assert read_marker(entry, saved) is False


class _Lying:
    """A transformers tokenizer whose backend is another tokenizer's (what a class that
    re-processes text in Python looks like to the check)."""

    def __init__(self, hf, backend_of):
        self._hf, self.backend_tokenizer = hf, backend_of.backend_tokenizer

    def __getattr__(self, name):
        return getattr(self._hf, name)

    def __call__(self, *a, **k):
        return self._hf(*a, **k)

    def __len__(self):
        return len(self._hf)


def _fast_of(tmp_path, hf):
    d = tmp_path / "other"
    hf.save_pretrained(str(d))
    return FastTokenizer(d)


def _entry(tmp_path, hf):
    """A weight-cache tokenizer entry of ``hf`` (as a first load writes it), its sha."""
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    sha = "ab" * 32
    entry = tmp_path / "cache" / f"{sha[:16]}-tokenizer"
    weight_cache.write_cache_entry(entry, sha, src, None, {}, hf, weights="tokenizer")
    return entry, sha


def test_an_entry_reads_as_the_fast_tokenizer_once_recorded(tmp_path, hf_tok):
    entry, sha = _entry(tmp_path, hf_tok)
    assert not (entry / MARKER).exists()
    first = weight_cache.read_tokenizer_entry(entry, sha)  # no record yet: transformers', and it records
    assert not isinstance(first, FastTokenizer) and type(first).__name__ == type(hf_tok).__name__
    rec = json.loads((entry / MARKER).read_text())
    assert rec["agrees"] is True and rec["why"] is None and rec["version"] == 2
    assert rec["transformers"] == "5.24.0" and rec["tokenizers"]
    assert sorted(rec["crc32"]) == sorted([BACKEND, "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                                           "tokenizer/chat_template.jinja"])
    second = weight_cache.read_tokenizer_entry(entry, sha)
    assert isinstance(second, FastTokenizer) and second("dog fox")["input_ids"] == list(hf_tok("dog fox")["input_ids"])
    assert weight_cache.record_fast_tokenizer(entry, hf_tok) is True


@pytest.mark.parametrize("damage", ["config_changed", "backend_bit_rot", "marker_garbage", "marker_other_version",
                                    "other_transformers", "said_no"])
def test_a_changed_or_damaged_record_goes_back_to_transformers(tmp_path, hf_tok, damage):
    entry, sha = _entry(tmp_path, hf_tok)
    weight_cache.record_fast_tokenizer(entry, hf_tok)
    assert isinstance(weight_cache.read_tokenizer_entry(entry, sha), FastTokenizer)
    rec = json.loads((entry / MARKER).read_text())
    if damage == "config_changed":  # the same size, other bytes: the manifest's sizes cannot see it
        cfg = entry / "tokenizer" / "tokenizer_config.json"
        data = cfg.read_bytes()
        cfg.write_bytes(data.replace(b'"</s>"', b'"<s>"X', 1) if b'"</s>"' in data else data[:-1] + b" ")
        assert len(cfg.read_bytes()) == len(data)
    elif damage == "backend_bit_rot":
        data = (entry / BACKEND).read_bytes()
        (entry / BACKEND).write_bytes(data[:100] + b"\x00" + data[101:])
    elif damage == "marker_garbage":
        (entry / MARKER).write_text("{not json")
    elif damage == "marker_other_version":
        (entry / MARKER).write_text(json.dumps({**rec, "version": 0}))
    elif damage == "other_transformers":  # its classes set up the recorded backend
        (entry / MARKER).write_text(json.dumps({**rec, "transformers": "5.23.0"}))
    else:
        (entry / MARKER).write_text(json.dumps({**rec, "agrees": False}))
    assert read_marker(entry, entry / "tokenizer") is (False if damage == "said_no" else None)
    if damage == "config_changed":  # transformers cannot read the changed file (the loader then rebuilds the entry)
        with pytest.raises(Exception):
            weight_cache.read_tokenizer_entry(entry, sha).decode([0])
        return
    tok = weight_cache.read_tokenizer_entry(entry, sha)
    assert not isinstance(tok, FastTokenizer) and tok("dog")["input_ids"] == list(hf_tok("dog")["input_ids"])
    if damage != "said_no":  # re-checked and recorded again: the next read is fast
        assert isinstance(weight_cache.read_tokenizer_entry(entry, sha), FastTokenizer)
        assert isinstance(open_fast(entry, entry / "tokenizer"), FastTokenizer)


def test_ggml_types_table_is_the_gguf_packages(tmp_path):
    import gguf

    from pagedkv.gguf_header import GGML_TYPES, GGUFTensorInfo
    from pagedkv.model.gguf_read import qtype_name, stored_bytes, tensor_rows

    assert len(GGML_TYPES) == 32
    for tid, (name, block, size) in GGML_TYPES.items():
        qt = gguf.GGMLQuantizationType(tid)
        assert (qt.name, gguf.GGML_QUANT_SIZES[qt]) == (name, (block, size))
        info = GGUFTensorInfo(name="t", shape=(3, 4 * block), ggml_type=tid, offset=0)
        assert qtype_name(info) == name and stored_bytes(info) == 12 * size and tensor_rows(info) == (3, 4 * size)
    newer = [int(t) for t in gguf.GGMLQuantizationType if int(t) not in GGML_TYPES]
    for tid in newer:  # types newer than the table still resolve, through gguf
        assert qtype_name(GGUFTensorInfo(name="t", shape=(1, 256), ggml_type=tid, offset=0)) == \
            gguf.GGMLQuantizationType(tid).name


@pytest.mark.parametrize("tid,dtype", [(0, np.float32), (1, np.float16)])
def test_f32_f16_rows_are_gguf_dequantize_without_it(tid, dtype):
    import gguf

    from pagedkv.gguf_header import GGUFTensorInfo
    from pagedkv.model.gguf_read import dequantize_rows

    values = (np.arange(24, dtype=np.float32) / 7 - 1.5).astype(dtype).reshape(3, 8)
    raw = np.frombuffer(values.tobytes(), dtype=np.uint8).reshape(3, -1)
    ours = dequantize_rows(GGUFTensorInfo(name="t", shape=(3, 8), ggml_type=tid, offset=0), raw)
    ref = gguf.dequantize(raw, gguf.GGMLQuantizationType(tid))
    assert ours.dtype.itemsize == 4 and ours.shape == (3, 8) and np.array_equal(ours.numpy(), ref)


def test_a_header_read_with_reuse_is_parsed_once_per_file_version(tmp_path, monkeypatch):
    import gguf

    from pagedkv import gguf_header

    path = tmp_path / "m.gguf"

    def write(n: int) -> None:
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_uint32("test.n", n)
        w.add_tensor("w", np.zeros((2, n), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(4)
    a = gguf_header.read_gguf_header(path, reuse=True)
    assert gguf_header.read_gguf_header(path, reuse=True) is a
    assert gguf_header.read_gguf_header(path) is not a  # without reuse: parsed again
    path.unlink()
    write(8)  # another file at the same path
    b = gguf_header.read_gguf_header(path, reuse=True)
    assert b is not a and b.metadata["test.n"] == 8 and a.metadata["test.n"] == 4
    monkeypatch.setattr(gguf_header, "REUSE_S", 0.0)
    assert gguf_header.read_gguf_header(path, reuse=True) is not b  # too old


@pytest.mark.slow
def test_a_warm_start_of_the_bundled_model_imports_no_transformers(bundled_gguf, loaded_model, tmp_path):
    """A fresh process on a cache holding the bundled model's recorded entry: its tokenizer is
    the fast one, ``transformers`` is not imported by loading or generating from a prompt, and
    its tokens and text are those of the transformers tokenizer; a chat call then builds
    transformers' tokenizer and renders the template as it does."""
    import shutil
    import subprocess

    from pagedkv.bench.models.run import seed_kernels

    assert loaded_model.cache_dir is not None, "the tokenizer entry could not be written"
    root = tmp_path / "cache"
    shutil.copytree(loaded_model.cache_dir, root / loaded_model.cache_dir.name)
    hf = getattr(loaded_model.tokenizer, "hf", loaded_model.tokenizer)
    assert weight_cache.record_fast_tokenizer(root / loaded_model.cache_dir.name, hf) is True
    seed_kernels(root)  # the compiled C kernels, linked: no compilation in the child
    code = f"""
import json, sys
from pagedkv import LLM, SamplingParams
from pagedkv.model.fast_tokenizer import FastTokenizer
llm = LLM(model={str(bundled_gguf)!r}, max_model_len=256, kv_cache_memory="64MiB")
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))[0]
rec = dict(fast=isinstance(llm.tokenizer, FastTokenizer), hf=("transformers" in sys.modules),
           prompt=out.prompt_token_ids, ids=out.outputs[0].token_ids, text=out.outputs[0].text)
chat = llm.chat([{{"role": "user", "content": "Hi"}}], SamplingParams(max_tokens=1, temperature=0))[0]
rec.update(chat_prompt=chat.prompt_token_ids, hf_after_chat=("transformers" in sys.modules))
print(json.dumps(rec))
"""
    env = {**os.environ, "PAGEDKV_CACHE_DIR": str(root)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    assert rec["fast"] is True and rec["hf"] is False and rec["hf_after_chat"] is True
    assert rec["prompt"] == list(hf("The capital of France is")["input_ids"])
    assert rec["text"] == hf.decode(rec["ids"]) and len(rec["ids"]) == 6
    want = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert rec["chat_prompt"] == list(want)


def test_structured_outputs_get_the_transformers_tokenizer(hf_tok, saved):
    """llguidance reads a transformers tokenizer: the grammar compiler hands it the fast
    tokenizer's (built on first use), with the same vocabulary and tokens."""
    from pagedkv.engine.structured import GrammarCompiler

    fast = FastTokenizer(saved)
    lltok = GrammarCompiler(fast, len(fast), [fast.eos_token_id])._tokenizer()
    assert fast._hf is not None and lltok.vocab_size == 375 and lltok.eos_token == 1
    assert lltok.tokenize_str("dog fox") == fast("dog fox", add_special_tokens=False)["input_ids"]


# ---- the first load's tokenizer: AutoTokenizer's class picked on a stand-in file -------------------
def test_the_stand_in_keeps_the_metadata_with_arrays_cut(tmp_path):
    import gguf

    from pagedkv.gguf_header import read_gguf_header
    from pagedkv.model.tokenizer import gguf_stand_in
    from tests.model.test_gguf_types import _vocab, write_tiny_gguf

    src, dst = tmp_path / "m.gguf", tmp_path / "s.gguf"
    write_tiny_gguf(src, "Q8_0")
    gguf_stand_in(src, dst, keep=20)
    a, b = read_gguf_header(src), read_gguf_header(dst)
    assert list(a.metadata) == list(b.metadata) and dst.stat().st_size < 8192 < src.stat().st_size
    assert len(a.metadata["tokenizer.ggml.tokens"]) == len(_vocab()) == 260
    assert b.metadata["tokenizer.ggml.tokens"] == _vocab()[:20]
    assert b.metadata["tokenizer.ggml.token_type"] == list(a.metadata["tokenizer.ggml.token_type"][:20]) == [1] * 20
    assert a.metadata["tokenizer.ggml.merges"] == ["h i"] and b.metadata["tokenizer.ggml.merges"] == []
    scalars = [k for k, v in a.metadata.items() if isinstance(v, (int, float, str))]
    assert len(scalars) > 10 and all(a.metadata[k] == b.metadata[k] for k in scalars)
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors] and len(a.tensors) > 5
    assert all(t.shape == (1,) and t.ggml_type == 0 for t in b.tensors)
    reader = gguf.GGUFReader(str(dst))  # what transformers reads it with
    assert len(reader.tensors) == len(a.tensors) and reader.fields["tokenizer.ggml.tokens"].data[:1]
    default = tmp_path / "d.gguf"
    gguf_stand_in(src, default)  # default: up to the highest special id (259 of 260) + 1, at least 16
    assert len(read_gguf_header(default).metadata["tokenizer.ggml.tokens"]) == 260


def _same_tokenizer(a, b, tmp_path) -> None:
    assert type(a) is type(b) and a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert a.init_kwargs == b.init_kwargs
    a.save_pretrained(str(tmp_path / "a"))
    b.save_pretrained(str(tmp_path / "b"))
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir()) and "tokenizer.json" in files
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)


@pytest.mark.parametrize("arch,cls", [("llama", "TokenizersBackend"), ("qwen2", "Qwen2Tokenizer"),
                                      ("qwen3", "Qwen2Tokenizer")])
def test_the_first_load_builds_auto_tokenizers_tokenizer(tmp_path, arch, cls):
    import transformers

    from pagedkv.model.tokenizer import _gguf_tokenizer_by_class, load_tokenizer
    from tests.model.test_gguf_types import write_tiny_gguf

    write_tiny_gguf(tmp_path / "m.gguf", "F16", arch=arch)
    ours = _gguf_tokenizer_by_class(tmp_path, "m.gguf")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    assert type(auto).__name__ == cls
    _same_tokenizer(ours, auto, tmp_path)
    assert type(load_tokenizer(tmp_path, gguf_file="m.gguf")) is type(auto)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".gguf"] == ["m.gguf"]  # the stand-in is gone


def test_a_stand_in_that_fails_leaves_it_to_auto_tokenizer(tmp_path, monkeypatch):
    from pagedkv.model import tokenizer as tok_mod
    from tests.model.test_gguf_types import write_tiny_gguf

    write_tiny_gguf(tmp_path / "m.gguf", "F16")
    monkeypatch.setattr(tok_mod, "gguf_stand_in", lambda src, dst, keep=None: dst.write_bytes(b"GGUF broken"))
    assert tok_mod._gguf_tokenizer_by_class(tmp_path, "m.gguf") is None
    assert type(tok_mod.load_tokenizer(tmp_path, gguf_file="m.gguf")).__name__ == "TokenizersBackend"


@pytest.mark.slow
def test_the_bundled_models_first_load_tokenizer_is_auto_tokenizers(bundled_gguf, hf_tokenizer, tmp_path):
    from pagedkv.model.tokenizer import _gguf_tokenizer_by_class

    _same_tokenizer(_gguf_tokenizer_by_class(bundled_gguf.parent, bundled_gguf.name), hf_tokenizer, tmp_path)


@pytest.mark.parametrize("tid", [0, 1, 8, 30])
def test_direct_rows_equal_gguf_dequantize(tid):
    """F32, F16, Q8_0 and BF16 rows (the embedding types of common GGUFs) read without ``gguf``:
    the same float32 values bit for bit, for random codes and scales of every sign and size
    (Q8_0's fp16 scales include subnormals, zero and negative zero)."""
    import gguf

    from pagedkv.model.gguf_read import direct_rows

    rng = np.random.default_rng(tid)
    qt = gguf.GGMLQuantizationType(tid)
    block, size = gguf.GGML_QUANT_SIZES[qt]
    cols = 4 * 32
    raw = rng.integers(0, 256, size=(5, cols // block * size), dtype=np.uint8)
    if tid == 8:  # finite fp16 scales: random finite values, then a subnormal, 0 and -0
        d = (rng.standard_normal((5, cols // 32)) * 10.0 ** rng.integers(-7, 4, size=(5, cols // 32))).astype(np.float16)
        d[0, :3] = np.array([6e-8, 0.0, -0.0], dtype=np.float16)
        raw.reshape(5, -1, 34)[:, :, :2] = d.view(np.uint8).reshape(5, -1, 2)
    elif tid in (1, 30):  # no NaN / inf bit patterns (NaN payloads need not survive a cast)
        v = raw.view(np.uint16)
        v &= 0xBBFF  # clears an exponent bit of both formats: finite
    else:
        raw = rng.standard_normal((5, cols)).astype(np.float32).view(np.uint8)
    ours = direct_rows(tid, raw)
    ref = gguf.dequantize(raw, qt).reshape(5, cols)
    assert ours.dtype == np.float32 and ours.shape == (5, cols)
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    assert direct_rows(2, raw) is None  # Q4_0: through gguf
