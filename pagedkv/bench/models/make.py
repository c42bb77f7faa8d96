"""Random-weight GGUFs of Llama-family shapes for ``pagedkv bench models``, made offline and cached.

Speed and memory do not depend on the weights' values, so each model is written with small
normal values (std 0.02) and norms of 1.0, in llama.cpp's ``llama`` architecture (or
``qwen3moe``, or ``deepseek2``: :mod:`pagedkv.bench.models.deepseek2`), with the
bundled SmolLM2 GGUF's tokenizer (``tokenizer.ggml.*``) padded to the shape's vocabulary with
``<|extra_N|>`` tokens of type NORMAL: plain vocabulary entries that no merge reaches, as most
of a real 128k or 151k vocabulary is to any one text (type USER_DEFINED would make them ~80k
added tokens, which transformers processes one by one at every tokenizer load: seconds that no
real model's start pays; Llama-3 has 256 added tokens). The f16 file is written **tensor by tensor** (and
each tensor in row chunks) with gguf-py's ``GGUFWriter``: every tensor info first, then the
header, metadata and tensor table, then one tensor's data at a time, generated just before it
is written, so no whole model is ever held in memory. ``llama-quantize`` then makes Q4_0 /
Q4_K_M / Q8_0 from it and the f16 file is deleted (unless ``keep_f16``).

Without ``llama-quantize``, Q4_0 and Q8_0 are written directly by gguf-py's numpy quantizer
(every 2-D weight in that type, norms F32; llama-quantize would store the output/embedding
matrix as Q6_K instead): the file name says which maker made it (``...-ggufpy.gguf``), so the
two are never mixed up. Q4_K_M needs llama-quantize.

Files are cached under ``$PAGEDKV_CACHE_DIR/models/`` (default ``~/.cache/pagedkv/models``)
as ``random-<arch>-<size>-<type>[-ggufpy].gguf`` with a ``.json`` beside each (how it was made,
how long it took, its bytes); a file whose sidecar is missing is remade.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from pagedkv.bench.models import deepseek2, gpt_oss
from pagedkv.bench.models.facts import tensor_types, weight_bytes_per_token  # noqa: F401 (this module's API)

MAKER_VERSION = 2  # 2: the vocabulary padding is NORMAL tokens (1: USER_DEFINED)
STD = 0.02
CHUNK_ELEMENTS = 1 << 24  # values generated (and quantised) per chunk: 64 MiB of float32
TYPES = ("q4_0", "q4_k_m", "q8_0", "f16", "mxfp4")
#: llama-quantize's type names
QUANTIZE_NAME = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M", "q8_0": "Q8_0", "bf16": "BF16"}


@dataclass(frozen=True)
class Shape:
    """A Llama-family model shape (the dims of the real model it is named after). With
    ``experts`` > 0 a mixture-of-experts model in llama.cpp's ``qwen3moe`` architecture: every
    layer's MLP is ``experts`` experts of width ``expert_ffn``, ``experts_used`` routed per
    token (tensors ``ffn_gate_inp`` ``[E, H]`` F32, ``ffn_gate_exps`` / ``ffn_up_exps``
    ``[E, I, H]``, ``ffn_down_exps`` ``[E, H, I]``), and q/k norms per head (Qwen3's).
    ``head_size`` 0 means ``hidden / heads``.

    With ``kv_lora_rank`` > 0 a DeepSeek-V2 model in llama.cpp's ``deepseek2`` architecture
    (:mod:`pagedkv.bench.models.deepseek2`): latent attention of rank ``kv_lora_rank``
    (``q_lora_rank`` None: one ``attn_q``, as V2-Lite), head dims ``qk_nope_dim`` +
    ``qk_rope_dim`` / ``v_head_dim``, ``kv_heads`` 1; ``dense_layers`` dense layers (``ffn``)
    first, then routed experts beside ``shared_experts`` shared ones (softmax gating, scale
    ``routed_scale``). Plain rope (theta ``rope_theta``; no yarn scaling, which changes no
    weight and no speed) and the shape's ``context``, not V2's 163,840.

    With ``sliding_window`` > 0 a gpt-oss model in llama.cpp's ``gpt-oss`` architecture
    (:mod:`pagedkv.bench.models.gpt_oss`): biased attention with sinks, even layers sliding,
    YaRN, biased experts; type ``mxfp4`` only (llama-quantize's MXFP4_MOE: MXFP4 experts, Q8_0
    else), written by gguf-py with random expert codes."""

    name: str
    like: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float = 10000.0
    context: int = 8192
    rms_eps: float = 1e-5
    head_size: int = 0
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: Optional[int] = None
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    routed_scale: float = 1.0
    sliding_window: int = 0

    @property
    def head_dim(self) -> int:
        """The query/key head size (MLA: ``qk_nope_dim + qk_rope_dim``)."""
        if self.kv_lora_rank:
            return self.qk_nope_dim + self.qk_rope_dim
        return self.head_size or self.hidden // self.heads

    @property
    def arch(self) -> str:
        """llama.cpp's architecture name of the file: ``llama``, ``qwen3moe``, ``deepseek2`` or ``gpt-oss``."""
        if self.sliding_window:
            return gpt_oss.ARCH
        return deepseek2.ARCH if self.kv_lora_rank else "qwen3moe" if self.experts else "llama"

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, numpy shape)`` of every tensor, in llama.cpp's names and order."""
        if self.kv_lora_rank or self.sliding_window:
            return (deepseek2 if self.kv_lora_rank else gpt_oss).tensors(self)
        h, kv, d = self.hidden, self.kv_heads * self.head_dim, self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (self.vocab, h))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (self.heads * d, h)),
                    (b + "attn_k.weight", (kv, h)), (b + "attn_v.weight", (kv, h)),
                    (b + "attn_output.weight", (h, self.heads * d)), (b + "ffn_norm.weight", (h,))]
            if self.experts:
                e, f = self.experts, self.expert_ffn
                out += [(b + "attn_q_norm.weight", (d,)), (b + "attn_k_norm.weight", (d,)),
                        (b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_exps.weight", (e, f, h)),
                        (b + "ffn_up_exps.weight", (e, f, h)), (b + "ffn_down_exps.weight", (e, h, f))]
            else:
                out += [(b + "ffn_gate.weight", (self.ffn, h)), (b + "ffn_up.weight", (self.ffn, h)),
                        (b + "ffn_down.weight", (h, self.ffn))]
        out.append(("output_norm.weight", (h,)))
        if not self.tied:
            out.append(("output.weight", (self.vocab, h)))
        return out

    def num_params(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors())


SHAPES: dict[str, Shape] = {
    "0.5b": Shape("0.5b", "Qwen2.5-0.5B dims (llama architecture)", 896, 24, 14, 2, 4864, 151936, True,
                  rope_theta=1e6),
    "1.7b": Shape("1.7b", "SmolLM2-1.7B", 2048, 24, 32, 32, 8192, 49152, True, rope_theta=130000.0),
    "3b": Shape("3b", "Llama-3.2-3B", 3072, 28, 24, 8, 8192, 128256, True, rope_theta=500000.0),
    "8b": Shape("8b", "Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, False, rope_theta=500000.0),
    # mixture of experts: Qwen3-30B-A3B (hidden 2048, 48 layers, 128 experts of 768, 8 routed,
    # 32 x 128 query heads, 4 KV heads) at half its width and depth, its routing and head size
    # kept: 4.1B parameters, of which ~0.53B are read per token (the 8 routed experts, attention,
    # the untied LM head)
    "moe-4b": Shape("moe-4b", "Qwen3-30B-A3B at half width and depth (qwen3moe architecture)", 1024, 24, 16, 4,
                    3072, 151936, False, rope_theta=1e6, rms_eps=1e-6, head_size=128, experts=128, experts_used=8,
                    expert_ffn=384),
    # test-sized (smoke runs and tests): the tokenizer's 49,152 tokens + 16 extra
    "tiny": Shape("tiny", "test-sized", 64, 2, 4, 2, 128, 49168, True),
    "tiny-moe": Shape("tiny-moe", "test-sized mixture of experts", 64, 2, 4, 2, 128, 49168, False, head_size=32,
                      experts=8, experts_used=2, expert_ffn=64),
    # DeepSeek-V2-Lite (hidden 2048, 27 layers, 16 heads, one attn_q, kv rank 512, nope/rope/v
    # 128/64/128, 1 dense layer of 10944, then 64 routed experts of 1408, 6 per token, and 2
    # shared) at a third of its depth: 1 dense + 8 MoE layers, 5.18B parameters (~3 GB at 4
    # bits), of which ~0.96B are read per token (6 of 64 experts, the shared ones, attention, the LM head)
    "dsv2-lite": Shape("dsv2-lite", "DeepSeek-V2-Lite at a third of its depth (deepseek2 architecture)", 2048, 9, 16,
                       1, 10944, 102400, False, rms_eps=1e-6, experts=64, experts_used=6, expert_ffn=1408,
                       kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, shared_experts=2,
                       dense_layers=1),
    # gpt-oss-20b (hidden 2880, 24 layers, 64 query heads of 64, 8 KV heads, 32 experts of 2880,
    # 4 routed, vocab 201088, window 128, YaRN x32 over 4096) at half its depth: 12 layers,
    # 10.9B parameters (6.6 GB as MXFP4_MOE), of which ~1.5B are read per token (4 of 32
    # experts, attention, the LM head)
    "oss-20b": Shape("oss-20b", "gpt-oss-20b at half its depth (gpt-oss architecture)", 2880, 12, 64, 8, 2880,
                     201088, False, rope_theta=150000.0, context=131072, head_size=64, experts=32, experts_used=4,
                     expert_ffn=2880, sliding_window=128),
    "tiny-oss": Shape("tiny-oss", "test-sized gpt-oss form", 64, 2, 4, 2, 128, 49168, False, head_size=16,
                      experts=8, experts_used=2, expert_ffn=64, sliding_window=8),
    # test-sized MLA: every row a whole number of 32-blocks (gguf-py's Q8_0 / Q4_0)
    "tiny-mla": Shape("tiny-mla", "test-sized DeepSeek-V2-Lite form", 64, 2, 4, 1, 128, 49168, False,
                      experts=8, experts_used=2, expert_ffn=64, kv_lora_rank=32, qk_nope_dim=32, qk_rope_dim=16,
                      v_head_dim=32, shared_experts=1, dense_layers=1),
}


def models_dir() -> Path:
    """``$PAGEDKV_CACHE_DIR/models`` (default ``~/.cache/pagedkv/models``)."""
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv") / "models"


def peers_bin() -> Path:
    """Where ``make peers`` builds llama.cpp's tools: ``<cache root>/peers/bin``."""
    return models_dir().parent / "peers" / "bin"


def find_tool(name: str, bin_dir: Optional[Path] = None) -> Optional[str]:
    """llama.cpp tool ``name`` (``llama-quantize``, ``llama-bench``, ``llama-server``) from
    ``bin_dir`` (default :func:`peers_bin`), else PATH; None if absent."""
    cand = (bin_dir or peers_bin()) / name
    if cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    return shutil.which(name)


def model_file(shape: str, qtype: str, maker: str, root: Optional[Path] = None) -> Path:
    """The cached file of ``shape`` in ``qtype`` made by ``maker`` (``llama-quantize`` or
    ``gguf-py``)."""
    suffix = "" if maker == "llama-quantize" else "-ggufpy"
    arch = SHAPES[shape].arch if shape in SHAPES else "llama"
    return (root or models_dir()) / f"random-{arch}-{shape}-{qtype}{suffix}.gguf"


# ---- the tokenizer ---------------------------------------------------------------------------------
def tokenizer_fields(source: Optional[Path] = None) -> dict[str, tuple[Any, Any]]:
    """``{key: (value, GGUFValueType)}`` of every ``tokenizer.ggml.*`` field of ``source``
    (default: the bundled SmolLM2 GGUF), values decoded (strings as str, arrays as lists)."""
    from gguf import GGUFReader, GGUFValueType

    if source is None:
        from pagedkv._bundled import bundled_model_path

        source = bundled_model_path()
    reader = GGUFReader(str(source))
    out: dict[str, tuple[Any, Any]] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == GGUFValueType.ARRAY:
            out[key] = (list(value), field.types[-1])
        else:
            out[key] = (value, vtype)
    return out


def padded_tokenizer(fields: dict[str, tuple[Any, Any]], vocab: int) -> dict[str, tuple[Any, Any]]:
    """``fields`` with the token list, token types and scores (if any) padded to ``vocab``
    entries with ``<|extra_N|>`` tokens (type NORMAL, score 0). Raises ``ValueError``
    when ``vocab`` is smaller than the tokenizer's own vocabulary (its merges need it)."""
    from gguf import TokenType

    tokens = list(fields["tokenizer.ggml.tokens"][0])
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} < the tokenizer's {len(tokens)} tokens")
    extra = vocab - len(tokens)
    out = dict(fields)
    out["tokenizer.ggml.tokens"] = (tokens + [f"<|extra_{i}|>" for i in range(extra)], fields["tokenizer.ggml.tokens"][1])
    if "tokenizer.ggml.token_type" in fields:
        types, t = fields["tokenizer.ggml.token_type"]
        out["tokenizer.ggml.token_type"] = ([int(x) for x in types] + [int(TokenType.NORMAL)] * extra, t)
    if "tokenizer.ggml.scores" in fields:
        scores, t = fields["tokenizer.ggml.scores"]
        out["tokenizer.ggml.scores"] = ([float(x) for x in scores] + [0.0] * extra, t)
    return out


# ---- writing -------------------------------------------------------------------------------------------
def _writer(path: Path, shape: Shape, file_type: int, tokenizer: dict[str, tuple[Any, Any]]) -> Any:
    from gguf import GGUFValueType, GGUFWriter

    w = GGUFWriter(str(path), shape.arch)
    w.add_name(f"pagedkv random {shape.arch} {shape.name}")
    w.add_description(f"random weights (std {STD}, norms 1.0), {shape.like} shape, made by pagedkv bench models")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    w.add_rope_dimension_count(shape.qk_rope_dim if shape.kv_lora_rank else shape.head_dim)
    if shape.kv_lora_rank:
        deepseek2.add_metadata(w, shape)
    elif shape.experts:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
        if shape.sliding_window:
            gpt_oss.add_metadata(w, shape)
    w.add_file_type(file_type)
    w.add_quantization_version(2)
    for key, (value, vtype) in tokenizer.items():
        if isinstance(value, list):
            sub = vtype
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=sub)
        else:
            w.add_key_value(key, value, vtype)
    return w


def _chunks(rows: int, cols: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Random float32 row blocks (std :data:`STD`) of a ``rows x cols`` matrix, at most
    :data:`CHUNK_ELEMENTS` values each."""
    step = max(1, CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        block = rng.standard_normal((n, cols), dtype=np.float32)
        block *= STD
        yield block


def _write_chunked(writer: Any, chunks: Iterator[np.ndarray]) -> int:
    """``GGUFWriter.write_tensor_data`` for one tensor given in row chunks (the writer takes a
    whole array): the next tensor info's data, aligned and padded like the writer does it.
    Returns the bytes written; raises ``ValueError`` if they differ from the info's."""
    fout = writer.fout[0]
    name = next(iter(writer.tensors[0]))
    ti = writer.tensors[0].pop(name)
    writer.write_padding(fout, fout.tell())
    total = 0
    for c in chunks:
        c.tofile(fout)
        total += c.nbytes
    if total != ti.nbytes:
        raise ValueError(f"{name}: wrote {total} bytes, its info says {ti.nbytes}")
    writer.write_padding(fout, total)
    from gguf.gguf_writer import WriterState

    writer.state = WriterState.WEIGHTS
    return total


def _is_f32(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor is stored F32 (norms, a mixture-of-experts router) in every file type."""
    return len(shape) == 1 or name.endswith("ffn_gate_inp.weight")


def write_random_gguf(path: Path, shape: Shape, qtype: str = "f16", seed: int = 0,
                      tokenizer: Optional[dict[str, tuple[Any, Any]]] = None,
                      progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Write ``shape`` with random weights to ``path`` in ``qtype`` (``f16``; or ``q8_0`` /
    ``q4_0`` quantised by gguf-py's numpy quantizer; ``mxfp4`` for a gpt-oss shape: random MXFP4
    expert codes, Q8_0 else), one tensor (and row chunk) at a time.
    Norms are F32 ones. Written to ``path.tmp`` and renamed. Returns facts: seconds, bytes,
    tensors."""
    from gguf import GGMLQuantizationType, LlamaFileType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quantize

    T = GGMLQuantizationType
    if (qtype == "mxfp4") != bool(shape.sliding_window):
        raise ValueError(f"{shape.name}: type {qtype!r} (gpt-oss shapes are mxfp4 only, mxfp4 is gpt-oss only)")
    qt = {"f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "mxfp4": T.Q8_0}[qtype]
    ftype = {"f16": LlamaFileType.MOSTLY_F16, "q8_0": LlamaFileType.MOSTLY_Q8_0,
             "q4_0": LlamaFileType.MOSTLY_Q4_0, "mxfp4": gpt_oss.FILE_TYPE}[qtype]

    def type_of(name: str, shp: tuple[int, ...]) -> Any:
        if shape.sliding_window:
            return {"mxfp4": T.MXFP4, "f32": T.F32, "q8_0": T.Q8_0}[gpt_oss.tensor_type(name, shp)]
        return T.F32 if _is_f32(name, shp) else qt

    t0 = time.perf_counter()
    tok = padded_tokenizer(tokenizer if tokenizer is not None else tokenizer_fields(), shape.vocab)
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    w = _writer(tmp, shape, int(ftype), tok)
    specs = shape.tensors()
    for name, shp in specs:
        t = type_of(name, shp)
        if t == T.F32:
            w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)))
        else:
            rows, cols = int(np.prod(shp[:-1])), shp[-1]
            block, type_size = GGML_QUANT_SIZES[t]
            if cols % block:
                raise ValueError(f"{name}: {cols} columns is not a multiple of {t.name}'s block {block}")
            w.add_tensor_info(name, shp, np.dtype(np.float16), rows * cols // block * type_size, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for i, (name, shp) in enumerate(specs):
        t = type_of(name, shp)
        if len(shp) == 1:
            _write_chunked(w, iter([np.ones(shp, dtype=np.float32)]))
            continue
        rows, cols = int(np.prod(shp[:-1])), shp[-1]
        if t == T.MXFP4:  # random codes (gpt_oss.random_mxfp4): no quantiser pass
            step = max(1, CHUNK_ELEMENTS // cols)
            _write_chunked(w, (gpt_oss.random_mxfp4(min(step, rows - r0), cols, rng) for r0 in range(0, rows, step)))
            continue
        chunks = _chunks(rows, cols, rng)
        if t == T.F32:  # a router or a bias: random, F32 as llama.cpp's converter keeps it
            _write_chunked(w, chunks)
        elif t == T.F16:
            _write_chunked(w, (c.astype(np.float16) for c in chunks))
        else:
            _write_chunked(w, (quantize(c, t) for c in chunks))
        if progress and (i % 20 == 0 or shp[0] * shp[1] > 1e8):
            progress(f"{path.name}: {name} written ({i + 1}/{len(specs)})")
    w.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"seconds": time.perf_counter() - t0, "bytes": path.stat().st_size, "tensors": len(specs),
            "params": shape.num_params()}


def quantize_file(src: Path, dst: Path, qtype: str, quantize_bin: str, threads: int = 2,
                  allow_requantize: bool = False) -> dict[str, Any]:
    """``llama-quantize [--allow-requantize] src dst.tmp TYPE threads``, then renamed (with
    ``allow_requantize`` a quantised ``src`` is dequantised to f32 tensor by tensor and quantised
    again). Returns seconds, bytes and the command; raises ``RuntimeError`` with the tail of its
    output when it fails."""
    tmp = dst.with_name(dst.name + ".tmp")
    t0 = time.perf_counter()
    cmd = [quantize_bin, *(["--allow-requantize"] if allow_requantize else []), str(src), str(tmp),
           QUANTIZE_NAME[qtype], str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        if tmp.exists():
            tmp.unlink()
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"llama-quantize {QUANTIZE_NAME[qtype]} failed (exit {r.returncode}): {tail}")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dst)
    return {"seconds": time.perf_counter() - t0, "bytes": dst.stat().st_size,
            "command": " ".join(["llama-quantize", *cmd[1:-4], "SOURCE", "OUT", *cmd[-2:]])}


def sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def cached_facts(path: Path) -> Optional[dict[str, Any]]:
    """The sidecar facts of a cached model file, or None when the file or sidecar is missing,
    the sidecar unreadable or the byte count differs (then the file is remade)."""
    try:
        facts = json.loads(sidecar(path).read_text())
        if path.stat().st_size != facts["bytes"] or facts.get("maker_version") != MAKER_VERSION:
            return None
        return facts
    except (OSError, ValueError, KeyError):
        return None


def ensure_models(sizes: list[str], types: list[str], *, use_llama_quantize: bool = True, keep_f16: bool = False,
                  root: Optional[Path] = None, threads: int = 2,
                  log: Callable[[str], None] = print) -> dict[tuple[str, str], dict[str, Any]]:
    """Make (or find cached) every ``size x type`` file. Returns ``{(size, type): facts}``:
    ``path``, ``maker``, ``bytes``, ``make_seconds`` (f16 write share + quantise, or the direct
    write) and ``cached`` (found, not made now); or ``{"error": why}`` for a file that cannot be
    made (Q4_K_M without llama-quantize). An ``f16`` file is written directly (``gguf-py``: the
    writer's own half values, what llama-quantize starts from), never quantised."""
    root = root or models_dir()
    qbin = find_tool("llama-quantize") if use_llama_quantize else None
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for size in sizes:
        shape = SHAPES[size]
        f16_path, f16_facts = root / f"random-{shape.arch}-{size}-f16.gguf", None
        for qtype in types:
            maker = "llama-quantize" if qbin and qtype not in ("f16", "mxfp4") else "gguf-py"
            path = model_file(size, qtype, maker, root)
            facts = cached_facts(path)
            if facts is not None:
                out[(size, qtype)] = {**facts, "path": str(path), "cached": True}
                continue
            if qbin is None and qtype == "q4_k_m":
                out[(size, qtype)] = {"error": "llama-quantize not built (make peers): K-quants need it"}
                continue
            try:
                if maker == "gguf-py":
                    log(f"[models] writing {path.name} with gguf-py's writer ...")
                    made = write_random_gguf(path, shape, qtype, progress=log)
                    facts = {"make_seconds": made["seconds"], "write_seconds": made["seconds"], "quantize_seconds": None}
                else:
                    if f16_facts is None:
                        f16_facts = cached_facts(f16_path)
                    if f16_facts is None:
                        log(f"[models] writing {f16_path.name} (f16, tensor by tensor) ...")
                        made = write_random_gguf(f16_path, shape, "f16", progress=log)
                        f16_facts = {"bytes": made["bytes"], "seconds": made["seconds"], "maker_version": MAKER_VERSION}
                        sidecar(f16_path).write_text(json.dumps(f16_facts))
                    log(f"[models] llama-quantize {f16_path.name} -> {path.name} ...")
                    q = quantize_file(f16_path, path, qtype, qbin, threads)
                    facts = {"make_seconds": f16_facts["seconds"] + q["seconds"], "write_seconds": f16_facts["seconds"],
                             "quantize_seconds": q["seconds"], "f16_bytes": f16_facts["bytes"]}
            except Exception as exc:  # noqa: BLE001 - one file that cannot be made is reported
                out[(size, qtype)] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                continue
            facts.update({"maker": maker, "maker_version": MAKER_VERSION, "bytes": path.stat().st_size,
                          "shape": asdict(shape), "type": qtype, "made_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            sidecar(path).write_text(json.dumps(facts, indent=1))
            out[(size, qtype)] = {**facts, "path": str(path), "cached": False}
        if f16_path.exists() and not keep_f16:
            f16_path.unlink()
            sidecar(f16_path).unlink(missing_ok=True)
    return out
