"""A GGUF's matrices in the kernels' layout, stored on disk once and memory-mapped back.

``weights="gguf"`` keeps a GGUF's blocks as stored, but the kernels read them 8 output columns
at a time, so the first load reorders each matrix's bytes (``qmm.pack_gguf``; none added or
dropped). That pass reads and rewrites the whole file: ~2 s for a 1 GB file on 2 cores, ~10 s
for an 8B. This cache makes it happen once per file: after the first load has built the model,
a writer thread stores every packed matrix (codes, scales, biases) in one file, and a later
load of the same file memory-maps that file and points each layer's ``qmm.Packed`` into the
mapping: nothing is read or packed at start, pages come in from the page cache at first use
(as llama.cpp's memory-mapped model), and the packed bytes are the page cache's, shared
between processes serving the same file.

Files (``<root>/packed/``, ``root`` the weight cache's, ``weight_cache.cache_root``):
``<sha>-<layout>.bin`` (the arrays, each at a 64-byte aligned offset) and ``<sha>-<layout>.json``
(its manifest: per matrix the arrays' offsets, dtypes and shapes; written last, so a manifest
names a complete file). ``sha``: 32 hex digits of the GGUF's sha256 (``weight_cache.file_identity``,
computed once per file); ``layout``: 12 hex digits of the sha256 of ``csrc/qmm.c``, whose
packers define the layout, so an edited packer never reads an old file (writing a new store
removes the same file's stores of other layouts). Size on disk: the
file's matrix bytes plus zero rows padding an output size to a multiple of 8 plus the biases
(1.0x the GGUF's linear weights; the token embedding stays in the GGUF).

A manifest that does not match the model being built (another tensor list, shapes, a file of
another size) is ignored with a warning and the matrices are packed as on a first load.
Writing is skipped (logged) when the disk has less free space than twice the bytes to write;
a failed write leaves no file behind. ``PAGEDKV_PACKED_CACHE=0`` (or ``load_model(use_cache=False)``)
turns the store off; deleting ``<root>/packed/`` is always safe (the next load writes it again). Source: issue "The models people run on CPUs" (stored
codes, a layout change cached on disk at most once and memory-mapped back).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from pagedkv.errors import ConfigError
from pagedkv.ops import qmm

__all__ = ["ENV", "PackedCache", "FORMAT_VERSION", "layout_tag", "packed_cache_enabled", "wait_for_writes"]

log = logging.getLogger("pagedkv")

#: the manifest's format; a different one is not read
FORMAT_VERSION = 1
_ALIGN = 64
_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "float32": torch.float32, "float16": torch.float16}

#: one matrix: (packed weights, GGML type names, output rows) as ``GGUFLinear`` takes them
Made = tuple[qmm.Packed, tuple[str, ...], int]


#: ``0``: no packed store is read or written (``1`` or unset: on)
ENV = "PAGEDKV_PACKED_CACHE"


def packed_cache_enabled() -> bool:
    """Whether ``$PAGEDKV_PACKED_CACHE`` leaves the store on (unset or ``1``; ``0`` turns it
    off). Raises ``ConfigError`` for another value."""
    flag = os.environ.get(ENV, "1")
    if flag not in ("0", "1"):
        raise ConfigError(f"{ENV}: must be '0' or '1' (or unset), got {flag!r}")
    return flag == "1"


_WRITERS: list[threading.Thread] = []
_WRITERS_LOCK = threading.Lock()


def wait_for_writes() -> None:
    """Wait until every store this process started writing is finished (tests, benchmarks)."""
    with _WRITERS_LOCK:
        writers = list(_WRITERS)
        _WRITERS.clear()
    for t in writers:
        t.join()


def layout_tag() -> str:
    """12 hex digits of the sha256 of ``csrc/qmm.c`` (the packers define the layout):
    ``pagedkv.ops.qmm.layout_tag``."""
    return qmm.layout_tag()


def _arrays(p: qmm.Packed) -> list[torch.Tensor]:
    out = [t for t in (p.codes, p.scale, p.bias) if t is not None]
    for part in p.parts:
        out += _arrays(part)
    return out


class PackedCache:
    """The packed-matrix store of one GGUF (module doc). ``root``: the cache root; ``sha``: the
    file's hex sha256. ``open()`` maps an existing complete store (then ``get(name)`` returns a
    matrix, or ``None``); ``write(made)`` stores the matrices of a first load in a background
    thread (``join()`` waits for it). ``hits``: matrices served from the mapping."""

    def __init__(self, root: Path, sha: str) -> None:
        self.dir = Path(root) / "packed"
        stem = f"{sha[:32]}-{layout_tag()}"
        self.bin, self.manifest = self.dir / f"{stem}.bin", self.dir / f"{stem}.json"
        self.entries: dict[str, dict[str, Any]] = {}
        self.hits = 0
        self._map: mmap.mmap | None = None
        self._writer: threading.Thread | None = None

    def open(self) -> bool:
        """Map the store if a complete one exists; ``True`` when it did. A damaged or
        mismatched store is logged and ignored (``False``)."""
        try:
            meta = json.loads(self.manifest.read_text())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:
            log.warning("pagedkv: packed weights %s unreadable (%s); packing again", self.manifest, e)
            return False
        try:
            if meta.get("format") != FORMAT_VERSION or not isinstance(meta.get("entries"), dict):
                raise ValueError("another format")
            with open(self.bin, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != meta.get("size") or size == 0:
                    raise ValueError(f"{size} bytes, the manifest says {meta.get('size')}")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: never written
        except (OSError, ValueError) as e:
            log.warning("pagedkv: packed weights %s unusable (%s); packing again", self.bin, e)
            return False
        self.entries = meta["entries"]
        return True

    def _tensor(self, spec: list[Any] | None) -> torch.Tensor | None:
        if spec is None:
            return None
        off, dtype, shape = spec
        dt = _DTYPES[dtype]
        count = 1
        for s in shape:
            count *= s
        t = torch.frombuffer(self._map, dtype=dt, count=count, offset=off)
        return t.view(shape)

    def _packed(self, spec: dict[str, Any]) -> qmm.Packed:
        parts = [self._packed(p) for p in spec.get("parts", ())]
        p = qmm.Packed(spec["fmt"], spec["n"], spec["k"], self._tensor(spec.get("codes")),
                       self._tensor(spec.get("scale")), self._tensor(spec.get("bias")), parts)
        p.keep = self._map  # the mapping lives as long as a matrix in it
        return p

    def get(self, name: str, k: int, types: tuple[str, ...] | None = None) -> Made | None:
        """The stored matrix ``name`` (``(Packed, types, output rows)``) over the mapping, or
        ``None`` when the store has none of that name, or one of other ``k`` input features or
        GGML ``types`` (when given)."""
        spec = self.entries.get(name) if self._map is not None else None
        if spec is None or spec["k"] != k or (types is not None and tuple(spec["types"]) != tuple(types)):
            return None
        self.hits += 1
        return self._packed(spec), tuple(spec["types"]), int(spec["rows"])

    def write(self, made: dict[str, Made]) -> None:
        """Store ``made`` (matrix name -> ``(Packed, types, output rows)``) in a background
        thread (not a daemon: an exiting process finishes the file first). The manifest is
        written after the arrays are on disk (``fsync``), both through temporary names."""
        if not made:
            return
        self._writer = threading.Thread(target=self._write, args=(made,), name="pagedkv-packed-cache")
        with _WRITERS_LOCK:
            _WRITERS[:] = [t for t in _WRITERS if t.is_alive()] + [self._writer]
        self._writer.start()

    def join(self) -> None:
        """Wait for ``write``'s thread, if any."""
        if self._writer is not None:
            self._writer.join()

    def _write(self, made: dict[str, Made]) -> None:
        layout: list[tuple[int, torch.Tensor]] = []
        off = 0

        def place(t: torch.Tensor | None) -> list[Any] | None:
            nonlocal off
            if t is None:
                return None
            off = -(-off // _ALIGN) * _ALIGN
            spec = [off, str(t.dtype).removeprefix("torch."), list(t.shape)]
            layout.append((off, t.contiguous()))
            off += t.numel() * t.element_size()
            return spec

        def describe(p: qmm.Packed) -> dict[str, Any]:
            d: dict[str, Any] = {"fmt": p.fmt, "n": p.n, "k": p.k, "codes": place(p.codes),
                                 "scale": place(p.scale), "bias": place(p.bias)}
            if p.parts:
                d["parts"] = [describe(q) for q in p.parts]
            return d

        entries = {}
        for name, (p, types, rows) in made.items():
            entries[name] = {**describe(p), "types": list(types), "rows": rows}
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp_bin, tmp_json = self.bin.with_name(self.bin.name + tag), self.manifest.with_name(self.manifest.name + tag)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.dir).free
            if free < 2 * off:
                log.warning("pagedkv: not storing packed weights (%.2f GB) in %s: %.2f GB free",
                            off / 1e9, self.dir, free / 1e9)
                return
            fd = os.open(tmp_bin, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for o, t in layout:
                    view = memoryview(t.view(torch.uint8).reshape(-1).numpy())
                    done = 0
                    while done < len(view):
                        done += os.pwrite(fd, view[done:], o + done)
                os.ftruncate(fd, off)
                os.fsync(fd)
            finally:
                os.close(fd)
            tmp_json.write_text(json.dumps({"format": FORMAT_VERSION, "size": off, "entries": entries}))
            os.replace(tmp_bin, self.bin)
            os.replace(tmp_json, self.manifest)
            log.info("pagedkv: stored packed weights (%.2f GB) in %s", off / 1e9, self.bin)
            self._drop_other_layouts()
        except OSError as e:
            log.warning("pagedkv: could not store packed weights in %s (%s)", self.dir, e)
        finally:
            for p in (tmp_bin, tmp_json):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass

    def _drop_other_layouts(self) -> None:
        """Delete this file's stores of other layouts (an upgrade's packers made this one: the
        old ones would never be read again, a copy of the weights each). A process still
        mapping one keeps its pages until it exits."""
        stem = self.bin.name.split("-", 1)[0]
        for p in self.dir.glob(f"{stem}-*"):
            if p not in (self.bin, self.manifest) and ".tmp-" not in p.name and p.suffix in (".bin", ".json"):
                try:
                    p.unlink()
                    log.info("pagedkv: removed %s (packed weights of another layout)", p)
                except OSError:
                    pass

    def close(self) -> None:
        """Drop this object's reference to the mapping (matrices built from it keep it)."""
        self._map = None
