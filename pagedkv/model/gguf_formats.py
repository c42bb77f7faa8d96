"""The explicit weight formats of a GGUF file (``weights="fp32" | "bf16" | "int8" | "int4"``,
and ``weights=None``: unquantised in the model dtype), streamed tensor by tensor.

``stream_state`` builds the state dict ``pagedkv.model.loader.build_model`` takes without ever
holding the model in fp32: each of our tensors (``weights.gguf_groups``: q/k/v and gate/up
fused, Q/K rows un-permuted) is made from its stored parts a chunk of rows at a time (about
``CHUNK_BYTES`` of float32, whole heads where rows are un-permuted): the chunk's stored blocks
are read (``gguf_read.Reader``, positioned reads), dequantised (``gguf.dequantize``), converted
at once to the target (``quantize.quantize_linear`` for the linear layers, per output row;
the model dtype for the rest) and copied into the tensor's final buffer before the next chunk
is read. ``int4`` keeps a Q4_0/Q4_1 file's stored codes (``quantize.q4_code_names``); a tied
head is made from the embedding's rows in the same pass. Two threads convert two tensors at a
time (``gguf.dequantize`` and torch release the GIL in their large array operations). Chunks
are small (1 MiB): malloc reuses their buffers, where 32 MiB ones left about 0.6 GB of freed
memory resident after a 0.5B model's load, and they convert faster (cache-sized).

Every format converts each output row on its own, so the result equals converting the whole
dequantised fp32 model (``weights.gguf_state_dict`` + ``quantize.quantize_state``, the way
earlier versions loaded) bit for bit: ``tests/model/test_gguf_formats.py`` checks it. The peak
resident memory of a load is the target state plus two chunks in flight (and the model's
prepared kernel buffers afterwards). Nothing is written to disk: there is no weight cache for
these formats (measured: converting on each load costs about what reading a cached copy did,
docs/weights.md).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import GGUFHeader, GGUFTensorInfo
from pagedkv.model.config import ModelConfig
from pagedkv.model.gguf_read import Reader, dequantize_rows, stored_bytes, tensor_rows
from pagedkv.model.quant import GROUP_SIZE
from pagedkv.model.quantize import _q4_rows, linear_prefixes, q4_code_names, quantize_linear
from pagedkv.model.weights import GGUFGroup, StateDict, gguf_assemble, gguf_groups

__all__ = ["CHUNK_BYTES", "FORMATS", "StreamReport", "state_bytes", "stream_state"]

#: float32 bytes of one chunk of rows dequantised at once (at least one row / one head)
CHUNK_BYTES = 1 << 20
#: the linear formats ``stream_state`` converts to (``None``: none, every tensor in the dtype)
FORMATS = ("bf16", "int8", "int4")

#: a converter: (float32 rows or None, 4-bit code rows or None) -> {state key: converted rows}
_Convert = Callable[[torch.Tensor | None, torch.Tensor | None], dict[str, torch.Tensor]]


@dataclass
class StreamReport:
    """What ``stream_state`` did: ``tensors`` of ours made, ``bytes_read`` from the file,
    ``state_bytes`` the state holds, ``seconds`` (wall), ``fmt`` the linear format (``None``:
    unquantised) and ``dtype`` of the rest."""

    tensors: int
    bytes_read: int
    state_bytes: int
    seconds: float
    fmt: str | None
    dtype: torch.dtype

    def summary(self) -> str:
        rate = self.bytes_read / max(self.seconds, 1e-9) / 1e9
        what = self.fmt or str(self.dtype).removeprefix("torch.")
        return (f"{self.tensors} tensors as {what}, {self.bytes_read / 1e9:.2f} GB read and converted in "
                f"{self.seconds:.1f} s ({rate:.2f} GB/s); state {self.state_bytes / 1e9:.2f} GB")


def state_bytes(header: GGUFHeader, config: ModelConfig, fmt: str | None,
                dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the state ``stream_state`` will build (exactly its ``StreamReport.state_bytes``),
    from the header alone: a linear ``[out, in]`` as int8 ``out * (in + 4)``, int4 ``out * (in / 2
    + 8 * in / 32)`` (its head int8 without stored Q4 codes), bf16 ``2 * out * in``; biases
    float32; every other tensor (and every
    tensor for ``fmt=None``) in ``dtype``. The prepared kernels' buffers are not counted."""
    by_name = {t.name: t for t in header.tensors}
    linears = set(linear_prefixes(config))
    size = torch.empty(0, dtype=dtype).element_size()

    codes = q4_code_names(header, config) if fmt == "int4" else set()

    def linear(out: int, k: int, head: bool = False, source: str = "") -> int:
        kind = "int8" if fmt == "int4" and head and source not in codes else fmt  # int4's head without codes
        return {"int8": out * (k + 4), "int4": out * (k // 2 + 8 * (k // GROUP_SIZE)), "bf16": 2 * out * k}[kind]

    total = 0
    for g in gguf_groups(list(by_name), config):
        shapes = [by_name[n].shape for n, _ in g.parts]
        numel = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
        rows, k = numel // shapes[0][-1], shapes[0][-1]
        prefix, _, kind = g.name.rpartition(".")
        if fmt is not None and f"{prefix}." in linears:
            total += linear(rows, k, prefix == "lm_head", g.parts[0][0]) if kind == "weight" else 4 * numel  # bias
        else:
            total += size * numel
        if g.name == "embed_tokens.weight" and config.tie_word_embeddings and fmt is not None:
            total += linear(rows, k, True, g.parts[0][0])
    return total


def stream_state(path: Path, header: GGUFHeader, config: ModelConfig, fmt: str | None,
                 dtype: torch.dtype = torch.float32, threads: int = 2,
                 progress: bool | None = None) -> tuple[StateDict, StreamReport]:
    """The state dict of the GGUF at ``path`` in our names: linear weights in ``fmt``'s
    portable form (``"bf16" | "int8" | "int4"``: ``quantize.quantize_state``'s keys, biases
    float32, the head included when tied) or, ``fmt=None``, every tensor in ``dtype``; the rest
    (embeddings, norms) in ``dtype``. Streamed (module doc) on ``threads`` threads;
    ``progress``: a tqdm bar over the bytes read (``None``: on a terminal only). Returns
    ``(state, StreamReport)``. Raises ``ConfigError`` for an unknown ``fmt``, an unexpected or
    missing tensor, a type ``gguf`` cannot dequantise, or a truncated file."""
    from tqdm.auto import tqdm

    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"weights: cannot stream a GGUF into {fmt!r} (one of {', '.join(FORMATS)}, or None)")
    t0 = time.perf_counter()
    by_name = {t.name: t for t in header.tensors}
    groups = gguf_groups([t.name for t in header.tensors], config)
    codes = q4_code_names(header, config) if fmt == "int4" else set()
    groups.sort(key=lambda g: by_name[g.parts[0][0]].offset)  # file order: the reads run forward
    total = sum(stored_bytes(by_name[n]) for g in groups for n, _ in g.parts)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"converting {path.name}",
               disable=(None if progress is None else not progress), leave=False)
    reader = Reader(path, bar)
    state: StateDict = {}
    linears = set(linear_prefixes(config))
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="pagedkv-convert")
    try:
        jobs = [pool.submit(_make, reader, g, [by_name[n] for n, _ in g.parts],
                            _converters(g, config, linears, fmt, dtype), all(n in codes for n, _ in g.parts))
                for g in groups]
        for job in jobs:
            state.update(job.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # no thread reads a closed file
        reader.close()
        bar.close()
    report = StreamReport(tensors=len(groups), bytes_read=reader.read, state_bytes=_nbytes(state),
                          seconds=time.perf_counter() - t0, fmt=fmt, dtype=dtype)
    return state, report


def _nbytes(state: StateDict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _converters(group: GGUFGroup, config: ModelConfig, linears: set[str], fmt: str | None,
                dtype: torch.dtype) -> list[tuple[_Convert, bool]]:
    """``[(converter, needs codes)]`` of one group: its own tensor, and the tied head beside
    the embedding."""
    prefix, _, kind = group.name.rpartition(".")
    linear = fmt is not None and f"{prefix}." in linears
    out: list[tuple[_Convert, bool]] = []
    if linear and kind == "weight":
        out.append((_linear(f"{prefix}.", fmt, prefix == "lm_head"), True))
    elif linear:  # a bias: the quantised module keeps it float32
        out.append((_plain(group.name, torch.float32), False))
    else:
        out.append((_plain(group.name, dtype), False))
    if group.name == "embed_tokens.weight" and config.tie_word_embeddings and fmt is not None:
        out.append((_linear("lm_head.", fmt, True), True))
    return out


def _plain(name: str, dtype: torch.dtype) -> _Convert:
    def convert(values: torch.Tensor | None, _codes: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return {name: values.to(dtype)}
    return convert


def _linear(prefix: str, fmt: str, head: bool) -> _Convert:
    def convert(values: torch.Tensor | None, codes: torch.Tensor | None) -> dict[str, torch.Tensor]:
        module = quantize_linear(values, None, fmt, codes, head=head)
        return {prefix + k: v for k, v in module.state_dict().items()}
    return convert


def _make(reader: Reader, group: GGUFGroup, infos: list[GGUFTensorInfo], converters: list[tuple[_Convert, bool]],
          have_codes: bool) -> dict[str, torch.Tensor]:
    """One group's converted tensors, built a chunk of rows at a time into their final buffers
    (the first chunk's results give each buffer's dtype and row shape). ``have_codes``: the
    parts' stored Q4 codes are what a converter that takes codes gets (else it gets ``None``
    and converts the values). Runs on a loader thread: touches nothing shared but ``reader``."""
    import gguf

    if len(infos[0].shape) == 1:  # norms, biases: small, whole
        values = gguf_assemble(group, [reader.floats(info) for info in infos])
        out: dict[str, torch.Tensor] = {}
        for convert, _ in converters:
            out.update(convert(values, None))
        return out
    if any(len(info.shape) != 2 for info in infos):
        raise ConfigError(f"weights: {group.name}: a part is neither a vector nor a matrix")
    want_values = any(not takes or not have_codes for _, takes in converters)
    total = sum(tensor_rows(info)[0] for info in infos)
    bufs: dict[str, torch.Tensor] = {}
    row = 0
    for info, (_, heads) in zip(infos, group.parts):
        rows = tensor_rows(info)[0]
        step = max(1, CHUNK_BYTES // (4 * info.shape[-1]))
        if heads is not None:  # whole heads: the un-permutation works within a head
            head_dim = rows // heads
            step = max(head_dim, step // head_dim * head_dim)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            raw = reader.rows(info, r0, r1)
            chunk = GGUFGroup(group.name, ((info.name, None if heads is None else (r1 - r0) * heads // rows),),
                              group.plus_one)
            values = code_rows = None
            if want_values:
                values = gguf_assemble(chunk, [dequantize_rows(info, raw)])
            if have_codes:
                code_rows = gguf_assemble(chunk, [_q4_rows(gguf.GGMLQuantizationType(info.ggml_type).name, raw,
                                                           (r1 - r0, info.shape[-1]))])
            del raw
            for convert, takes in converters:
                for key, piece in convert(values, code_rows if takes else None).items():
                    if key not in bufs:
                        bufs[key] = torch.empty((total, *piece.shape[1:]), dtype=piece.dtype)
                    bufs[key][row + r0:row + r1] = piece
            del values, code_rows
        row += rows
    return bufs
