"""Positioned reads of a GGUF file's stored tensors: the one reader of tensor bytes that both
streaming loaders use (``pagedkv.model.gguf_native`` for ``weights="gguf"``,
``pagedkv.model.gguf_formats`` for the explicit formats).

``Reader`` reads with ``os.preadv`` into buffers the caller owns (no memory map), so a
tensor's bytes are this process's memory only while a buffer holds them; ``rows`` reads a
range of a matrix's rows, so a large tensor can be handled a chunk at a time. Sizes and types
come from the header (``pagedkv.gguf_header``); ``ConfigError`` names the tensor for an unknown
type, a row that is not whole blocks, or a file that ends early. ``GGUFEmbedding`` looks up
token-embedding rows in the file's memory map (only the rows a step reads become resident).
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import GGML_TYPES, GGUFTensorInfo

__all__ = ["GGUFEmbedding", "Reader", "block_size", "check_extent", "dequantize_rows", "qtype_name", "stored_bytes",
           "tensor_rows"]


def qtype_name(info: GGUFTensorInfo) -> str:
    """The GGML type name of a stored tensor (``"Q4_1"``); ``ConfigError`` for an unknown id."""
    known = GGML_TYPES.get(info.ggml_type)
    if known is not None:
        return known[0]
    import gguf

    try:
        return gguf.GGMLQuantizationType(info.ggml_type).name
    except ValueError:
        raise ConfigError(f"weights: {info.name} has unknown GGML type {info.ggml_type}") from None


def block_size(info: GGUFTensorInfo) -> tuple[int, int]:
    """``(values, bytes)`` of one block of ``info``'s type (``GGML_TYPES``, else ``gguf``'s
    table); ``ConfigError`` for an unknown type."""
    known = GGML_TYPES.get(info.ggml_type)
    if known is not None:
        return known[1], known[2]
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype_name(info)]]


def tensor_rows(info: GGUFTensorInfo) -> tuple[int, int]:
    """``(rows, bytes per row)`` of a stored tensor (a 1-D tensor is one row); ``ConfigError``
    for an unknown type or a row that is not whole blocks."""
    block, size = block_size(info)
    *outer, inner = info.shape
    if inner % block:
        raise ConfigError(f"weights: {info.name} row length {inner} is not whole {qtype_name(info)} blocks")
    return (int(np.prod(outer, dtype=np.int64)) if outer else 1), inner // block * size


def stored_bytes(info: GGUFTensorInfo) -> int:
    """Bytes of a tensor's stored blocks in the file."""
    block, size = block_size(info)
    return int(np.prod(info.shape, dtype=np.int64)) // block * size


def check_extent(tensors: list[GGUFTensorInfo], file_bytes: int) -> None:
    """``ConfigError`` naming the first of ``tensors`` whose stored bytes run past
    ``file_bytes`` (a truncated download), before anything is read or built from the file."""
    for info in tensors:
        if info.offset + stored_bytes(info) > file_bytes:
            raise ConfigError(f"weights: {info.name} extends past the end of the GGUF file (truncated?)")


def dequantize_rows(info: GGUFTensorInfo, raw: np.ndarray) -> torch.Tensor:
    """Stored rows of ``info`` (uint8 ``[n, row_bytes]``, e.g. from ``Reader.rows``) ->
    float32 ``[n, cols]`` by ``gguf.dequantize`` (a fresh tensor, or ``raw``'s memory for F32).
    Raises ``ConfigError`` for a type ``gguf`` cannot dequantise. F32, F16, BF16 and Q8_0 are
    read without ``gguf`` (:func:`direct_rows`: the same values, fewer interpreter steps)."""
    v = direct_rows(info.ggml_type, raw)
    if v is None:
        import gguf

        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        try:
            v = gguf.dequantize(raw, qtype)
        except NotImplementedError:
            raise ConfigError(f"weights: {info.name} uses {qtype.name}, which gguf cannot dequantise") from None
    return torch.from_numpy(np.require(v, dtype=np.float32, requirements=["C", "W"])).reshape(raw.shape[0], -1)


#: the GGML type ids :func:`direct_rows` reads: F32, F16, Q8_0, BF16
DIRECT_TYPES = (0, 1, 8, 30)


def direct_rows(ggml_type: int, raw: np.ndarray) -> np.ndarray | None:
    """Stored rows (uint8 ``[n, row_bytes]``) of an F32, F16, BF16 or Q8_0 tensor as float32
    values ``[n, cols]`` (a view of ``raw`` for F32), exactly what ``gguf.dequantize`` gives
    (Q8_0: each block's fp16 scale times its 32 int8 codes, one float32 product, exact);
    ``None`` for another type. A model's embedding rows take this path every step
    (``GGUFEmbedding``): ``gguf.dequantize``'s generic row grouping costs ~0.1 ms a call."""
    n = raw.shape[0]
    if ggml_type == 0:
        return raw.view(np.float32).reshape(n, -1)
    if ggml_type == 1:
        return raw.view(np.float16).astype(np.float32).reshape(n, -1)
    if ggml_type == 30:  # bf16: the high half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n, -1)
    if ggml_type == 8:  # blocks of 34 bytes: fp16 d, then 32 int8 codes
        blocks = raw.reshape(n, -1, 34)
        d = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).astype(np.float32)
        return (blocks[:, :, 2:].view(np.int8).astype(np.float32) * d).reshape(n, -1)
    return None


class Reader:
    """A GGUF file opened for positioned reads. ``read``: bytes read so far; ``bar``: a
    progress bar (tqdm-like, ``update(n)``) moved by the bytes read, or ``None``. Safe to use
    from several threads at once (positioned reads; the count is locked). ``close()`` closes
    the file."""

    def __init__(self, path: Path, bar: Any = None) -> None:
        self.fd, self.bar, self.read = os.open(path, os.O_RDONLY), bar, 0
        self._lock = threading.Lock()

    def into(self, info: GGUFTensorInfo, out: np.ndarray, skip: int = 0) -> None:
        """Read ``out``'s size of ``info``'s stored bytes, from ``skip`` bytes into it, into
        ``out`` (uint8, C-contiguous). Raises ``ConfigError`` for a truncated file."""
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], info.offset + skip + done)
            if n <= 0:
                raise ConfigError(f"weights: {info.name} extends past the end of the GGUF file (truncated?)")
            done += n
        with self._lock:
            self.read += done
            if self.bar is not None:
                self.bar.update(done)

    def rows(self, info: GGUFTensorInfo, r0: int, r1: int) -> np.ndarray:
        """Rows ``r0 .. r1 - 1`` of a stored matrix as a new uint8 ``[r1 - r0, row_bytes]``;
        rows past its end are zero blocks (value 0: the kernels' padding to a multiple of 8)."""
        rows, rb = tensor_rows(info)
        out = np.empty((r1 - r0, rb), dtype=np.uint8)
        real = max(0, min(r1, rows) - r0)
        if real:
            self.into(info, out[:real], skip=r0 * rb)
        out[real:] = 0
        return out

    def take(self, info: GGUFTensorInfo) -> np.ndarray:
        """``info``'s stored bytes as a new uint8 ``[rows, row_bytes]`` (1-D: one row)."""
        rows, rb = tensor_rows(info)
        out = np.empty((rows, rb), dtype=np.uint8)
        self.into(info, out)
        return out

    def values(self, info: GGUFTensorInfo) -> torch.Tensor:
        """A whole stored tensor dequantised (``dequantize_rows``), float32 of its shape."""
        return dequantize_rows(info, self.take(info)).reshape(info.shape)

    def floats(self, info: GGUFTensorInfo) -> torch.Tensor:
        """A small tensor (norm, bias) as float32 of its shape: ``values``."""
        return self.values(info)

    def close(self) -> None:
        os.close(self.fd)


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
        raw = self._rows[ids]
        rows = direct_rows(int(self.qtype), raw)
        if rows is None:
            rows = gguf.dequantize(raw, self.qtype)
        return torch.from_numpy(np.require(rows, dtype=np.float32, requirements=["C", "W"])).reshape(-1, self.embedding_dim)

    def close(self) -> None:
        self._rows = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive; the map goes with the last one
            pass
        self._file.close()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.qtype.name} (memory-mapped)"
