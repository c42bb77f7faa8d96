"""Fault a CPU KV cache's pages in, in the background, in the order the pool hands blocks out.

A CPU cache comes from lazily zeroed memory (``layouts.lazy_zeros``): start-up clears nothing
and a page becomes resident when a block in it is first written. That first write is a page
fault inside a step: one per 4 KiB where the kernel gives no 2 MiB page, ~10-15 us each on a
virtual machine. A fresh engine's steps pay it until the pool has been used once (the free
queue hands out every block before it reuses one): on a 2-core AVX2 VM, SmolLM2-1.7B's fp32
cache (384 KiB a token) spent ~55 us of a layer's ~145 us attention call on it at batch 1,
and prefill 512 ran ~8% slower than over resident pages (docs/performance.md).

:class:`KVPrefault` moves that work off the steps: a daemon thread asks the kernel to populate
the caches (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+) a chunk of blocks at a time, from
block 0 up (the pool's initial order), every layer's tensors per chunk. Populating never
changes a page's contents, so it runs while steps write the same pages; the call releases the
GIL. Start-up does not wait for it. The thread runs at nice 19: a step's OpenMP team holds
every core, and a thread at normal priority taking one of them slowed whole steps (a 512-token
prefill once ran at half speed for seconds after start); so it advances in the engine's idle
time (loading, between requests), and pages a busy engine reaches first still fault in on
their first write. With idle time the resident set reaches the KV budget within about a
second per GiB (what vLLM and llama.cpp, which clear their caches at start, hold from the
start). Where the kernel has no ``MADV_POPULATE_WRITE`` the thread stops at its first call and
the pages fault in as before. ``PAGEDKV_KV_PREFAULT=0`` turns it off.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
import weakref
from typing import Any, Iterable, Sequence

import torch

logger = logging.getLogger("pagedkv")

#: ``madvise`` advice: populate (prefault) page tables writable, contents unchanged (Linux 5.14)
MADV_POPULATE_WRITE = 23
PAGE = 4096
#: bytes populated per chunk (over all the tensors): one ``madvise`` per tensor per chunk
CHUNK_BYTES = 32 << 20
#: the thread's nice value
NICE = 19


def enabled() -> bool:
    """Whether engines prefault their CPU caches (``PAGEDKV_KV_PREFAULT``, default on; Linux)."""
    return sys.platform.startswith("linux") and os.environ.get("PAGEDKV_KV_PREFAULT", "1") != "0"


def cache_tensors(caches: Iterable[Any], num_blocks: int | None = None) -> list[torch.Tensor]:
    """The CPU storage tensors of ``caches`` (``PagedKVCache``: key, value, their scales),
    non-empty, contiguous and (``num_blocks`` given) ``[num_blocks, ...]``; others (GPU caches,
    views, another backend's shapes) are left out."""
    out = []
    for c in caches:
        for t in (getattr(c, "key", None), getattr(c, "value", None), getattr(c, "key_scale", None),
                  getattr(c, "value_scale", None)):
            if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() and t.is_contiguous()
                    and (num_blocks is None or t.shape[0] == num_blocks)):
                out.append(t)
    return out


#: every started prefault whose thread may still run (stopped at interpreter exit: ``stop_all``)
_LIVE: "weakref.WeakSet[KVPrefault]" = weakref.WeakSet()


def stop_all(timeout: float = 2.0) -> None:
    """Stop every started prefault thread after its chunk in progress and wait for it
    (``timeout`` seconds each). Registered with ``atexit``: no daemon thread is inside a
    ``madvise`` call while the interpreter tears down."""
    for p in list(_LIVE):
        p.stop(timeout)


atexit.register(stop_all)


class KVPrefault:
    """Populate ``tensors`` (each ``[num_blocks, ...]``, contiguous, on the CPU) block range by
    block range, ``chunk_bytes`` (bytes over all tensors) at a time, in a daemon thread.

    The thread holds the tensors only weakly between chunks: once their owner (the engine's
    runner) drops them it stops at the next chunk, so a dropped engine's cache is neither kept
    alive nor made resident.

    ``blocks_done``: blocks ``0 .. blocks_done - 1`` are populated; ``error``: the ``errno``
    that stopped it early (``EINVAL``: the kernel has no ``MADV_POPULATE_WRITE``), else
    ``None``; ``dropped``: it stopped because the tensors were freed. Raises ``ValueError`` if a
    tensor's first dimension is not ``num_blocks`` or it is not contiguous."""

    def __init__(self, tensors: Sequence[torch.Tensor], num_blocks: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        for t in tensors:
            if t.dim() < 1 or t.shape[0] != num_blocks or not t.is_contiguous():
                raise ValueError(f"a cache tensor of shape {tuple(t.shape)} is not [num_blocks={num_blocks}, ...] contiguous")
        self._refs = [weakref.ref(t) for t in tensors]
        self.num_blocks = num_blocks
        per_block = sum(t.stride(0) * t.element_size() for t in tensors)
        self.chunk_blocks = max(1, chunk_bytes // max(per_block, 1))
        self.blocks_done = 0
        self.error: int | None = None
        self.dropped = False
        #: the thread's nice value once it runs (``None``: not set)
        self.nice: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors still alive (``[]`` once any was freed)."""
        live = [r() for r in self._refs]
        return [] if any(t is None for t in live) else live  # type: ignore[misc]

    def start(self) -> "KVPrefault":
        """Start the thread (once); returns ``self``."""
        if self._thread is None and self._refs:
            self._thread = threading.Thread(target=self._run, name="pagedkv-kv-prefault", daemon=True)
            _LIVE.add(self)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the chunk in progress and wait for the thread (``timeout`` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every block is populated or the thread stopped; ``True`` when it ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:  # the lowest CPU priority: a step's threads keep their cores (Linux: per thread)
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, NICE)
            self.nice = os.getpriority(os.PRIO_PROCESS, tid)
        except (AttributeError, OSError):
            pass
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        b0 = 0
        while b0 < self.num_blocks and not self._stop.is_set():
            live = self.tensors  # held for this chunk only: the memory stays mapped during the calls
            if not live:
                self.dropped = True
                return
            b1 = min(self.num_blocks, b0 + self.chunk_blocks)
            for t in live:
                base, per_block = t.data_ptr(), t.stride(0) * t.element_size()
                # the pages from the one holding block b0's first byte up to the one holding
                # b1's, never before the tensor's first whole page: the chunks tile the
                # tensor's whole pages without a gap, and touch no page holding none of its bytes
                first = (base + PAGE - 1) // PAGE * PAGE
                lo = max(first, (base + b0 * per_block) // PAGE * PAGE)
                hi = (base + b1 * per_block) // PAGE * PAGE
                if hi > lo and madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                    self.error = ctypes.get_errno()
                    logger.info("KV prefault stopped at block %d: madvise(MADV_POPULATE_WRITE) failed, errno %d "
                                "(pages fault in on first write instead)", b0, self.error)
                    return
            del live, t
            self.blocks_done = b1
            b0 = b1
