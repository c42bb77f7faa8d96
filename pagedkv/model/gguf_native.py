"""A GGUF file's stored codes as the model's weights (``weights="gguf"``, what ``weights="auto"``
picks for a GGUF): the streaming loader and its two modules.

The loader never holds the model in another precision. Each linear tensor is read once from the
file (``os.preadv``), its rows permuted where llama.cpp's converter permuted them (Q/K of
``llama``/``mistral`` files), stacked with its siblings (q/k/v, gate/up: read straight into one
buffer) and repacked by ``pagedkv.ops.qmm.pack_gguf`` into the integer kernels' interleaved
layout, whose size is the file's bytes for that tensor; a single matrix (the LM head,
``ffn_down``) is read and packed 4096 rows at a time (``qmm.pack_gguf_rows``). So the peak
resident memory of a load is the packed weights (= the file's matrices) plus one fused group,
and nothing is written to disk but the tokenizer's cache entry.

* ``GGUFLinear``: a linear layer on ``qmm``'s kernels for every row count (``QuantLinear.kernel``
  ``"q8"``): x float32 ``[T, in]`` quantised to int8 blocks of 32 on the fly, times the stored
  Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 blocks with exact integer block sums (F16
  matrices: their half values as stored times the float32 activations as given). A fused layer
  whose parts are stored in different types (a ``*_K_M`` file's Q6_K ``attn_v`` beside Q4_K
  ``attn_q``) is one ``qmm.concat_packed`` weight: the activations are quantised once.
* Mixture-of-experts files (``qwen3moe``, ``gpt-oss``, llama.cpp's stacked ``ffn_*_exps``
  tensors): one ``GGUFLinear`` per expert matrix, packed from that expert's stored rows with
  its bias if any (``pagedkv.model.gguf_moe``); the F32 router becomes a float ``nn.Linear``.
* DeepSeek-V2/V3 files (``deepseek2``): the MLA projections and shared experts on their stored
  blocks, ``kv_b_proj`` re-joined from ``attn_k_b`` / ``attn_v_b`` as a float tensor
  (``pagedkv.model.gguf_mla``).
* ``GGUFEmbedding``: the token-embedding rows read from the memory-mapped file (only the rows a
  step looks up become resident) and dequantised for those rows only.

A tied LM head is packed from the embedding tensor's stored blocks (a second copy of that one
tensor, in the kernels' layout). Norms, biases and RoPE factors are small float tensors.

Raises ``ConfigError`` (naming the tensor) for a type the kernels do not take: ``supported``
says beforehand whether a file can load this way (``pagedkv.model.loader`` then keeps its older
formats). Measured in docs/benchmarks/models.md; the format is described in docs/weights.md.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import GGUFHeader, GGUFTensorInfo
from pagedkv.model import gguf_mla, gguf_moe, gguf_shard
from pagedkv.ops import qmm
from pagedkv.model.config import ModelConfig
from pagedkv.model.families import GGUF_CONVENTIONS
from pagedkv.model.gguf_read import GGUFEmbedding
from pagedkv.model.gguf_read import Reader as _Reader
from pagedkv.model.gguf_read import qtype_name as _qtype
from pagedkv.model.gguf_read import stored_bytes as _nbytes
from pagedkv.model.gguf_read import tensor_rows as _rows
from pagedkv.model.packed_cache import PackedCache
from pagedkv.model.quant import QuantLinear
from pagedkv.model.tp_plan import shard_config
from pagedkv.model.weights import _gguf_layer_name, _unpermute_rope_rows

log = logging.getLogger(__name__)

__all__ = ["GGUFEmbedding", "GGUFLinear", "LoadReport", "build_gguf_model", "linear_types", "supported",
           "weight_bytes"]

#: fused parts: GGUF part name -> (our module, position in the fused rows)
_FUSED = {"attn_q": ("qkv_proj", 0), "attn_k": ("qkv_proj", 1), "attn_v": ("qkv_proj", 2),
          "ffn_gate": ("gate_up_proj", 0), "ffn_up": ("gate_up_proj", 1)}
_SINGLE = {"attn_output": "o_proj", "ffn_down": "down_proj", "attn_qkv": "qkv_proj"}
_QKV = ("attn_q", "attn_k", "attn_v")  # biases all or none (config.attention_bias)


def linear_types(header: GGUFHeader) -> dict[str, int]:
    """``{GGML type name: count}`` of the matrices the kernels multiply: every 2-D layer weight
    and the LM head (``output.weight``, or the embedding when it is tied). An untied embedding
    is only looked up (any type ``gguf`` dequantises) and is not counted."""
    head = _head_name(header)
    out: dict[str, int] = {}
    for t in header.tensors:
        if kernel_matrix(t, head):
            out[_qtype(t)] = out.get(_qtype(t), 0) + 1
    return out


def _head_name(header: GGUFHeader) -> str:
    return "output.weight" if any(t.name == "output.weight" for t in header.tensors) else "token_embd.weight"


def kernel_matrix(t: GGUFTensorInfo, head: str) -> bool:
    """Whether the kernels multiply tensor ``t`` (:func:`linear_types`' matrices): a 2-D layer
    ``.weight``, stacked experts, or the LM head ``head``; not a router, MLA's ``kv_b`` (float)
    or a bias (gpt-oss's stacked expert biases ``[E, rows]``)."""
    router = t.name.endswith(f"{gguf_moe.ROUTER}.weight")  # a float matrix, not multiplied by the kernels
    router = router or t.name.rpartition(".")[0].endswith(gguf_mla.DEQUANTISED)  # MLA's kv_b: a float tensor
    return not router and t.name.endswith(".weight") and (  # not gpt-oss's stacked expert biases [E, rows]
        (len(t.shape) == 2 and (t.name.startswith("blk.") or t.name == head))
        or (len(t.shape) == 3 and t.name.startswith("blk.")))  # stacked experts


def supported(header: GGUFHeader) -> str | None:
    """``None`` when every weight matrix of the file is stored in a type ``qmm.pack_gguf``
    multiplies (``qmm.GGUF_TYPES``) and the kernels are built here; else why not (a sentence)."""
    if qmm.get() is None:
        return f"the integer kernels are not built here ({qmm.build_error() or 'PAGEDKV_QMM=0'})"
    other = sorted(set(linear_types(header)) - set(qmm.GGUF_TYPES))
    if other:
        return f"weight matrices stored as {', '.join(other)}, which the GGUF kernels do not multiply " \
               f"(they take {', '.join(qmm.GGUF_TYPES)})"
    head = _head_name(header)
    for t in header.tensors:  # F16 rows are not blocks in the file: the kernel's 32 is checked here
        per = qmm.GGUF_BLOCKS[_qtype(t)][1] if _qtype(t) in qmm.GGUF_BLOCKS else 1
        if kernel_matrix(t, head) and int(t.shape[-1]) % per:
            return f"{t.name} ({_qtype(t)}) has rows of {int(t.shape[-1])} values, not a multiple of the kernels' {per}"
    return None


def weight_bytes(header: GGUFHeader, config: ModelConfig) -> int:
    """Bytes the loaded weights will hold in memory: each matrix's stored bytes (packing keeps
    them; F16 matrices too), a tied head the embedding's bytes once more, other float tensors as
    float32; the embedding itself stays in the file's page cache and is not counted."""
    total, head = 0, _head_name(header)
    for t in header.tensors:
        if t.name == "token_embd.weight":
            total += _nbytes(t) if config.tie_word_embeddings else 0
        elif _qtype(t) in gguf_shard.FLOAT_TYPES and not (_qtype(t) in qmm.GGUF_TYPES and kernel_matrix(t, head)):
            total += int(np.prod(t.shape, dtype=np.int64)) * 4
        else:
            total += _nbytes(t)
    return total


class GGUFLinear(QuantLinear):
    """A linear layer on a GGUF file's stored blocks: ``packed`` (``qmm.Packed``, the
    interleaved layout of ``qmm.pack_gguf`` or a ``qmm.concat_packed`` of several) with its
    bias. ``forward(x [T, in]) -> [T, out]`` in ``x``'s dtype through ``qmm`` at every ``T``
    (route ``fast``); route ``fallback`` dequantises the blocks and calls ``F.linear``.
    ``types``: the GGML type names of its parts (for logs). ``out_features``: the real output
    size when the packed rows were padded with zero rows to a multiple of 8 (the kernels' column
    group; an odd vocabulary), whose extra columns ``forward`` drops. Holds no portable state
    dict: a deep copy shares the (read-only) packed weights."""

    fmt = "gguf"

    def __init__(self, packed: qmm.Packed, types: tuple[str, ...], out_features: int | None = None) -> None:
        super().__init__(packed.k, packed.n if out_features is None else out_features)
        self.packed, self.types = packed, types
        self.padded = self.out_features != packed.n
        if packed.bias is not None:
            self.bias = packed.bias[: self.out_features]

    def dequantize(self) -> torch.Tensor:
        ops = qmm.get()
        if ops is None:
            raise RuntimeError("GGUFLinear: the integer kernels are not built")
        w = ops.dequantize(self.packed)
        return w[: self.out_features] if self.padded else w

    def _prepare_qmm(self) -> None:
        """Every row count runs the integer kernels on the fast route (there is no other
        kernel of this format to hand large inputs to)."""
        from pagedkv.model import quant
        from pagedkv.ops.int8_mm import register_int8

        ops = qmm.get() if self.route == "fast" else None
        self._qmm, self.qmm_rows = (self.packed, qmm.ALL_ROWS) if ops is not None else (None, 0)
        if ops is not None:
            quant._QMM = ops
            if getattr(self, "int8_key", None) is None:
                self.int8_key = register_int8(self)

    def _has_bf16_kernel(self) -> bool:
        return False

    def qmm_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().qmm_forward(x)
        return y[:, : self.out_features].contiguous() if self.padded else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qmm_rows:  # the bias is in the packed weights
            y = super().forward(x)
            return y[:, : self.out_features].contiguous() if self.padded else y
        y = self._linear(x.float(), self.dequantize())
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def __deepcopy__(self, memo: dict[int, Any]) -> "GGUFLinear":
        return GGUFLinear(self.packed, self.types, self.out_features).prepare(self.route)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, types={'+'.join(self.types)}, route={self.route}"


@dataclass
class LoadReport:
    """What a streaming load did: ``tensors`` read, ``bytes_read`` from the file,
    ``weight_bytes`` held by the packed weights, ``seconds`` (wall), ``types`` ``{GGML type:
    matrices}``."""

    tensors: int
    bytes_read: int
    weight_bytes: int
    seconds: float
    types: dict[str, int]
    packed_from_cache: int = 0

    def summary(self) -> str:
        """One line for the start-up log. A warm start maps the packed cache instead of reading
        the file, so it reports that (pages come in as the first steps touch them), not a rate."""
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(self.types.items()))
        held = f"weights {self.weight_bytes / 1e9:.2f} GB ({kinds})"
        if self.packed_from_cache:
            return (f"{self.tensors} tensors in {self.seconds:.1f} s: {self.packed_from_cache} matrices "
                    f"memory-mapped from the packed cache, {self.bytes_read / 1e9:.2f} GB read from the "
                    f"file; {held}")
        rate = self.bytes_read / max(self.seconds, 1e-9) / 1e9
        return (f"{self.tensors} tensors, {self.bytes_read / 1e9:.2f} GB read in {self.seconds:.1f} s "
                f"({rate:.2f} GB/s); {held} in memory")


def _unpermute_into(raw: np.ndarray, n_heads: int, out: np.ndarray) -> None:
    """Invert llama.cpp's Q/K row permutation on stored rows (``weights._unpermute_rope_rows``,
    which the fp32 path applies to values, applied to whole rows of blocks), into ``out``."""
    out[...] = _unpermute_rope_rows(torch.from_numpy(raw), n_heads).numpy()


def _packed(reader: _Reader, parts: list[tuple[GGUFTensorInfo, int | None, GGUFTensorInfo | None]],
            what: str, cut: gguf_shard.Cut | None = None) -> tuple[qmm.Packed, tuple[str, ...], int]:
    """``(packed weights, GGML type names, output rows)`` from stored parts ``(weight, heads to
    un-permute or None, bias or None)`` stacked along the output rows. Parts of one type are
    read straight into one buffer (zero rows pad it to a multiple of 8) and packed once; parts of
    different types are packed each and concatenated (``qmm.concat_packed``; each must be a
    multiple of 8 rows). ``cut``: a tensor-parallel rank's rows and columns only
    (``gguf_shard``). Touches no shared state but ``reader`` (safe on loader threads)."""
    types = tuple(_qtype(w) for w, _, _ in parts)
    k = parts[0][0].shape[-1]
    if any(w.shape[-1] != k for w, _, _ in parts):
        raise ConfigError(f"weights: {what}: parts of different input sizes")
    biases = [None if b is None else reader.floats(b) for _, _, b in parts]
    if any(b is not None for b in biases) and any(b is None for b in biases):
        raise ConfigError(f"weights: {what} has a bias on some of its parts only")
    for i, ((w, heads, _), b) in enumerate(zip(parts, biases)):
        if b is not None and heads is not None:
            biases[i] = _unpermute_rope_rows(b, heads)

    def read(w: GGUFTensorInfo, heads: int | None, out: np.ndarray) -> None:
        if heads is None:
            reader.into(w, out)
        else:
            _unpermute_into(reader.take(w), heads, out)

    if cut is not None and (cut.rows is not None or len(parts) > 1 or parts[0][1] is not None or biases[0] is not None):
        pieces = [(w, _rows(w)[0], functools.partial(read, w, heads)) for w, heads, _ in parts]
        return gguf_shard.packed_cut(pieces, biases, k, cut, what)
    try:
        if len(parts) == 1 and parts[0][1] is None:  # one stored matrix: packed a chunk of rows at a time
            w, n = parts[0][0], _rows(parts[0][0])[0]
            pad = -n % 8
            bias = None if biases[0] is None else torch.cat([biases[0], torch.zeros(pad)]).float().contiguous()
            take = (lambda r0, r1: reader.rows(w, r0, r1)) if cut is None else (
                lambda r0, r1: cut.take_cols(w, reader.rows(w, r0, r1)))  # a row-parallel rank's columns
            packed = qmm.pack_gguf_rows(types[0], n + pad, k if cut is None else cut.width(k), take, bias)
        elif len(set(types)) == 1:
            sizes = [_rows(w) for w, _, _ in parts]
            n = sum(r for r, _ in sizes)
            buf = np.empty((n + (-n % 8), sizes[0][1]), dtype=np.uint8)
            buf[n:] = 0  # zero blocks: d = 0, values 0
            r0 = 0
            for (w, heads, _), (rows, _rb) in zip(parts, sizes):
                read(w, heads, buf[r0:r0 + rows])
                r0 += rows
            bias = None
            if biases[0] is not None:
                bias = torch.cat([*biases, torch.zeros(buf.shape[0] - n)]).float().contiguous()
            packed = qmm.pack_gguf(types[0], buf, k, bias)
            del buf
        else:
            n, packs = 0, []
            for (w, heads, _), b in zip(parts, biases):
                rows, rb = _rows(w)
                buf = np.empty((rows, rb), dtype=np.uint8)
                read(w, heads, buf)
                packs.append(qmm.pack_gguf(_qtype(w), buf, k, None if b is None else b.float().contiguous()))
                n += rows
                del buf
            packed = qmm.concat_packed(packs)
    except ValueError as e:
        raise ConfigError(f"weights: {what}: {e}") from None
    return packed, types, n


def _layer_tensors(header: GGUFHeader) -> dict[int, list[GGUFTensorInfo]]:
    out: dict[int, list[GGUFTensorInfo]] = {}
    for t in header.tensors:
        if t.name.startswith("blk."):
            out.setdefault(int(t.name.split(".")[1]), []).append(t)
    return out


def build_gguf_model(path: Path, header: GGUFHeader, config: ModelConfig, route: str | None = None,
                     progress: bool | None = None, lazy_experts: bool | None = None,
                     packed_cache: PackedCache | None = None, shard: Any = None) -> tuple[nn.Module, LoadReport]:
    """A float32 ``LlamaForCausalLM`` for the GGUF at ``path`` whose linear layers are
    ``GGUFLinear`` on the stored blocks and whose embedding is a ``GGUFEmbedding``, streamed
    tensor by tensor (module doc). ``progress``: a tqdm bar over the bytes read (``None``: on a
    terminal only). ``lazy_experts`` (``None``: ``PAGEDKV_LAZY_EXPERTS=1``): a mixture of
    experts' matrices are read at their first use (``gguf_moe.LazyExpertLinear``).
    ``packed_cache`` (``pagedkv.model.packed_cache``, opened): matrices it holds are mapped from
    it instead of read and packed; when it did not hold them all, the packed matrices are stored
    in it (a background thread) for the next load. ``shard``: a tensor-parallel rank's
    ``TPShard``: the model of its heads and columns (``gguf_shard``; no packed cache). Returns
    ``(model in eval mode, LoadReport)``. Raises ``ConfigError`` for an
    unsupported type (``supported``), a missing or unexpected tensor, a truncated file, or a
    ``PAGEDKV_LAZY_EXPERTS`` other than ``0`` / ``1``."""
    from tqdm.auto import tqdm

    from pagedkv.model.llama import LlamaForCausalLM

    why = supported(header)
    if why is not None:
        raise ConfigError(f"weights 'gguf': {path.name}: {why}")
    gguf_moe.check_expert_counts(header.tensors, config.num_experts)  # before the expert modules are built
    t0 = time.perf_counter()
    conv = GGUF_CONVENTIONS[config.architecture]
    if shard is not None:
        why, packed_cache = gguf_shard.tp_problem(header, config, shard.tp_size), None
        if why is not None:
            raise ConfigError(f"weights 'gguf' with tensor_parallel_size {shard.tp_size}: {why}")
    net = LlamaForCausalLM(config if shard is None else shard_config(config, shard), dtype=torch.float32,
                           device="cpu", materialize=False)
    by_name = {t.name: t for t in header.tensors}
    bar = tqdm(total=sum(_nbytes(t) for t in header.tensors), unit="B", unit_scale=True,
               desc=f"loading {path.name}", disable=(None if progress is None else not progress), leave=False)
    reader, floats = _Reader(path, bar), {}
    if lazy_experts is None:
        flag = os.environ.get("PAGEDKV_LAZY_EXPERTS", "0")
        if flag not in ("0", "1"):
            raise ConfigError(f"PAGEDKV_LAZY_EXPERTS: must be '0' or '1' (or unset), got {flag!r}")
        lazy_experts = flag == "1"
    lazy_reader = None
    if lazy_experts and config.num_experts:  # the experts' own reader, open while the model lives
        lazy_reader = _Reader(path)
        weakref.finalize(net, lazy_reader.close)

    def bias_of(w: GGUFTensorInfo) -> GGUFTensorInfo | None:  # every layer's as the config (layer 0) says
        b, part = by_name.get(w.name[: -len("weight")] + "bias"), w.name.split(".")[-2]
        flag = "o_proj_bias" if part == "attn_output" else "attention_bias" if part in _QKV else None
        if flag and (b is not None) != getattr(config, flag):
            raise ConfigError(f"weights: {w.name[: -len('weight')]}bias is {'unexpected' if b else 'missing'} "
                              f"(the config's {flag} is {getattr(config, flag)})")
        return b

    # (module, attribute, future of _packed): every matrix is read and packed on two threads
    # (positioned reads and the C packers release the GIL, so one thread reads while the other
    # packs); the modules are made and prepared here, in file order
    jobs: list[tuple[nn.Module, str, str, Any]] = []
    pool = ThreadPoolExecutor(2, thread_name_prefix="pagedkv-load")

    def submit(name: str, k: int, types: tuple[str, ...] | None, fn: Any, *args: Any) -> Any:
        hit = packed_cache.get(name, k, types) if packed_cache is not None else None
        if hit is None:
            return pool.submit(fn, *args)
        done: Future = Future()
        done.set_result(hit)
        return done

    def later(owner: nn.Module, attr: str, parts: list, what: str) -> None:
        k, types = parts[0][0].shape[-1], tuple(_qtype(w) for w, _, _ in parts)
        cut = None if owner is net else gguf_shard.module_cut(config, shard, attr)
        jobs.append((owner, attr, what, submit(what, k, types, _packed, reader, parts, what, cut)))

    try:
        for i, infos in sorted(_layer_tensors(header).items()):
            if i >= config.num_layers:
                raise ConfigError(f"weights: tensors of layer {i}, beyond num_layers {config.num_layers}")
            layer, groups, experts = net.layers[i], {}, {}
            mla = gguf_mla.LayerParts(layer, i, config, later, reader.values, floats) if config.is_mla else None
            for info in infos:
                rest = info.name.split(".", 2)[2]
                part, _, kind = rest.rpartition(".")
                if mla is not None and mla.take(part, kind, info):  # MLA and shared-expert tensors
                    continue
                if kind == "weight" and mla is None:  # a size the header does not give: an error, not a cut
                    gguf_shard.check_stored_shape(config, part, info, conv["fused_gate_up"])
                if part in gguf_moe.EXPERT_PARTS and kind in ("weight", "bias"):  # stacked experts (+ gpt-oss biases)
                    experts[part if kind == "weight" else rest] = info
                elif kind == "weight" and part == gguf_moe.ROUTER:
                    floats[f"layers.{i}.mlp.router.weight"] = reader.floats(info)
                elif kind == "bias" and (part in _FUSED or part in _SINGLE):
                    continue  # read with its weight
                elif kind == "weight" and part == "ffn_up" and conv["fused_gate_up"]:  # Phi-3: gate and up rows
                    later(layer, "gate_up_proj", [(info, None, None)], info.name)
                elif kind == "weight" and part in _SINGLE:
                    later(layer, _SINGLE[part], [(info, None, bias_of(info))], info.name)
                elif kind == "weight" and part in _FUSED:
                    heads = None
                    if conv["rope_rows_permuted"] and part in ("attn_q", "attn_k"):
                        heads = config.num_heads if part == "attn_q" else config.num_kv_heads
                    module, pos = _FUSED[part]
                    groups.setdefault(module, {})[pos] = (info, heads, bias_of(info))
                else:
                    ours = _gguf_layer_name(config.architecture, rest)
                    if ours is None or len(info.shape) != 1:
                        raise ConfigError(f"weights: unexpected GGUF tensor {info.name!r}")
                    w = reader.floats(info)
                    floats[f"layers.{i}.{ours}"] = w - 1.0 if conv["norms_plus_one"] else w
            if mla is not None:
                mla.finish()
            expert_jobs = gguf_moe.expert_jobs(layer, experts, i, config.num_experts,
                                               lambda m: gguf_shard.module_cut(config, shard, m, 1)) if experts else ()
            for owner, attr, (fn, *args) in expert_jobs:
                if lazy_reader is not None:
                    old = getattr(owner, attr)
                    make = functools.partial(_made, fn, lazy_reader, args, route)
                    setattr(owner, attr, gguf_moe.LazyExpertLinear(make, old.in_features, old.out_features))
                else:
                    jobs.append((owner, attr, args[-1], submit(args[-1], getattr(owner, attr).in_features, None,
                                                               fn, reader, *args)))
            for module, parts in groups.items():
                want = 3 if module == "qkv_proj" else 2
                if sorted(parts) != list(range(want)):
                    raise ConfigError(f"weights: layer {i} is missing parts of {module}")
                later(layer, module, [parts[p] for p in range(want)], f"layer {i} {module}")
        info = by_name.get("output_norm.weight")
        if info is None:
            raise ConfigError("weights: output_norm.weight is missing")
        w = reader.floats(info)
        floats["norm.weight"] = w - 1.0 if conv["norms_plus_one"] else w
        embd = by_name.get("token_embd.weight")
        if embd is None:
            raise ConfigError("weights: token_embd.weight is missing")
        head = (by_name.get("output.weight") if not config.tie_word_embeddings else None) or embd
        later(net, "lm_head", [(head, None, None)], head.name)
        made: dict[str, Any] = {}
        for owner, attr, name, fut in jobs:
            if name in made:  # two matrices of one name: the store could not tell them apart
                packed_cache = None
            made[name] = fut.result()
            setattr(owner, attr, GGUFLinear(*made[name]).prepare(route))
        net.embed_tokens = GGUFEmbedding(path, embd)
        known = {"rope_freqs.weight", "output_norm.weight", "token_embd.weight", "output.weight"}
        stray = [t.name for t in header.tensors if not t.name.startswith("blk.") and t.name not in known]
        if stray:
            raise ConfigError(f"weights: unexpected GGUF tensor {stray[0]!r}")
        _assign_floats(net, floats)
        if packed_cache is not None and packed_cache.hits < len(made):
            packed_cache.write(made)  # a first load (or a store that did not match): for the next one
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # no thread reads a closed file
        reader.close()
        bar.close()
    report = LoadReport(tensors=len(header.tensors), bytes_read=reader.read, weight_bytes=held_bytes(net),
                        seconds=time.perf_counter() - t0, types=linear_types(header),
                        packed_from_cache=0 if packed_cache is None else packed_cache.hits)
    return net.eval().requires_grad_(False), report


def _made(fn: Any, reader: _Reader, args: tuple, route: str | None) -> GGUFLinear:
    """A lazy expert's ``GGUFLinear`` (``gguf_moe.LazyExpertLinear``): ``fn(reader, *args)``'s packed rows."""
    return GGUFLinear(*fn(reader, *args)).prepare(route)


def _assign_floats(net: nn.Module, floats: dict[str, torch.Tensor]) -> None:
    """Give the model's remaining (meta) parameters their tensors; raises ``ConfigError``
    for a missing, unexpected or mis-shaped one."""
    params = dict(net.named_parameters())
    missing = sorted(k for k, p in params.items() if p.is_meta and k not in floats)
    unexpected = sorted(k for k in floats if k not in params)
    if missing or unexpected:
        raise ConfigError(f"weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for k, v in floats.items():
        if tuple(v.shape) != tuple(params[k].shape):
            raise ConfigError(f"weights: {k} has shape {tuple(v.shape)}, expected {tuple(params[k].shape)}")
    net.load_state_dict(floats, strict=False, assign=True)
    left = [k for k, p in net.named_parameters() if p.is_meta]
    if left:
        raise ConfigError(f"weights: no tensor for {left[:3]}")


def held_bytes(net: nn.Module) -> int:
    """Bytes of weights the model holds in memory: packed GGUF blocks, biases, float
    parameters (the memory-mapped embedding rows are the page cache's)."""
    seen: set[int] = set()
    total = 0
    for m in net.modules():
        if isinstance(m, GGUFLinear) and id(m.packed) not in seen:
            seen.add(id(m.packed))
            total += m.packed.nbytes
    return total + sum(p.numel() * p.element_size() for p in net.parameters())


def iter_linears(net: nn.Module) -> Iterator[GGUFLinear]:
    for m in net.modules():
        if isinstance(m, GGUFLinear):
            yield m
