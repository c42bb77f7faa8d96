"""TierStores: the payload bytes of the tiers (the data plane; the decisions are
``KVTiers``'). A payload is one block's K/V of every layer, as the attention backend
stores it, flattened to uint8 ``[block_nbytes]`` by the runner: opaque bytes here, never
a model tensor.

``execute(ops, payloads)`` runs a step's ``KVTransfer`` ops in order on the runner's
thread: host-memory puts, moves and loads are dictionary operations; disk writes are
queued to the disk store's copy thread (off the step's critical path) and served from
memory until committed; disk loads read and verify synchronously (before the forward that
needs them). A load that cannot be served (missing, corrupt) is returned as failed: the
runner recomputes that block, and the entry is reported to ``KVTiers`` to be forgotten.
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections import Counter
from typing import Any, Sequence

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.kv.tiers.disk import DiskStore
from pagedkv.kv.tiers.index import TierEntry, TierIndex
from pagedkv.kv.tiers.plan import Clear, Drop, Load, Move, Put
from pagedkv.kv.tiers.spec import StoreIdentity, TierSpec


class HostStore:
    """Payloads in host memory, by block hash, at most ``capacity_blocks`` (the index
    enforces it)."""

    def __init__(self, capacity_bytes: int, block_nbytes: int) -> None:
        self.capacity_blocks = capacity_bytes // block_nbytes
        if self.capacity_blocks < 1:
            raise ConfigError(f"kv_offload host:{capacity_bytes}: holds no block of {block_nbytes} bytes; raise the size")
        self._data: dict[bytes, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._data)

    def put(self, entry: TierEntry, payload: np.ndarray, wait: Any = None) -> None:
        self._data[entry.block_hash] = payload

    def get(self, entry: TierEntry) -> np.ndarray | None:
        return self._data.get(entry.block_hash)

    def pop(self, block_hash: bytes) -> np.ndarray | None:
        return self._data.pop(block_hash, None)

    def delete(self, block_hash: bytes) -> None:
        self._data.pop(block_hash, None)

    def clear(self) -> None:
        self._data.clear()

    def close(self) -> None:
        self._data.clear()


class TierStores:
    """One store per tier spec (fastest first) for blocks of ``identity.block_nbytes``
    bytes. Raises ``ConfigError`` (see ``DiskStore``) when a store cannot be opened."""

    def __init__(self, specs: Sequence[TierSpec], identity: StoreIdentity) -> None:
        self.identity = identity
        self.names = [s.kind for s in specs]
        self.levels: list[Any] = []
        try:
            for s in specs:
                self.levels.append(HostStore(s.capacity_bytes, identity.block_nbytes) if s.kind == "host"
                                   else DiskStore(s.path, s.capacity_bytes, identity))
        except BaseException:
            self.close()
            raise
        self._failures: list[tuple[int, bytes]] = []
        self.blocks: Counter[str] = Counter()  # per direction, e.g. "pool->host"
        self.seconds: Counter[str] = Counter()  # export, import, disk_read (runner); disk_write (copy thread)
        self._closed = False
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    def indexes(self) -> list[TierIndex]:
        """The tiers' initial indexes: empty for host; a disk store's entries as found on
        disk, oldest first (entries beyond the capacity are deleted, oldest first)."""
        out = []
        for name, store in zip(self.names, self.levels):
            idx = TierIndex(name, store.capacity_blocks)
            if isinstance(store, DiskStore):
                for e in store.scan():
                    idx.add(e)
                while len(idx) > idx.capacity_blocks:
                    oldest = idx.victim()
                    store.delete(oldest.block_hash)
                    idx.pop(oldest.block_hash)
            out.append(idx)
        return out

    def execute(self, ops: Sequence[Any], payloads: np.ndarray | None, wait: Any = None
                ) -> tuple[list[tuple[Load, np.ndarray]], list[Load]]:
        """Run ``ops`` in order. ``payloads``: uint8 ``[n, block_nbytes]``, row ``i`` = the
        export of ``store_block_ids[i]``; ``wait()`` makes them readable (device copies).
        Returns ``(loaded, failed)``: ``(load, payload)`` for each served ``Load`` and the
        ``Load``s that could not be served."""
        loaded: list[tuple[Load, np.ndarray]] = []
        failed: list[Load] = []
        if wait is not None and any(isinstance(op, Load) or (isinstance(op, Put) and isinstance(
                self.levels[op.level], HostStore)) for op in ops):
            wait()  # read here on this thread: the device copy must be done (disk puts wait on the copy thread)
            wait = None
        for op in ops:
            if isinstance(op, Put):
                p = payloads[op.src]
                if payloads.shape[0] > 1 and isinstance(self.levels[op.level], HostStore):
                    p = p.copy()  # do not keep the whole step's export alive for one row
                self.levels[op.level].put(op.entry, p, wait)
                self.blocks[f"pool->{self.names[op.level]}"] += 1
            elif isinstance(op, Move):
                p = self.levels[op.src_level].pop(op.entry.block_hash)
                if p is None:
                    self._failures.append((op.level, op.entry.block_hash))
                    continue
                self.levels[op.level].put(op.entry, p, wait)
                self.blocks[f"{self.names[op.src_level]}->{self.names[op.level]}"] += 1
            elif isinstance(op, Drop):
                self.levels[op.level].delete(op.block_hash)
            elif isinstance(op, Clear):
                self.levels[op.level].clear()
            elif isinstance(op, Load):
                t0 = time.perf_counter()
                p = self.levels[op.level].get(op.entry)
                if isinstance(self.levels[op.level], DiskStore):
                    self.seconds["disk_read"] += time.perf_counter() - t0
                if p is None:
                    failed.append(op)
                    self._failures.append((op.level, op.entry.block_hash))
                else:
                    loaded.append((op, p))
                    self.blocks[f"{self.names[op.level]}->pool"] += 1
        return loaded, failed

    def record(self, what: str, seconds: float) -> None:
        """Add copy time (seconds) under ``what`` (``export`` / ``import`` / ``recompute``)."""
        self.seconds[what] += seconds

    def take_failures(self) -> list[tuple[int, bytes]]:
        """``(level, hash)`` of entries whose payload is gone or bad since the last call."""
        out, self._failures = self._failures, []
        for level, store in enumerate(self.levels):
            if isinstance(store, DiskStore):
                out += [(level, h) for h in store.take_failures()]
        return out

    def transfer_stats(self) -> dict[str, Any]:
        """``{"blocks": {direction: n}, "bytes": {direction: n}, "seconds": {what: s}}``."""
        nb = self.identity.block_nbytes
        seconds = dict(self.seconds)
        for store in self.levels:
            if isinstance(store, DiskStore):
                seconds["disk_write"] = store.write_seconds
        return {"blocks": dict(self.blocks), "bytes": {k: v * nb for k, v in self.blocks.items()},
                "seconds": seconds}

    def disk(self) -> DiskStore | None:
        return next((s for s in self.levels if isinstance(s, DiskStore)), None)

    def drain(self) -> None:
        """Wait until every queued disk write is committed."""
        for store in self.levels:
            if isinstance(store, DiskStore):
                store.drain()

    def close(self) -> None:
        """Commit queued disk writes and close every store (idempotent)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for store in self.levels:
            store.close()
