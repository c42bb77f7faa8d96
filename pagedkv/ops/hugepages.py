"""Packed weights and CPU KV caches on 2 MiB pages: what decode streams.

A decode step reads every weight byte and its context's KV blocks once. On 4 KiB pages that
stream takes a TLB miss every 4 KiB and the hardware prefetchers stop at each page's end.
Measured on an AMD EPYC Zen 4 VM (2 cores, THP on ``madvise``; ``docs/performance.md``, "2 MiB
pages"): a 2-thread read of 1 GiB ran at 26-32 GB/s on 4 KiB pages and 56-62 GB/s on 2 MiB
pages; one thread's Q4_0 GEMV over many 442 KB experts at 16 and 27 GB/s. A whole decode step
gains less (1-3% there), as it is not bound by the read rate alone.

Linux gives a process 2 MiB pages (transparent huge pages, THP) in memory it advises so
(``madvise(MADV_HUGEPAGE)``) when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``madvise`` (most distributions' default) or ``always``; never in a file's page cache, so a
memory-mapped weight file stays on 4 KiB pages. :func:`empty` hands out uint8 tensors from
private anonymous mappings whose start is 2 MiB-aligned and advised: a tensor of 16 MiB or more
gets a mapping of its own (rounded up to 4 KiB, so no page beyond its bytes is touched),
smaller ones are cut, 64-byte aligned, from shared 64 MiB regions (a MoE layer's experts are
~0.2-0.5 MB each: on their own mappings none would reach a 2 MiB page). :func:`zeros` gives a
CPU KV cache its own mapping, zero pages until first written. A mapping is unmapped when the
last tensor viewing it is gone. Huge pages are the kernel's to give: where it has
none free, the pages are 4 KiB ones and nothing else changes.

The packed weight store (``pagedkv.model.packed_cache``) is not copied here: it stays
memory-mapped, its page cache shared between processes (a kernel with large folios for the
file system, such as 6.18 on ext4, maps most of it with 2 MiB entries anyway).
``PAGEDKV_HUGE_PAGES=0`` turns this module off (:func:`empty` is ``torch.empty``, :func:`zeros`
``torch.zeros``). Not on Linux, or with THP ``never`` or absent, it is off. Source: issue "The models people run on CPUs" (decode at the weight-read limit).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import weakref

import torch

from pagedkv.errors import ConfigError

#: ``0``: plain ``torch.empty`` / ``torch.zeros`` (``1`` or unset: advised mappings where THP allows)
ENV = "PAGEDKV_HUGE_PAGES"
#: the huge page size this module aligns to (x86-64, arm64 with 4 KiB base pages)
HUGE = 2 << 20
PAGE = mmap.PAGESIZE
#: the shared regions small tensors are cut from
REGION = 64 << 20
#: tensors from this size get their own mapping
OWN_MAPPING = 16 << 20
ALIGN = 64
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
MAP_PRIVATE_ANONYMOUS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode: ``always``, ``madvise``, ``never``, or
    ``unavailable`` (no such file: not Linux, or a kernel without THP)."""
    try:
        text = open(path).read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def enabled() -> bool:
    """Whether :func:`empty` maps advised memory: Linux, THP ``madvise`` or ``always``, and
    ``PAGEDKV_HUGE_PAGES`` unset or ``1`` (``0``: off). Raises ``ConfigError`` for another value."""
    flag = os.environ.get(ENV, "1")
    if flag not in ("0", "1"):
        raise ConfigError(f"{ENV}: must be '0' or '1' (or unset), got {flag!r}")
    return sys.platform.startswith("linux") and flag == "1" and thp_mode() in ("madvise", "always")


_libc = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.mmap.restype = ctypes.c_void_p
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.munmap.restype = ctypes.c_int
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        _libc = lib
    return _libc


def _unmap(start: int, size: int) -> None:
    """munmap, except while the interpreter shuts down: a daemon thread (the engine loop, a KV
    tier) may still read the memory then, and the process's end returns it anyway."""
    if not sys.is_finalizing():
        _lib().munmap(start, size)


def _map(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a new private anonymous mapping of ``nbytes`` rounded up to 4 KiB,
    starting on a 2 MiB boundary, advised ``MADV_HUGEPAGE``; unmapped when the last tensor
    viewing it is freed. Raises ``MemoryError`` when the kernel refuses the mapping."""
    lib = _lib()
    size = -(-nbytes // PAGE) * PAGE
    raw = lib.mmap(None, size + HUGE, PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS, -1, 0)
    if raw is None or raw == ctypes.c_void_p(-1).value:
        raise MemoryError(f"mmap of {size + HUGE} bytes failed (errno {ctypes.get_errno()})")
    start = -(-raw // HUGE) * HUGE  # the slack before and after the aligned range goes back
    if start > raw:
        lib.munmap(raw, start - raw)
    if raw + size + HUGE > start + size:
        lib.munmap(start + size, raw + size + HUGE - start - size)
    lib.madvise(start, size, MADV_HUGEPAGE)  # advice: a failure leaves 4 KiB pages
    owner = (ctypes.c_uint8 * size).from_address(start)
    weakref.finalize(owner, _unmap, start, size).atexit = False
    return torch.frombuffer(owner, dtype=torch.uint8)  # holds owner: the mapping lives while a view does


class _Regions:
    """The shared regions small tensors are cut from (one open at a time, thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.region: torch.Tensor | None = None
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            if self.region is None or self.used + nbytes > self.region.numel():
                self.region, self.used = _map(REGION), 0
            out = self.region[self.used:self.used + nbytes]
            self.used += -(-nbytes // ALIGN) * ALIGN
            return out


_regions = _Regions()


def empty(nbytes: int) -> torch.Tensor:
    """A new uint8 CPU tensor of ``nbytes`` (contents undefined, 64-byte aligned) on memory
    advised for 2 MiB pages (module doc), or ``torch.empty`` where that is off. Raises
    ``ValueError`` for a negative size, ``MemoryError`` when the memory cannot be mapped."""
    if nbytes < 0:
        raise ValueError(f"nbytes: need >= 0, got {nbytes}")
    if nbytes == 0 or not enabled():
        return torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= OWN_MAPPING:
        return _map(nbytes)[:nbytes]
    return _regions.take(nbytes)


def zeros(nbytes: int) -> torch.Tensor:
    """A new uint8 CPU tensor of ``nbytes`` zeros on a fresh advised mapping of its own: the
    kernel's zero-filled pages, resident from their first write (a CPU KV cache:
    ``pagedkv.attention.layouts.lazy_zeros``); ``torch.zeros`` where this module is off. Raises
    as :func:`empty`."""
    if nbytes < 0:
        raise ValueError(f"nbytes: need >= 0, got {nbytes}")
    if nbytes == 0 or not enabled():
        return torch.zeros(nbytes, dtype=torch.uint8)
    return _map(nbytes)[:nbytes]


def huge_bytes(pid: int | str = "self") -> int:
    """Bytes of the process's anonymous memory on transparent huge pages now
    (``AnonHugePages`` summed over ``/proc/<pid>/smaps_rollup``); 0 where that file is absent."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
