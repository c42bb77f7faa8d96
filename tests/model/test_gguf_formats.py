"""The explicit formats of a GGUF (``weights="fp32" | "bf16" | "int8" | "int4"`` and the model
dtype) stream tensor by tensor (``pagedkv.model.gguf_formats``):

* the streamed state equals, bit for bit, the whole-model conversion earlier versions loaded
  (every tensor dequantised to one fp32 state, ``weights.gguf_state_dict``, then
  ``quantize.quantize_state`` with int4 keeping stored Q4 codes, ``quantize.gguf_q4_codes``),
  for every GGML type, the families' conventions (Gemma's ``1 + w`` norms, Phi-3's fused
  tensors, Q/K biases) and chunks that cut tensors into many pieces;
* on the bundled model every layer's stored codes and scales, and the greedy tokens of three
  prompts, are those of the whole-model path, for int8, int4 and bf16;
* nothing but the tokenizer's entry and the file's identity is written, ``load_weights`` (the
  tensor-parallel workers' load) streams fp32 without a cache, and an int8 load's resident
  memory grows by its int8 state, one fp32 tensor and a constant at most (measured in a fresh
  process), where the whole-model path held the fp32 model besides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import read_gguf_header
from pagedkv.model import gguf_formats
from pagedkv.model.gguf_formats import stream_state
from pagedkv.model.loader import LoadedModel, build_model, load_model, load_weights
from pagedkv.model.quant import BF16Linear, Int4Linear, Int8Linear
from pagedkv.model.quantize import gguf_q4_codes, q4_code_names, quantize_state
from pagedkv.model.weights import gguf_config, gguf_state_dict

FORMATS = [None, "bf16", "int8", "int4"]


def _reference(path, fmt):
    """The whole-model conversion: (config, state) as earlier versions built it."""
    header = read_gguf_header(path)
    config = gguf_config(path, header, "test")
    state = gguf_state_dict(path, header, config)
    if fmt is not None:
        state = quantize_state(state, config, fmt, gguf_q4_codes(path, header, config) if fmt == "int4" else None)
    return header, config, state


def _assert_same_state(want: dict, got: dict) -> None:
    assert sorted(want) == sorted(got)
    for k in want:
        assert want[k].dtype == got[k].dtype and want[k].shape == got[k].shape, k
        assert torch.equal(want[k], got[k]), k


def _write_bias_gguf(path, arch: str) -> None:
    """The tiny Q4_0 model of ``test_gguf_types`` with q/k/v biases (F32): llama (Q/K rows and
    biases permuted) or qwen2 (kept)."""
    import gguf

    from tests.model.test_gguf_types import HIDDEN, _add_header, _linears

    rng = np.random.default_rng(5)
    w = gguf.GGUFWriter(str(path), arch)
    _add_header(w, arch)
    q4 = gguf.GGMLQuantizationType.Q4_0
    for name, rows, cols, std in _linears():
        norm = {"output.weight": "output_norm.weight"}.get(name) or (
            name.replace("attn_q", "attn_norm") if name.endswith("attn_q.weight") else
            name.replace("ffn_gate", "ffn_norm") if name.endswith("ffn_gate.weight") else None)
        if norm:
            w.add_tensor(norm, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        w.add_tensor(name, gguf.quants.quantize((rng.standard_normal((rows, cols)) * std).astype(np.float32), q4),
                     raw_dtype=q4)
        if name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
            w.add_tensor(name.replace(".weight", ".bias"), (0.1 * rng.standard_normal(rows)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _family_gguf(path, kind: str) -> None:
    from tests.model.test_families import _hf_config
    from tests.model.test_families_gguf import _write_gguf

    cfg, cls = _hf_config(kind)
    torch.manual_seed(0)
    _write_gguf(cls(cfg).eval(), kind, path)


SOURCES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
           "bias-llama", "bias-qwen2", "qwen3", "gemma2", "gemma3", "phi3"]


@pytest.fixture(scope="module")
def source_files(tmp_path_factory):
    from tests.model.test_gguf_types import write_tiny_gguf

    d = tmp_path_factory.mktemp("formats")
    files = {}
    for name in SOURCES:
        path = d / f"{name}.gguf"
        if name.startswith("bias-"):
            _write_bias_gguf(path, name.split("-")[1])
        elif name in ("qwen3", "gemma2", "gemma3", "phi3"):
            _family_gguf(path, name)
        else:
            write_tiny_gguf(path, name)
        files[name] = path
    return files


@pytest.mark.parametrize("source", SOURCES)
def test_the_streamed_state_equals_the_whole_model_conversion_bit_for_bit(source_files, source, monkeypatch):
    """Chunks of 1 KiB of float32 (a handful of rows, whole heads where Q/K are un-permuted)
    cut every matrix into many pieces; two threads convert at once."""
    path = source_files[source]
    monkeypatch.setattr(gguf_formats, "CHUNK_BYTES", 1024)
    for fmt in FORMATS:
        header, config, want = _reference(path, fmt)
        got, report = stream_state(path, header, config, fmt, torch.float32, threads=2)
        _assert_same_state(want, got)
        assert report.fmt == fmt and report.state_bytes == sum(t.numel() * t.element_size() for t in got.values())
        assert gguf_formats.state_bytes(header, config, fmt) == report.state_bytes  # known before reading
    if source in ("Q4_0", "Q4_1", "bias-llama"):  # int4 kept the stored codes of every layer matrix
        assert len(q4_code_names(header, config)) == 14 + 2  # 2 layers x 7, embedding and head
    if source == "bias-llama":
        assert "layers.0.qkv_proj.bias" in got and got["layers.0.qkv_proj.bias"].dtype == torch.float32


def test_the_model_dtype_streams_in_that_dtype(source_files):
    """``fmt=None`` with a 16-bit dtype: every tensor converted as it is read (the whole-model
    path's ``.to(dtype)`` of each fp32 tensor), no fp32 copy; ``load_model`` then keeps plain
    ``nn.Linear`` layers as before (not ``BF16Linear``)."""
    path = source_files["Q4_K"]
    header, config, want = _reference(path, None)
    got, _ = stream_state(path, header, config, None, torch.bfloat16)
    _assert_same_state({k: v.to(torch.bfloat16) for k, v in want.items()}, got)
    lm = load_model(path, dtype="bfloat16", use_cache=False)
    assert type(lm.model.layers[0].qkv_proj) is torch.nn.Linear
    assert lm.model.layers[0].qkv_proj.weight.dtype == torch.bfloat16


def test_bad_formats_and_truncated_files_are_config_errors(source_files, tmp_path):
    path = source_files["Q8_0"]
    header = read_gguf_header(path)
    config = gguf_config(path, header, "test")
    with pytest.raises(ConfigError, match="cannot stream a GGUF into 'int2'"):
        stream_state(path, header, config, "int2")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 5000])
    with pytest.raises(ConfigError, match=r"output\.weight extends past the end"):
        stream_state(cut, read_gguf_header(cut), config, "int8")


def test_a_model_whose_format_cannot_fit_is_refused_before_reading(source_files, monkeypatch, tmp_path):
    path = source_files["Q8_0"]
    header = read_gguf_header(path)
    need = gguf_formats.state_bytes(header, gguf_config(path, header, "x"), "int8")
    assert need == 260 * (256 + 4) + 260 * 256 * 4 + 5 * 256 * 4 + 2 * (  # head int8, embedding, norms
        (256 + 2 * 128) * (256 + 4) + 256 * (256 + 4) + 2 * 512 * (256 + 4) + 256 * (512 + 4))  # 2 layers int8
    monkeypatch.setattr(gguf_formats, "stream_state", lambda *a, **k: pytest.fail("read the weights"))
    with pytest.raises(ConfigError, match=r"not enough memory: Q8_0\.gguf's weights as int8 \(0\.00 GiB, .*"
                                          r"and the KV cache \(4096\.00 GiB\)"):
        load_model(path, weights="int8", cache_dir=tmp_path, kv_bytes=4096 << 30)


# ---- the bundled model -------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
_KIND = {"int8": Int8Linear, "int4": Int4Linear, "bf16": BF16Linear}


def _greedy(lm: LoadedModel) -> list[list[int]]:
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.request import SamplingParams

    outs = LLM(lm, num_blocks=64).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                           use_tqdm=False)
    return [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def bundled_fp32_state(bundled_gguf):
    header = read_gguf_header(bundled_gguf)
    config = gguf_config(bundled_gguf, header, "x")
    return header, config, gguf_state_dict(bundled_gguf, header, config)


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
def test_bundled_formats_equal_the_whole_model_path_and_its_greedy_tokens(bundled_gguf, bundled_fp32_state, fmt):
    header, config, fp32 = bundled_fp32_state
    codes = gguf_q4_codes(bundled_gguf, header, config) if fmt == "int4" else None
    lm = load_model(bundled_gguf, weights=fmt)  # the tokenizer from the default root's entry
    old = LoadedModel(model=build_model(lm.config, quantize_state(fp32, config, fmt, codes)), config=lm.config,
                      tokenizer=lm.tokenizer, path=bundled_gguf, weights=fmt)
    for name, module in old.model.named_modules():  # every layer of the same kind ...
        assert type(lm.model.get_submodule(name)) is type(module), name
    _assert_same_state(old.model.state_dict(), lm.model.state_dict())  # ... its codes and scales bit for bit
    assert isinstance(lm.model.layers[17].gate_up_proj, _KIND[fmt])
    assert isinstance(lm.model.lm_head, Int8Linear if fmt != "bf16" else BF16Linear)  # the Q8_0 tied head
    tokens = _greedy(lm)
    assert all(len(t) == 16 for t in tokens)
    assert tokens == _greedy(old)


@pytest.mark.slow
def test_load_weights_streams_fp32_and_writes_no_weight_cache(bundled_gguf, bundled_fp32_state, tmp_path):
    """What a tensor-parallel worker loads: the fp32 state in our names, equal to the whole-model
    one, with only the file's identity written under the cache root."""
    _header, config, fp32 = bundled_fp32_state
    got_config, state, path = load_weights(bundled_gguf, cache_dir=tmp_path)
    assert path == bundled_gguf and got_config.num_layers == config.num_layers == 30
    _assert_same_state(fp32, state)
    assert [p.name for p in tmp_path.iterdir()] == ["ids"]


_RSS_CHILD = textwrap.dedent("""
    import json, pathlib, sys, torch
    from pagedkv.gguf_header import read_gguf_header
    from pagedkv.model import gguf_formats
    from pagedkv.model.loader import build_model, load_config
    from pagedkv.model.llama import LlamaForCausalLM
    path = pathlib.Path(sys.argv[1])
    header, config = read_gguf_header(path), load_config(path)
    LlamaForCausalLM(config, materialize=False)  # torch's first-use set-up (RoPE tables' ops): a constant
    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    base = rss("VmRSS:")
    state, report = gguf_formats.stream_state(path, header, config, "int8")
    net = build_model(config, state, route="fallback")  # no kernel buffers: the model holds the state
    del state
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in net.state_dict().values()}
    print(json.dumps({"base": base, "peak": rss("VmHWM:"), "held": sum(held.values()),
                      "state": report.state_bytes}))
""")


def test_an_int8_load_grows_resident_memory_by_its_int8_state_and_one_fp32_tensor_at_most(bundled_gguf,
                                                                                           bundled_fp32_state):
    """Measured in a fresh process: VmHWM after streaming and building the int8 model less VmRSS
    before (imports, header and config read, torch's ops used once: constants). The bound is the
    int8 state (int8 layers, the int8 tied head, the fp32 embedding and norms), the largest
    tensor in fp32 and 64 MiB; the whole-model path held the fp32 model (0.54 GB) besides."""
    _header, _config, fp32 = bundled_fp32_state
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(bundled_gguf)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    fp32_bytes = sum(t.numel() * 4 for t in fp32.values())
    largest = max(t.numel() * 4 for t in fp32.values())
    assert largest == 49152 * 576 * 4  # the embedding
    assert r["held"] == r["state"]
    bound = r["state"] + largest + (64 << 20)
    assert bound < fp32_bytes + r["state"]  # the whole-model path's floor is above the bound
    assert r["peak"] - r["base"] <= bound, {**r, "bound": bound, "growth": r["peak"] - r["base"]}
