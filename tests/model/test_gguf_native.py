"""``weights="gguf"`` (what ``auto`` picks for a GGUF): the streaming loader keeps every weight
matrix in its stored blocks, fused and un-permuted exactly like the fp32 path's values, holds
no other copy, writes no fp32 weight cache (only the packed matrices, mapped back by the next
load: ``test_packed_cache``), checks memory before loading, and ``auto`` never
changes a model's numbers (an fp32 HF checkpoint stays fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import read_gguf_header
from pagedkv.model import gguf_native, loader, weight_cache
from pagedkv.ops import qmm
from pagedkv.model.gguf_native import GGUFEmbedding, GGUFLinear
from pagedkv.model.loader import load_model
from pagedkv.model.quantize import linear_prefixes
from pagedkv.testing.caches import allocate_kv_caches


def _stored_bytes(header, names) -> int:
    return sum(gguf_native._nbytes(t) for t in header.tensors if t.name in names)


@pytest.fixture(scope="module")
def smol_gguf(bundled_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-cache")
    return load_model(bundled_gguf, weights="gguf", cache_dir=root), root


def test_every_matrix_keeps_its_stored_blocks_and_equals_the_fp32_values(smol_gguf, loaded_model, bundled_gguf):
    lm, _root = smol_gguf
    assert lm.weights == "gguf" and lm.config.tie_word_embeddings
    ref = loaded_model.model.state_dict()  # the fp32 path: gguf.dequantize, un-permuted, fused
    for prefix in linear_prefixes(lm.config):
        m = lm.model.get_submodule(prefix[:-1])
        assert isinstance(m, GGUFLinear) and m.qmm_rows == qmm.ALL_ROWS
        want = ref.get(prefix + "weight", ref["embed_tokens.weight"] if prefix == "lm_head." else None)
        torch.testing.assert_close(m.dequantize(), want, rtol=0, atol=1e-6)
    header = read_gguf_header(bundled_gguf)
    # 210 Q4_1 layer matrices + the tied Q8_0 head (49152 rows of 576 values: 18 blocks of 34 bytes)
    assert lm.model.layers[0].qkv_proj.types == ("Q4_1", "Q4_1", "Q4_1")
    assert lm.model.lm_head.types == ("Q8_0",) and lm.model.lm_head.packed.nbytes == 49152 * 18 * 34
    layer_names = {t.name for t in header.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    assert len(layer_names) == 210
    packed = sum(m.packed.nbytes for m in gguf_native.iter_linears(lm.model))
    assert packed == _stored_bytes(header, layer_names) + 49152 * 18 * 34
    assert isinstance(lm.model.embed_tokens, GGUFEmbedding)
    ids = torch.tensor([0, 1, 2, 504, 49151])
    torch.testing.assert_close(lm.model.embed_tokens(ids), ref["embed_tokens.weight"][ids], rtol=0, atol=0)
    with pytest.raises(IndexError):
        lm.model.embed_tokens(torch.tensor([49152]))


def test_norms_and_the_first_step_agree_with_the_fp32_model(smol_gguf, loaded_model):
    lm, _ = smol_gguf
    ref = loaded_model.model.state_dict()
    got = {k: v for k, v in lm.model.named_parameters()}
    assert set(got) == {k for k in ref if "norm" in k}
    for k, v in got.items():
        assert torch.equal(v, ref[k])


def test_no_weight_cache_only_the_tokenizer_the_identity_and_the_packed_matrices(smol_gguf, bundled_gguf):
    from pagedkv.model import packed_cache

    lm, root = smol_gguf
    packed_cache.wait_for_writes()
    assert lm.cache_dir is not None and lm.cache_dir.name.endswith("-tokenizer")
    files = [p for p in root.rglob("*") if p.is_file()]
    assert not [p for p in files if p.name == "model.safetensors" and p.stat().st_size > 1024]
    packed = [p for p in files if p.parent.name == "packed"]
    assert sorted(p.suffix for p in packed) == [".bin", ".json"]
    total = sum(p.stat().st_size for p in files if p not in packed)
    assert total < 0.1 * bundled_gguf.stat().st_size  # the tokenizer's files and a few JSON
    # the matrices as the kernels read them: the file's matrix bytes (the embedding is the tied head)
    held = sum(m.packed.nbytes for m in gguf_native.iter_linears(lm.model))
    (bin_,) = [p for p in packed if p.suffix == ".bin"]
    assert held <= bin_.stat().st_size <= 1.01 * held
    assert held <= 1.0 * bundled_gguf.stat().st_size
    ids = list((root / "ids").glob("*.json"))
    assert len(ids) == 1 and json.loads(ids[0].read_text())["sha256"] == weight_cache.file_sha256(bundled_gguf)
    again = load_model(bundled_gguf, weights="gguf", cache_dir=root)
    assert again.from_cache and again.config.revision == lm.config.revision == json.loads(
        ids[0].read_text())["sha256"][:16]


def test_the_identity_is_hashed_once_and_again_when_the_file_changes(tmp_path, monkeypatch):
    f = tmp_path / "m.bin"
    f.write_bytes(b"x" * 100_000)
    sha = weight_cache.file_identity(f, tmp_path)
    assert sha == weight_cache.file_sha256(f)
    monkeypatch.setattr(weight_cache, "file_sha256", lambda p: pytest.fail("hashed twice"))
    assert weight_cache.file_identity(f, tmp_path) == sha
    monkeypatch.undo()
    f.write_bytes(b"y" * 100_000)
    os.utime(f, ns=(1, 1))
    assert weight_cache.file_identity(f, tmp_path) == weight_cache.file_sha256(f) != sha


def test_a_model_that_cannot_fit_is_refused_before_loading(bundled_gguf, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"not enough memory: .* need 2\.00 GiB, this host has 1\.00 GiB"):
        loader.check_memory(2 << 30, "weights", available=1 << 30)
    loader.check_memory(1 << 30, "weights", available=2 << 30)
    monkeypatch.setattr(gguf_native, "build_gguf_model", lambda *a, **k: pytest.fail("read the weights"))
    with pytest.raises(ConfigError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf's weights \(0\.\d\d GiB as stored\) "
                                          r"and the KV cache \(4096\.00 GiB\)"):
        load_model(bundled_gguf, weights="gguf", cache_dir=tmp_path, kv_bytes=4096 << 30)


def test_a_pool_given_in_blocks_counts_in_the_memory_check(bundled_gguf, monkeypatch):
    """``num_blocks=`` sizes the KV cache as surely as ``kv_cache_memory``: its bytes (from the
    header: 30 layers x K and V x 3 KV heads x 64 x 4 bytes x 16 tokens = 737,280 B a block)
    join the weights in the check before loading, so a pool the host cannot hold is refused
    with the numbers instead of an OOM kill when its pages fill."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.engine import LLMEngine, pool_bytes

    cfg = EngineConfig.from_kwargs({"num_blocks": 10, "block_size": 16})
    assert pool_bytes(bundled_gguf, cfg, torch.float32) == 10 * 737_280 == pool_bytes(None, cfg, torch.float32)
    int8 = EngineConfig.from_kwargs({"num_blocks": 10, "block_size": 16, "kv_cache_dtype": "int8",
                                     "kv_quant_group_size": 64})
    assert pool_bytes(bundled_gguf, int8, torch.float32) < 10 * 737_280 // 3  # 1-byte codes plus scales
    assert pool_bytes(object(), cfg, torch.float32) == 0  # a loaded model: nothing to check before loading
    assert pool_bytes("/nonexistent.gguf", cfg, torch.float32) == 0  # the loader's own error comes later
    monkeypatch.setattr(gguf_native, "build_gguf_model", lambda *a, **k: pytest.fail("read the weights"))
    blocks = (4096 << 30) // 737_280
    with pytest.raises(ConfigError, match=r"not enough memory: .*and the KV cache \(40\d\d\.\d\d GiB\)"):
        LLMEngine(bundled_gguf, num_blocks=blocks, block_size=16)


def test_auto_keeps_a_gguf_s_blocks_and_explicit_formats_stay_available(bundled_gguf, gemma3_gguf):
    fmt, why = loader.auto_weights(bundled_gguf, "int4", "auto: int4 here")
    assert fmt == "gguf" and "Q4_1 x210, Q8_0 x1" in why
    fmt, why = loader.auto_weights(gemma3_gguf, "int4", "auto: int4 here")
    assert fmt == "gguf" and "Q4_K x27" in why and "Q6_K x9" in why and "Q5_0 x81" in why
    # a 16-bit model or another device keep the CPU side's choice; tensor parallelism keeps the
    # stored blocks, each rank its slices (tests/distributed/test_tp_gguf.py), at a size that fits
    assert loader.auto_weights(bundled_gguf, "bf16", "x", dtype="bfloat16") == ("bf16", "x")
    assert loader.auto_weights(bundled_gguf, "fp32", "x", device="meta") == ("fp32", "x")
    fmt, why = loader.auto_weights(bundled_gguf, "fp32", "x", tensor_parallel_size=3)
    assert fmt == "gguf" and "each of 3 ranks holding its slices" in why
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 does not fit .*valid sizes: 1, 3, 9"):
        loader.auto_weights(bundled_gguf, "fp32", "x", tensor_parallel_size=2)


def test_auto_refuses_nothing_but_takes_fp32_for_types_without_kernels(bundled_gguf, monkeypatch):
    monkeypatch.setattr(qmm, "GGUF_TYPES", ("Q8_0",))
    fmt, why = loader.auto_weights(bundled_gguf, "int4", "auto: int4 here")
    assert fmt == "fp32" and "Q4_1" in why and "weights='int8'" in why
    with pytest.raises(ConfigError, match="Q4_1, which the GGUF kernels do not multiply"):
        load_model(bundled_gguf, weights="gguf", use_cache=False)


def _tiny_hf_dir(tmp_path):
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    out = tmp_path / "tiny-llama"
    model.save_pretrained(out)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>").save_pretrained(out)
    assert json.loads((out / "config.json").read_text()).get("torch_dtype", "float32") == "float32"
    return model, out


def test_auto_on_an_fp32_checkpoint_gives_that_checkpoint_s_greedy_tokens(tmp_path):
    from pagedkv import LLM, SamplingParams

    hf, path = _tiny_hf_dir(tmp_path)
    prompt = [5, 17, 33, 8, 61, 12]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(model=str(path), weights="auto", num_blocks=32, block_size=4)
    assert llm.engine.loaded.weights == "fp32" and "own values" in llm.engine.loaded.weights_reason
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].token_ids == want
    with pytest.raises(ConfigError, match="is a directory; 'gguf' keeps a GGUF file's stored blocks"):
        load_model(path, weights="gguf")


_RSS_CHILD = textwrap.dedent("""
    import json, pathlib, sys, torch
    from pagedkv.gguf_header import read_gguf_header
    from pagedkv.model import gguf_native
    from pagedkv.ops import qmm
    from pagedkv.model.loader import load_config
    assert qmm.get() is not None  # build the kernels before the baseline
    path = pathlib.Path(sys.argv[1])
    header, config = read_gguf_header(path), load_config(path)
    from tqdm.auto import tqdm
    from pagedkv.model.llama import LlamaForCausalLM
    LlamaForCausalLM(config, materialize=False)  # torch's first-use set-up (RoPE tables' ops): a constant
    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    base = rss("VmRSS:")
    net, report = gguf_native.build_gguf_model(path, header, config)
    print(json.dumps({"base": base, "peak": rss("VmHWM:"), "now": rss("VmRSS:"), "held": report.weight_bytes}))
""")


def test_streaming_the_weights_grows_resident_memory_by_at_most_1_2x_the_file(bundled_gguf, tmp_path):
    """Measured in a fresh process: VmHWM after ``build_gguf_model`` less VmRSS before it
    (imports, kernels built, header and config read, torch's ops used once: the constants a
    model's size does not change; the tokenizer is one more) is the weights' peak growth; the packed weights are the
    file's bytes (the tied Q8_0 head held, the embedding left in the page cache)."""
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(bundled_gguf), str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    size = bundled_gguf.stat().st_size
    assert r["held"] <= 1.02 * size
    assert r["peak"] - r["base"] <= 1.2 * size, r


KERNEL_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16"]


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_each_kernel_type_loads_as_stored_and_runs_within_the_int8_activation_error(tmp_path, type_name):
    """The tiny 2-layer llama of ``test_gguf_types`` with every matrix in ``type_name``:
    ``gguf`` keeps the stored bytes (packed = file bytes per matrix), its dequantised weights
    equal the fp32 loader's (``gguf.dequantize``, un-permuted, fused), and one prefill's
    logits are within the 8-bit activation blocks' error of the fp32 model's."""
    from pagedkv.attention.registry import get_backend
    from tests.model.test_gguf_types import write_tiny_gguf
    from tests.model.test_llama import _run

    path = tmp_path / f"tiny-{type_name}.gguf"
    write_tiny_gguf(path, type_name)
    fp32 = load_model(path, weights="fp32", use_cache=False)
    lm = load_model(path, weights="gguf", use_cache=False)
    assert lm.weights == "gguf"
    header = read_gguf_header(path)
    ref = fp32.model.state_dict()
    for prefix in linear_prefixes(lm.config):
        m = lm.model.get_submodule(prefix[:-1])
        assert isinstance(m, GGUFLinear) and set(m.types) == {type_name}
        torch.testing.assert_close(m.dequantize(), ref[prefix + "weight"], rtol=0, atol=1e-6)
    stored = sum(gguf_native._nbytes(t) for t in header.tensors if len(t.shape) == 2 and t.name != "token_embd.weight")
    head = next(t for t in header.tensors if t.name == "output.weight")
    assert head.shape[0] == 260 and lm.model.lm_head.padded and lm.model.lm_head.out_features == 260
    pad = 4 * gguf_native._nbytes(head) // 260  # 4 zero rows: 264 packed rows, a multiple of 8
    assert sum(m.packed.nbytes for m in gguf_native.iter_linears(lm.model)) == stored + pad
    ids = [5, 6, 7, 8, 9, 10, 100, 3, 200, 45, 17]
    backend = get_backend("reference")
    outs = []
    for m in (fp32.model, lm.model):
        caches = allocate_kv_caches(m, backend, num_blocks=4, block_size=8)
        outs.append(_run(m, backend, caches, ids, [len(ids)], [len(ids)], [[2, 0]], block=8))
    want, got = outs
    # 8-bit activation blocks at each of the 15 matmuls: 1.6% (Q8_0) to 4.5% (Q4_1) measured
    # (the int8 format on the same files: 1.5-3%); per matmul the kernels' bound is tested in
    # tests/model/test_qmm_gguf.py, and the weights themselves are exact (above)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= (1e-5 if type_name == "F16" else 0.06), rel  # F16: float32 activations, the sums' order only
    # greedy picks agree wherever the fp32 top-2 margin exceeds twice the row's error
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (got - want).abs().amax(-1)
    assert int(clear.sum()) >= 5
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_the_default_route_gives_a_request_the_same_tokens_alone_batched_and_chunked(model, bundled_gguf, gemma3_gguf):
    """``auto`` (= ``gguf``): activations are quantised per row and block, integer block sums
    are exact and each row's float sums run in one order, so a prompt's greedy tokens do not
    depend on what else is in the step or on the prefill chunk budget."""
    from pagedkv import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    p = "The history of the printing press"
    others = ["Tell me about cats and dogs in detail", "1, 2, 3, 4,", "Why is the sky blue? Explain", "def fib(n):",
              "Paris is", "A long time ago", "Q: 2+2? A:"]
    alone = LLM(model, kv_cache_memory="64MiB").generate([p], sp, use_tqdm=False)[0]
    assert alone.finish_reason == "length" and len(alone.token_ids) == 40
    llm = LLM(model, kv_cache_memory="64MiB")
    assert llm.engine.loaded.weights == "gguf"
    batched = llm.generate(others[:3] + [p] + others[3:], sp, use_tqdm=False)[3]
    chunked = LLM(model, kv_cache_memory="64MiB", max_num_batched_tokens=4).generate([p], sp, use_tqdm=False)[0]
    assert batched.token_ids == alone.token_ids
    assert chunked.token_ids == alone.token_ids
