"""The one GGUF header reader: key/value metadata and the tensor table, never tensor data.

Used by ``pagedkv.kv.spec`` (``pagedkv plan --model x.gguf``) and by ``pagedkv.model``
(``ModelConfig`` and weight loading); it sits beside ``utils`` at the bottom of the layers and
imports nothing of pagedkv but ``errors`` and ``utils``.

Why not ``gguf.GGUFReader``: it builds numpy views of every part of every field, so on the
bundled SmolLM2 GGUF (a 49,152-token vocabulary and its merges) reading the header takes
about 2.7 s; this reader takes about 10 ms (median of 7 runs each).
Little-endian GGUF v2 and v3 only.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.utils import cdiv

GGUF_MAGIC = b"GGUF"
# GGUF value type id -> struct format of one scalar / numpy dtype of an array of them.
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
#: arrays up to this length come back as Python lists; longer ones as numpy arrays (numbers)
#: or an undecoded ``GGUFStringArray`` (strings, e.g. the tokenizer's vocabulary).
SMALL_ARRAY = 256

#: ggml's tensor types (``ggml.h``'s ``enum ggml_type``, as ``gguf.GGMLQuantizationType`` and
#: ``gguf.GGML_QUANT_SIZES`` give them): id -> (name, values per block, bytes per block), so
#: reading a header's types needs no ``gguf`` import (~65 ms of a start); an id not here goes
#: to ``gguf`` (pagedkv.model.gguf_read.qtype_name)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}


#: token texts whose index a large string array records as it is skipped (``GGUFStringArray.found``):
#: gpt-oss's stop tokens beyond the file's ``eos`` key (its ``generation_config.json``'s ids)
FIND_STRINGS = frozenset({b"<|return|>", b"<|call|>", b"<|endoftext|>"})

_FIND_LENGTHS = frozenset(len(s) for s in FIND_STRINGS)


class GGUFStringArray:
    """A string array from GGUF metadata kept undecoded (only its length is needed here);
    ``found``: ``{text: first index}`` of the array's entries that are in :data:`FIND_STRINGS`."""

    def __init__(self, count: int, found: dict[str, int] | None = None) -> None:
        self.count = count
        self.found = found or {}

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"<{self.count} strings>"


@dataclass
class GGUFTensorInfo:
    """One entry of the tensor table: ``shape`` in numpy order (outermost first, i.e. GGUF's
    ``ne`` reversed), ``ggml_type`` (a ``gguf.GGMLQuantizationType`` value), ``offset``: the
    absolute byte offset of the data in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class GGUFHeader:
    """``metadata``: key -> value (int, float, bool, str, list, or see ``SMALL_ARRAY``);
    ``tensors``: the tensor table in file order."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` is a readable file starting with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


#: the last header read with ``reuse=True``: ((path, device, inode, size, mtime_ns, ctime_ns), monotonic time, header)
_LAST: list[Any] = []
#: seconds a ``reuse=True`` read may return the header read before it
REUSE_S = 10.0


def read_gguf_header(path: str | Path, reuse: bool = False) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table (memory-mapped; tensor data untouched).
    ``reuse``: return the header a ``reuse=True`` read of the same file (same path, inode,
    size, modification and change time) parsed in the last ``REUSE_S`` seconds, as one
    load's steps do (a header with a large vocabulary takes ~40 ms); treat it as read-only.

    Raises ``ConfigError`` naming the path if it cannot be opened, is not GGUF (bad magic), has
    an unsupported version or value type, or is truncated/malformed.
    """
    import time

    path = Path(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if reuse and _LAST and _LAST[0] == key and time.monotonic() - _LAST[1] < REUSE_S:
                return _LAST[2]
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                header = _parse(buf, path)
            if reuse:
                _LAST[:] = [key, time.monotonic(), header]
            return header
    except ConfigError:
        raise
    except OSError as e:
        raise ConfigError(f"model: cannot open GGUF {str(path)!r} ({e})") from None
    except (struct.error, IndexError, ValueError) as e:
        raise ConfigError(f"model: {str(path)!r} is not a readable GGUF file ({e})") from None


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (see ``read_gguf_header``). Raises ``ConfigError``."""
    return read_gguf_header(path).metadata


def _parse(buf: Any, path: Path) -> GGUFHeader:
    if buf[:4] != GGUF_MAGIC:
        raise ConfigError(f"model: {str(path)!r} is not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ConfigError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    pos = 24

    def read_str(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, p)
        if p + 8 + n > len(buf):
            raise ValueError("a string runs past the end of the file")
        return bytes(buf[p + 8 : p + 8 + n]).decode("utf-8", errors="replace"), p + 8 + n

    def read_value(vtype: int, p: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return read_str(p)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, p)
            p += 12
            if etype == _STRING:
                if count > SMALL_ARRAY:
                    found: dict[str, int] = {}
                    for i in range(count):
                        (n,) = struct.unpack_from("<Q", buf, p)
                        if n in _FIND_LENGTHS and bytes(buf[p + 8 : p + 8 + n]) in FIND_STRINGS:
                            found.setdefault(bytes(buf[p + 8 : p + 8 + n]).decode(), i)
                        p += 8 + n
                    return GGUFStringArray(count, found), p
                items = []
                for _ in range(count):
                    s, p = read_str(p)
                    items.append(s)
                return items, p
            if etype in _NP_DTYPE:
                arr = np.frombuffer(buf, dtype=_NP_DTYPE[etype], count=count, offset=p).copy()
                return (arr.tolist() if count <= SMALL_ARRAY else arr), p + arr.nbytes
            raise ConfigError(f"{path}: unsupported GGUF array element type {etype}")
        fmt = _SCALAR_FMT.get(vtype)
        if fmt is None:
            raise ConfigError(f"{path}: unsupported GGUF value type {vtype}")
        return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = read_str(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = read_value(vtype, pos + 4)

    raw_tensors = []
    for _ in range(n_tensors):
        name, pos = read_str(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        raw_tensors.append((name, tuple(reversed(dims)), ggml_type, offset))
    align = metadata.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0:
        raise ConfigError(f"{path}: general.alignment must be a positive integer, got {align!r}")
    data_start = cdiv(pos, align) * align
    tensors = [GGUFTensorInfo(n, s, t, data_start + o) for n, s, t, o in raw_tensors]
    return GGUFHeader(metadata, tensors)
