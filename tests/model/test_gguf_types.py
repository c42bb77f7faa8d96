"""Every common GGML tensor type loads correctly: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
and the K-quants Q2_K .. Q6_K.

For each type a tiny ``llama`` GGUF (2 layers, hidden 256, FFN 512, 4 heads / 2 KV heads, a
260-token byte-level BPE vocabulary) is written with every 2-D weight (embeddings, q/k/v/o,
gate/up/down, output) stored in that type. The types ``gguf.quants.quantize`` can make come
from random normal weights; for the K-quants (which it cannot make) the blocks are random bytes
whose fp16 super-block scales (``d``, and ``dmin`` where the type has one) are set to small
finite values (``dmin / d`` such that the values average about 0). Then:

* our loader's fp32 weights equal ``gguf.dequantize`` of the stored bytes, tensor by tensor,
  after llama.cpp's Q/K row permutation is undone (checked by re-applying the permutation as
  llama.cpp's converter defines it) and q/k/v, gate/up are fused;
* transformers loads the same file to the same weights, and greedy tokens of ``pagedkv.LLM``
  equal ``model.generate(do_sample=False)`` for 2 prompts (``HF_REFUSES`` would list a type
  transformers cannot load; it is empty: transformers loads all 13);
* a tensor of a type gguf cannot dequantise, or of an unknown type id, and an unsupported
  ``general.architecture`` are ``ConfigError`` from ``load_config`` (and ``load_model``)
  before any tensor's data is read;
* ``weights="int4"`` from a Q4_K file requantises the dequantised values
  (``Int4Linear.from_float``; the untied head: ``Int8Linear.from_float``).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.model import loader
from pagedkv.model.quant import GROUP_SIZE, Int4Linear, Int8Linear
from pagedkv.testing.caches import allocate_kv_caches

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
#: types transformers refuses to load (our side is then checked alone); none at present
HF_REFUSES: dict[str, str] = {}
#: byte offsets of the fp16 super-block scale fields in one K-quant block (gguf/quants.py):
#: Q2_K scales[16] qs[64] d dmin; Q3_K hmask[32] qs[64] scales[12] d; Q4_K d dmin scales[12]
#: qs[128]; Q5_K d dmin scales[12] qh[32] qs[128]; Q6_K ql[128] qh[64] scales[16] d
K_SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 3, 200, 45, 17]]
_TOKENS = None  # the vocabulary: 256 byte-level symbols, one merge, 3 specials


def _vocab() -> list[str]:
    global _TOKENS
    if _TOKENS is None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        _TOKENS = list(bytes_to_unicode().values()) + ["hi", "<|bos|>", "<|eos|>", "<|pad|>"]
    return _TOKENS


def _linears() -> list[tuple[str, int, int, float]]:
    """``(gguf name, rows, cols, weight std)`` of every 2-D tensor of the tiny model. The
    embeddings and the head are wide (std 1) so greedy logits are far apart."""
    vocab = len(_vocab())
    out = [("token_embd.weight", vocab, HIDDEN, 1.0)]
    for i in range(LAYERS):
        out += [(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, 0.08),
                (f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, 0.08),
                (f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, 0.08),
                (f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, 0.08),
                (f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, 0.08),
                (f"blk.{i}.ffn_up.weight", FFN, HIDDEN, 0.08),
                (f"blk.{i}.ffn_down.weight", HIDDEN, FFN, 0.06)]
    return out + [("output.weight", vocab, HIDDEN, 1.0)]


def _k_blocks(qtype, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks ``uint8 [rows, cols / 256 * type_size]`` whose dequantised values
    have mean about 0 and std about ``std``: random codes and sub-block scales, the fp16 ``d``
    (and ``dmin``) fields set to one small finite value each. Values are linear in (d, dmin):
    ``dmin / d`` is chosen so the mins cancel the mean (else every head row shares one offset
    and greedy decoding repeats one token), then both are scaled to ``std``."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8).reshape(rows, -1)
    offsets = [off + b * size for b in range(cols // block) for off in K_SCALE_FIELDS[qtype.name]]

    def values(*fields: float) -> np.ndarray:
        for off, value in zip(offsets, fields * (cols // block)):
            raw[:, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
        return gguf.dequantize(raw, qtype)

    ratio = ()
    if len(K_SCALE_FIELDS[qtype.name]) == 2:  # w = d * sc * q - dmin * m
        ratio = (-float(values(1.0, 0.0).mean()) / float(values(0.0, 1.0).mean()),)
    d = std / float(values(1.0, *ratio).std())
    w = values(d, *(r * d for r in ratio))
    assert np.isfinite(w).all() and abs(float(w.mean())) < 0.1 * std and 0.8 * std < float(w.std()) < 1.25 * std
    return raw


def _add_header(w, arch: str = "llama") -> None:
    tokens = _vocab()
    for add, v in ((w.add_block_count, LAYERS), (w.add_context_length, 128), (w.add_embedding_length, HIDDEN),
                   (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0), (w.add_vocab_size, len(tokens)),
                   (w.add_rope_dimension_count, HEAD_DIM)):
        add(v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * 3)
    w.add_token_merges(["h i"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_pad_token_id(259)
    w.add_add_bos_token(False)


def write_tiny_gguf(path, type_name: str, seed: int = 0, odd: dict[str, int] | None = None,
                    arch: str = "llama") -> None:
    """The tiny model with its 2-D weights stored as ``type_name``; norms F32. ``odd``: gguf
    name -> GGML type id whose block size is 32 to store that tensor as instead (random bytes)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    _add_header(w, arch)

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    for name, rows, cols, std in _linears():
        if name == "output.weight":
            norm("output_norm.weight")
        elif name.endswith("attn_q.weight"):
            norm(name.replace("attn_q", "attn_norm"))
        elif name.endswith("ffn_gate.weight"):
            norm(name.replace("ffn_gate", "ffn_norm"))
        if odd and name in odd:
            other = gguf.GGMLQuantizationType(odd[name])
            block, size = gguf.GGML_QUANT_SIZES[other]
            w.add_tensor(name, rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8), raw_dtype=other)
        elif qtype.name in K_SCALE_FIELDS:
            w.add_tensor(name, _k_blocks(qtype, rows, cols, std, rng), raw_dtype=qtype)
        else:
            x = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
            if qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(name, x)
            else:
                w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def stored_values(path) -> dict[str, tuple[str, torch.Tensor]]:
    """gguf name -> (stored GGML type name, ``gguf.dequantize`` of its bytes, float32 [rows, cols])."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        values = gguf.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))
        out[t.name] = (t.tensor_type.name, torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape))
    return out


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order (``convert_hf_to_gguf.py``, ``LlamaModel.permute``):
    per head, rows [first half; second half] become interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module", params=TYPES)
def case(request, tmp_path_factory):
    """One type's file, its stored values and our fp32 ``LoadedModel`` of it."""
    type_name = request.param
    d = tmp_path_factory.mktemp(f"gguf-{type_name}")
    path = d / f"tiny-{type_name}.gguf"
    write_tiny_gguf(path, type_name)
    loaded = loader.load_model(path, weights="fp32", use_cache=False)
    return type_name, path, stored_values(path), loaded


def test_stored_type_and_our_weights_equal_gguf_dequantize(case):
    """Each 2-D tensor is stored in the type under test, and our loader's fp32 weights are
    exactly ``gguf.dequantize`` of its bytes: Q/K rows back in llama.cpp's order equal the
    stored values, q/k/v and gate/up are the stored parts concatenated in that order."""
    type_name, _path, stored, loaded = case
    assert loaded.weights == "fp32" and loaded.config.num_heads == HEADS and loaded.config.num_kv_heads == KV_HEADS
    for name, *_ in _linears():
        assert stored[name][0] == type_name, name
    ours = loaded.model.state_dict()
    assert torch.equal(ours["embed_tokens.weight"], stored["token_embd.weight"][1])
    assert torch.equal(ours["lm_head.weight"], stored["output.weight"][1])
    assert torch.equal(ours["norm.weight"], stored["output_norm.weight"][1])
    q_rows, kv_rows = HIDDEN, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        def g(part: str, i: int = i) -> torch.Tensor:
            return stored[f"blk.{i}.{part}.weight"][1]

        qkv = ours[f"layers.{i}.qkv_proj.weight"]
        assert qkv.shape == (q_rows + 2 * kv_rows, HIDDEN)
        q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
        assert torch.equal(llama_cpp_permute(q, HEADS), g("attn_q"))
        assert torch.equal(llama_cpp_permute(k, KV_HEADS), g("attn_k"))
        assert not torch.equal(q, g("attn_q"))  # the permutation was undone, not skipped
        assert torch.equal(v, g("attn_v"))
        assert torch.equal(ours[f"layers.{i}.o_proj.weight"], g("attn_output"))
        assert torch.equal(ours[f"layers.{i}.gate_up_proj.weight"], torch.cat([g("ffn_gate"), g("ffn_up")]))
        assert torch.equal(ours[f"layers.{i}.down_proj.weight"], g("ffn_down"))
        assert torch.equal(ours[f"layers.{i}.input_layernorm.weight"], g("attn_norm"))
        assert torch.equal(ours[f"layers.{i}.post_attention_layernorm.weight"], g("ffn_norm"))
    w = ours["layers.0.o_proj.weight"]
    assert torch.isfinite(w).all() and 0.02 < float(w.std()) < 0.3  # real values: not zeros, not fp16 underflow


def test_transformers_loads_the_same_weights_and_greedy_tokens_agree(case, tmp_path_factory, monkeypatch):
    """transformers reads the same file to the same weights (its q/k/v, gate/up separate), and
    greedy tokens of ``pagedkv.LLM(model=path, weights="fp32")`` equal transformers'
    ``generate(do_sample=False)`` for 2 prompts (8 tokens each, both past EOS); they also
    equal our fp32 model's argmax by full recomputation, all that is checked of a type in
    ``HF_REFUSES`` (which transformers must then refuse)."""
    from transformers import AutoModelForCausalLM

    import pagedkv

    type_name, path, _stored, loaded = case
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    llm = pagedkv.LLM(model=str(path), weights="fp32", kv_cache_memory="8MiB")
    try:
        greedy = pagedkv.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    finally:
        llm.close()
    ours = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(t) for t in ours] == [8, 8] and len(set(ours[0] + ours[1])) > 4  # not one repeated token

    assert ours == [_greedy_reference(loaded.model, p) for p in PROMPTS]
    if type_name in HF_REFUSES:
        with pytest.raises(Exception, match=HF_REFUSES[type_name]):
            AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        return

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    mine, theirs = loaded.model.state_dict(), hf.state_dict()
    assert torch.equal(theirs["model.embed_tokens.weight"], mine["embed_tokens.weight"])
    assert torch.equal(theirs["lm_head.weight"], mine["lm_head.weight"])
    assert torch.equal(theirs["model.norm.weight"], mine["norm.weight"])
    for i in range(LAYERS):
        hp = f"model.layers.{i}."
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            assert torch.equal(theirs[hp + norm], mine[f"layers.{i}.{norm}"]), (i, norm)
        qkv = torch.cat([theirs[hp + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(qkv, mine[f"layers.{i}.qkv_proj.weight"]), i
        gate_up = torch.cat([theirs[hp + "mlp.gate_proj.weight"], theirs[hp + "mlp.up_proj.weight"]])
        assert torch.equal(gate_up, mine[f"layers.{i}.gate_up_proj.weight"]), i
        assert torch.equal(theirs[hp + "self_attn.o_proj.weight"], mine[f"layers.{i}.o_proj.weight"]), i
        assert torch.equal(theirs[hp + "mlp.down_proj.weight"], mine[f"layers.{i}.down_proj.weight"]), i
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 259  # past EOS, as ignore_eos
    with torch.inference_mode():
        ref = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8)[0, len(p):].tolist()
               for p in PROMPTS]
    assert ours == ref, type_name


def _greedy_reference(net, prompt: list[int]) -> list[int]:
    """8 greedy tokens of our fp32 model by full recomputation (no KV cache reuse)."""
    from pagedkv.attention import get_backend
    from pagedkv.attention.base import AttentionMetadata

    backend = get_backend("cpu")
    ids = list(prompt)
    for _ in range(8):
        caches = allocate_kv_caches(net, backend, num_blocks=8, block_size=4)
        md = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(8))], 4)
        with torch.inference_mode():
            logits = net.compute_logits(net(torch.tensor(ids), torch.arange(len(ids)), caches, md, backend))
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


def _count_tensor_reads(monkeypatch) -> list[str]:
    """Make the loader's readers of tensor bytes (``gguf_read.Reader``, which the streaming
    loaders use; ``weights.gguf_blocks``, the memory map of ``load_config``'s ``rope_freqs`` and
    the whole-model reference, also imported by ``quantize``) record the name of every tensor
    they read from (once per tensor)."""
    from pagedkv.model import gguf_read, quantize, weights

    read: list[str] = []
    real = weights.gguf_blocks
    real_into = gguf_read.Reader.into

    def counting(path, tensors):
        for item in real(path, tensors):
            read.append(item[0].name)
            yield item
            del item  # the memory map closes only once no view of it is left

    def into(self, info, out, skip=0):
        if info.name not in read:
            read.append(info.name)
        return real_into(self, info, out, skip)

    monkeypatch.setattr(weights, "gguf_blocks", counting)
    monkeypatch.setattr(quantize, "gguf_blocks", counting)
    monkeypatch.setattr(gguf_read.Reader, "into", into)
    return read


def _set_stored_type(path, tensor: str, type_id: int) -> None:
    """Rewrite the GGML type id of ``tensor`` in the file's tensor table (name, n_dims, dims, type)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


def test_a_type_gguf_cannot_dequantise_is_a_config_error_before_any_weight_loads(tmp_path, monkeypatch):
    """``blk.1.ffn_down.weight`` (late in the file) stored as Q8_1, which gguf has no
    dequantiser for: ``load_config`` and ``load_model`` raise ``ConfigError`` naming the tensor
    and the type, and no tensor's data was read first."""
    import gguf

    with pytest.raises(NotImplementedError):  # the premise: gguf cannot dequantise Q8_1
        gguf.dequantize(np.zeros((1, 40), np.uint8), gguf.GGMLQuantizationType.Q8_1)
    path = tmp_path / "q8_1.gguf"
    write_tiny_gguf(path, "Q8_0", odd={"blk.1.ffn_down.weight": int(gguf.GGMLQuantizationType.Q8_1)})
    read = _count_tensor_reads(monkeypatch)
    for load in (loader.load_config, lambda p: loader.load_model(p, use_cache=False),
                 lambda p: loader.load_model(p, weights="int4", use_cache=False)):
        with pytest.raises(ConfigError, match=r"blk\.1\.ffn_down\.weight.*Q8_1"):
            load(path)
    assert read == []
    good = tmp_path / "q8_0.gguf"  # the counter sees a load that reads tensors
    write_tiny_gguf(good, "Q8_0")
    loader.load_model(good, use_cache=False)
    assert "blk.1.ffn_down.weight" in read and len(read) == len(_linears()) + 2 * LAYERS + 1


def test_an_unknown_type_id_is_a_config_error_before_any_weight_loads(tmp_path, monkeypatch):
    """A tensor whose type id is no GGML type at all (77) is a ``ConfigError`` naming the tensor
    and the id, from ``load_config`` and ``load_model``, with no tensor's data read."""
    import gguf

    with pytest.raises(ValueError):
        gguf.GGMLQuantizationType(77)
    path = tmp_path / "unknown.gguf"
    write_tiny_gguf(path, "F16")
    _set_stored_type(path, "blk.1.attn_v.weight", 77)
    from pagedkv.gguf_header import read_gguf_header

    assert {t.name: t.ggml_type for t in read_gguf_header(path).tensors}["blk.1.attn_v.weight"] == 77
    read = _count_tensor_reads(monkeypatch)
    for load in (loader.load_config, lambda p: loader.load_model(p, use_cache=False)):
        with pytest.raises(ConfigError, match=r"blk\.1\.attn_v\.weight.*\b77\b"):
            load(path)
    assert read == []


def test_an_unsupported_architecture_is_a_config_error_naming_it(tmp_path, monkeypatch):
    """A GGUF whose ``general.architecture`` we do not run (``falcon``) is a ``ConfigError``
    naming the key and the architecture, from ``load_config`` and ``load_model``, with no tensor's
    data read."""
    path = tmp_path / "falcon.gguf"
    write_tiny_gguf(path, "F16", arch="falcon")
    read = _count_tensor_reads(monkeypatch)
    for load in (loader.load_config, lambda p: loader.load_model(p, use_cache=False)):
        with pytest.raises(ConfigError, match=r"general\.architecture.*'falcon'"):
            load(path)
    assert read == []


def test_int4_from_a_q4_k_file_requantises_the_dequantised_weights(tmp_path):
    """``weights="int4"`` keeps stored codes only for Q4_0/Q4_1; from a Q4_K file every layer
    linear is ``Int4Linear.from_float`` of the dequantised fp32 weight (codes, scales and mins
    equal), each value within the Q4_1 rounding bound of the fp32 weight (half a step, plus
    fp16 rounding of min and scale), and the untied head is ``Int8Linear.from_float``."""
    path = tmp_path / "tiny-q4k.gguf"
    write_tiny_gguf(path, "Q4_K", seed=3)
    fp32 = loader.load_model(path, weights="fp32", use_cache=False).model.state_dict()
    int4 = loader.load_model(path, weights="int4", use_cache=False)
    assert int4.weights == "int4"
    for i in range(LAYERS):
        for part in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            m = int4.model.get_submodule(f"layers.{i}.{part}")
            w = fp32[f"layers.{i}.{part}.weight"]
            assert isinstance(m, Int4Linear), (i, part)
            ref = Int4Linear.from_float(w)
            assert torch.equal(m.stored_codes(), ref.qcodes) and torch.equal(m.scale, ref.scale) and torch.equal(m.min, ref.min)
            out, k = w.shape
            err = (m.dequantize() - w).abs().reshape(out, k // GROUP_SIZE, GROUP_SIZE).amax(-1)
            bound = 0.5 * m.scale + 2.0 ** -10 * (m.min.abs() + 15 * m.scale)
            assert (err <= bound).all(), (i, part, float((err - bound).max()))
            assert float(err.max()) > 0  # requantised: Q4_K's values are not Q4_1's grid
    head = int4.model.get_submodule("lm_head")
    assert isinstance(head, Int8Linear)
    ref = Int8Linear.from_float(fp32["lm_head.weight"])
    assert torch.equal(head.stored_codes(), ref.qweight) and torch.equal(head.scale, ref.scale)
