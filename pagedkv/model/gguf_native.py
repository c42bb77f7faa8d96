"""A GGUF file's stored codes as the model's weights (``weights="gguf"``, what ``weights="auto"``
picks for a GGUF): the streaming loader and its two modules.

The loader never holds the model in another precision. Each linear tensor is read once from the
file (``os.preadv`` into a buffer of that tensor's size), its rows permuted where llama.cpp's
converter permuted them (Q/K of ``llama``/``mistral`` files), fused with its siblings (q/k/v,
gate/up) and repacked by ``pagedkv.model.qmm.pack_gguf`` into the integer kernels' interleaved
layout, whose size is the file's bytes for that tensor; the buffer is then dropped. So the peak
resident memory of a load is the packed weights (= the file's linear tensors) plus one fused
tensor group, and nothing is written to disk but the tokenizer's cache entry.

* ``GGUFLinear``: a linear layer on ``qmm``'s kernels for every row count (``QuantLinear.kernel``
  ``"q8"``): x float32 ``[T, in]`` quantised to int8 blocks of 32 on the fly, times the stored
  Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks with exact integer block sums. A fused layer
  whose parts are stored in different types (a ``*_K_M`` file's Q6_K ``attn_v`` beside Q4_K
  ``attn_q``) is one ``qmm.concat_packed`` weight: the activations are quantised once.
* ``GGUFEmbedding``: the token-embedding rows read from the memory-mapped file (only the rows a
  step looks up become resident) and dequantised for those rows only.

A tied LM head is packed from the embedding tensor's stored blocks (a second copy of that one
tensor, in the kernels' layout). Norms, biases and RoPE factors are small float tensors.

Raises ``ConfigError`` (naming the tensor) for a type the kernels do not take: ``supported``
says beforehand whether a file can load this way (``pagedkv.model.loader`` then keeps its older
formats). Measured in docs/benchmarks/models.md; the format is described in docs/weights.md.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import GGUFHeader, GGUFTensorInfo
from pagedkv.model import qmm
from pagedkv.model.config import ModelConfig
from pagedkv.model.families import GGUF_CONVENTIONS
from pagedkv.model.quant import QuantLinear
from pagedkv.model.quantize import linear_prefixes

log = logging.getLogger(__name__)

__all__ = ["GGUFEmbedding", "GGUFLinear", "LoadReport", "build_gguf_model", "linear_types", "supported",
           "weight_bytes"]

#: GGML types whose values are plain floats (norms, biases; an unquantised linear is refused)
_FLOAT_TYPES = ("F32", "F16", "BF16")
#: fused parts: GGUF part name -> (our module, position in the fused rows)
_FUSED = {"attn_q": ("qkv_proj", 0), "attn_k": ("qkv_proj", 1), "attn_v": ("qkv_proj", 2),
          "ffn_gate": ("gate_up_proj", 0), "ffn_up": ("gate_up_proj", 1)}
_SINGLE = {"attn_output": "o_proj", "ffn_down": "down_proj", "attn_qkv": "qkv_proj"}


def _qtype(info: GGUFTensorInfo) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(info.ggml_type).name
    except ValueError:
        raise ConfigError(f"weights: {info.name} has unknown GGML type {info.ggml_type}") from None


def _is_linear(info: GGUFTensorInfo) -> bool:
    """A 2-D matrix that one of our linear layers (or the LM head / embedding) multiplies."""
    return len(info.shape) == 2 and (info.name.startswith("blk.") or info.name in ("output.weight",
                                                                                   "token_embd.weight"))


def linear_types(header: GGUFHeader) -> dict[str, int]:
    """``{GGML type name: count}`` of the file's 2-D weight matrices (layers, head, embedding)."""
    out: dict[str, int] = {}
    for t in header.tensors:
        if _is_linear(t):
            out[_qtype(t)] = out.get(_qtype(t), 0) + 1
    return out


def supported(header: GGUFHeader) -> str | None:
    """``None`` when every weight matrix of the file is stored in a type ``qmm.pack_gguf``
    multiplies (``qmm.GGUF_TYPES``) and the kernels are built here; else why not (a sentence)."""
    if qmm.get() is None:
        return f"the integer kernels are not built here ({qmm.build_error() or 'PAGEDKV_QMM=0'})"
    other = sorted(set(linear_types(header)) - set(qmm.GGUF_TYPES))
    if other:
        return f"weight matrices stored as {', '.join(other)}, which the GGUF kernels do not multiply " \
               f"(they take {', '.join(qmm.GGUF_TYPES)})"
    return None


def weight_bytes(header: GGUFHeader, config: ModelConfig) -> int:
    """Bytes the loaded weights will hold in memory: each matrix's stored bytes (packing keeps
    them), a tied head the embedding's bytes once more, float tensors as float32; the embedding
    itself stays in the file's page cache and is not counted."""
    total = 0
    for t in header.tensors:
        if t.name == "token_embd.weight":
            total += _nbytes(t) if config.tie_word_embeddings else 0
        elif _qtype(t) in _FLOAT_TYPES:
            total += int(np.prod(t.shape, dtype=np.int64)) * 4
        else:
            total += _nbytes(t)
    return total


class GGUFLinear(QuantLinear):
    """A linear layer on a GGUF file's stored blocks: ``packed`` (``qmm.Packed``, the
    interleaved layout of ``qmm.pack_gguf`` or a ``qmm.concat_packed`` of several) with its
    bias. ``forward(x [T, in]) -> [T, out]`` in ``x``'s dtype through ``qmm`` at every ``T``
    (route ``fast``); route ``fallback`` dequantises the blocks and calls ``F.linear``.
    ``types``: the GGML type names of its parts (for logs). Holds no portable state dict: a
    deep copy shares the (read-only) packed weights."""

    fmt = "gguf"

    def __init__(self, packed: qmm.Packed, types: tuple[str, ...]) -> None:
        super().__init__(packed.k, packed.n)
        self.packed, self.types = packed, types
        if packed.bias is not None:
            self.bias = packed.bias

    def dequantize(self) -> torch.Tensor:
        ops = qmm.get()
        if ops is None:
            raise RuntimeError("GGUFLinear: the integer kernels are not built")
        return ops.dequantize(self.packed)

    def prepare(self, route: str | None = None) -> "GGUFLinear":
        super().prepare(route)
        return self

    def _prepare_qmm(self) -> None:
        """Every row count runs the integer kernels on the fast route (there is no other
        kernel of this format to hand large inputs to)."""
        from pagedkv.model import quant
        from pagedkv.model.int8_mm import register_int8

        ops = qmm.get() if self.route == "fast" else None
        self._qmm, self.qmm_rows = (self.packed, qmm.ALL_ROWS) if ops is not None else (None, 0)
        if ops is not None:
            quant._QMM = ops
            if getattr(self, "int8_key", None) is None:
                self.int8_key = register_int8(self)

    def _has_bf16_kernel(self) -> bool:
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qmm_rows:  # the bias is in the packed weights
            return super().forward(x)
        y = torch.nn.functional.linear(x.float(), self.dequantize())
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def __deepcopy__(self, memo: dict[int, Any]) -> "GGUFLinear":
        return GGUFLinear(self.packed, self.types).prepare(self.route)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, types={'+'.join(self.types)}, route={self.route}"


class GGUFEmbedding(nn.Module):
    """Token embeddings read from the GGUF file's memory map: ``forward(ids int64 [T])`` ->
    float32 ``[T, H]`` (a fresh tensor), the looked-up rows dequantised by ``gguf.dequantize``.
    Raises ``IndexError`` for an id outside ``[0, num_embeddings)``. Holds the map open;
    ``close()`` releases it. ``num_embeddings``/``embedding_dim`` as ``nn.Embedding``."""

    def __init__(self, path: Path, info: GGUFTensorInfo) -> None:
        super().__init__()
        import gguf

        self.qtype = gguf.GGMLQuantizationType(info.ggml_type)
        self.num_embeddings, self.embedding_dim = info.shape
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        self.row_bytes = self.embedding_dim // block * size
        self._file = open(path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._rows = np.frombuffer(self._map, dtype=np.uint8, count=self.row_bytes * self.num_embeddings,
                                   offset=info.offset).reshape(self.num_embeddings, self.row_bytes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        import gguf

        ids = input_ids.detach().cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = gguf.dequantize(self._rows[ids], self.qtype)
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).reshape(-1, self.embedding_dim)

    def close(self) -> None:
        self._rows = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive; the map goes with the last one
            pass
        self._file.close()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.qtype.name} (memory-mapped)"


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

    def summary(self) -> str:
        rate = self.bytes_read / max(self.seconds, 1e-9) / 1e9
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(self.types.items()))
        return (f"{self.tensors} tensors, {self.bytes_read / 1e9:.2f} GB read in {self.seconds:.1f} s "
                f"({rate:.2f} GB/s); weights in memory {self.weight_bytes / 1e9:.2f} GB ({kinds})")


def _read(f: Any, info: GGUFTensorInfo) -> tuple[str, np.ndarray]:
    """``(type name, uint8 [rows, row_bytes])`` of a 2-D (or 1-D: one row) tensor, read into a
    buffer of its own. Raises ``ConfigError`` for a truncated file or a partial block."""
    import gguf

    name = _qtype(info)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
    *outer, inner = info.shape
    if inner % block:
        raise ConfigError(f"weights: {info.name} row length {inner} is not whole {name} blocks")
    rows = int(np.prod(outer, dtype=np.int64)) if outer else 1
    buf = np.empty((rows, inner // block * size), dtype=np.uint8)
    if f.readinto_at(buf, info.offset) != buf.nbytes:
        raise ConfigError(f"weights: {info.name} extends past the end of the GGUF file (truncated?)")
    return name, buf


class _File:
    """A GGUF file opened for positioned reads."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)

    def readinto_at(self, buf: np.ndarray, offset: int) -> int:
        view, done = memoryview(buf).cast("B"), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done

    def close(self) -> None:
        os.close(self.fd)


def _floats(name: str, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    import gguf

    values = gguf.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType[name])
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def _unpermute_rows(raw: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation on stored rows (``weights._unpermute_rope_rows``
    on whole rows of blocks)."""
    rows, rb = raw.shape
    hd = rows // n_heads
    return np.ascontiguousarray(raw.reshape(n_heads, hd // 2, 2, rb).transpose(0, 2, 1, 3).reshape(rows, rb))


def _pack(parts: list[tuple[str, np.ndarray, torch.Tensor | None]], k: int, what: str) -> GGUFLinear:
    """One ``GGUFLinear`` from stored parts ``(type, rows, bias)`` stacked along the output
    rows: one packed weight when all parts share a type, else a concat of each part's."""
    types = tuple(t for t, _, _ in parts)
    biases = [b for _, _, b in parts]
    bias = torch.cat(biases).float().contiguous() if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ConfigError(f"weights: {what} has a bias on some of its parts only")
    try:
        if len(set(types)) == 1:
            raw = parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts])
            packed = qmm.pack_gguf(types[0], raw, k, bias)
        else:
            packed = qmm.concat_packed([qmm.pack_gguf(t, r, k, b) for t, r, b in parts])
    except ValueError as e:
        raise ConfigError(f"weights: {what}: {e}") from None
    return GGUFLinear(packed, types)


def _layer_tensors(header: GGUFHeader) -> dict[int, list[GGUFTensorInfo]]:
    out: dict[int, list[GGUFTensorInfo]] = {}
    for t in header.tensors:
        if t.name.startswith("blk."):
            out.setdefault(int(t.name.split(".")[1]), []).append(t)
    return out


def _norm_name(arch: str, rest: str) -> str | None:
    from pagedkv.model.weights import _gguf_layer_name

    return _gguf_layer_name(arch, rest)


def build_gguf_model(path: Path, header: GGUFHeader, config: ModelConfig, route: str | None = None,
                     progress: bool | None = None) -> tuple[nn.Module, LoadReport]:
    """A float32 ``LlamaForCausalLM`` for the GGUF at ``path`` whose linear layers are
    ``GGUFLinear`` on the stored blocks and whose embedding is a ``GGUFEmbedding``, streamed
    tensor by tensor (module doc). ``progress``: a tqdm bar over the bytes read (``None``: on a
    terminal only). Returns ``(model in eval mode, LoadReport)``. Raises ``ConfigError`` for an
    unsupported type (``supported``), a missing or unexpected tensor, or a truncated file."""
    from tqdm.auto import tqdm

    from pagedkv.model.llama import LlamaForCausalLM

    why = supported(header)
    if why is not None:
        raise ConfigError(f"weights 'gguf': {path.name}: {why}")
    t0 = time.perf_counter()
    conv = GGUF_CONVENTIONS[config.architecture]
    net = LlamaForCausalLM(config, dtype=torch.float32, device="cpu", materialize=False)
    by_name = {t.name: t for t in header.tensors}
    total = sum(_nbytes(t) for t in header.tensors)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}",
               disable=(None if progress is None else not progress), leave=False)
    f, read, floats = _File(path), 0, {}
    try:
        def take(info: GGUFTensorInfo) -> tuple[str, np.ndarray]:
            nonlocal read
            out = _read(f, info)
            read += out[1].nbytes
            bar.update(out[1].nbytes)
            return out

        for i, infos in sorted(_layer_tensors(header).items()):
            if i >= config.num_layers:
                raise ConfigError(f"weights: tensors of layer {i}, beyond num_layers {config.num_layers}")
            layer = net.layers[i]
            groups: dict[str, list[Any]] = {}
            for info in infos:
                rest = info.name.split(".", 2)[2]
                part, _, kind = rest.rpartition(".")
                if kind == "weight" and part in _SINGLE and not (part == "ffn_up" and conv["fused_gate_up"]):
                    qtype, raw = take(info)
                    setattr(layer, _SINGLE[part], _pack([(qtype, raw, _bias(f, by_name, info, take))],
                                                        info.shape[1], info.name).prepare(route))
                elif part == "ffn_up" and conv["fused_gate_up"] and kind == "weight":
                    qtype, raw = take(info)
                    layer.gate_up_proj = _pack([(qtype, raw, None)], info.shape[1], info.name).prepare(route)
                elif part in _FUSED and kind == "weight":
                    qtype, raw = take(info)
                    if conv["rope_rows_permuted"] and part in ("attn_q", "attn_k"):
                        raw = _unpermute_rows(raw, config.num_heads if part == "attn_q" else config.num_kv_heads)
                    groups.setdefault(_FUSED[part][0], []).append((_FUSED[part][1], qtype, raw, info))
                elif kind == "bias" and part in _FUSED:
                    continue  # taken with its weight (``_bias``)
                else:
                    ours = _norm_name(config.architecture, rest)
                    if ours is None or len(info.shape) != 1:
                        raise ConfigError(f"weights: unexpected GGUF tensor {info.name!r}")
                    qtype, raw = take(info)
                    w = _floats(qtype, raw, info.shape)
                    floats[f"layers.{i}.{ours}"] = w - 1.0 if conv["norms_plus_one"] else w
            for module, parts in groups.items():
                parts.sort(key=lambda p: p[0])
                want = 3 if module == "qkv_proj" else 2
                if len(parts) != want:
                    raise ConfigError(f"weights: layer {i} is missing parts of {module}")
                stacked = []
                for _pos, qtype, raw, info in parts:
                    b = _bias(f, by_name, info, take)
                    if b is not None and conv["rope_rows_permuted"] and info.name.endswith(("attn_q.weight",
                                                                                           "attn_k.weight")):
                        from pagedkv.model.weights import _unpermute_rope_rows

                        heads = config.num_heads if "attn_q" in info.name else config.num_kv_heads
                        b = _unpermute_rope_rows(b, heads)
                    stacked.append((qtype, raw, b))
                setattr(layer, module, _pack(stacked, parts[0][3].shape[1], f"layer {i} {module}").prepare(route))
                del stacked, parts
        top = {"output_norm.weight": "norm.weight"}
        for name, ours in top.items():
            info = by_name.get(name)
            if info is None:
                raise ConfigError(f"weights: {name} is missing")
            qtype, raw = take(info)
            w = _floats(qtype, raw, info.shape)
            floats[ours] = w - 1.0 if conv["norms_plus_one"] else w
        embd = by_name.get("token_embd.weight")
        if embd is None:
            raise ConfigError("weights: token_embd.weight is missing")
        head = by_name.get("output.weight") if not config.tie_word_embeddings else None
        head = head or embd
        qtype, raw = take(head)
        net.lm_head = _pack([(qtype, raw, None)], head.shape[1], head.name).prepare(route)
        del raw
        net.embed_tokens = GGUFEmbedding(path, embd)
        known = {"rope_freqs.weight", "output_norm.weight", "token_embd.weight", "output.weight"}
        stray = [t.name for t in header.tensors if not t.name.startswith("blk.") and t.name not in known]
        if stray:
            raise ConfigError(f"weights: unexpected GGUF tensor {stray[0]!r}")
        _assign_floats(net, floats)
    finally:
        f.close()
        bar.close()
    report = LoadReport(tensors=len(header.tensors), bytes_read=read, weight_bytes=held_bytes(net),
                        seconds=time.perf_counter() - t0, types=linear_types(header))
    return net.eval().requires_grad_(False), report


def _nbytes(info: GGUFTensorInfo) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
    return int(np.prod(info.shape, dtype=np.int64)) // block * size


def _bias(f: _File, by_name: dict[str, GGUFTensorInfo], weight: GGUFTensorInfo, take: Any) -> torch.Tensor | None:
    info = by_name.get(weight.name[: -len("weight")] + "bias")
    if info is None:
        return None
    qtype, raw = take(info)
    return _floats(qtype, raw, info.shape)


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


def check_complete(net: nn.Module, config: ModelConfig) -> None:
    """Raise ``ConfigError`` unless every linear layer of ``net`` is a ``GGUFLinear``."""
    for prefix in linear_prefixes(config):
        module = net.get_submodule(prefix[:-1])
        if not isinstance(module, GGUFLinear):
            raise ConfigError(f"weights: no stored tensor for {prefix[:-1]}")
