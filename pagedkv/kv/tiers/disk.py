"""The disk tier's store: one LMDB environment per directory, written by a copy thread.

Why LMDB (the ``lmdb`` package) rather than one file per block: a write is a transaction
(a batch of puts and deletes becomes visible all at once or not at all, with one fsync per
batch instead of one per file plus the directory), readers never block the writer and read
straight from the memory map, the whole store is one file whose size ``map_size`` caps
(the size limit holds by construction), and after a crash (``kill -9``, power loss) the
copy-on-write B+tree reopens at its last committed transaction: no torn entry, no recovery
pass, no temporary files to sweep.

Layout (two sub-databases):

* ``meta``: ``b"header"`` -> the ``StoreIdentity`` as JSON (checked at open: a store of
  another model or format is refused with ``KVStoreMismatchError``); ``b"e" + hash`` ->
  msgpack ``[seq, parent_hash, token_bytes, extra_bytes, nbytes, crc]``.
* ``data``: ``hash`` -> the block's payload (every layer's K/V as the backend stores them).

A read checks the entry's tokens, parent and extra keys against the index's, the payload
length, and a CRC-32 over key and payload: a mismatch or an unreadable entry is a miss
(the caller recomputes), never wrong K/V.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import shutil
import threading
import time
import zlib
from typing import Any, Iterator

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.kv.tiers.index import TierEntry
from pagedkv.kv.tiers.spec import StoreIdentity
from pagedkv.utils import cdiv

logger = logging.getLogger("pagedkv")

_HEADER = b"header"
_PAGE = 4096
_BATCH = 16  # puts/deletes per write transaction (one fsync each)


class KVStoreMismatchError(ConfigError):
    """A disk store was written for another model or format (its header differs); it is
    never served. Use another path, or delete the store."""


def _crc(block_hash: bytes, payload: Any) -> int:
    return zlib.crc32(payload, zlib.crc32(block_hash))


def entry_bytes(block_nbytes: int) -> int:
    """Bytes one entry takes in the file: its payload's overflow pages plus a page share of
    metadata (an upper estimate)."""
    return cdiv(block_nbytes + 16, _PAGE) * _PAGE + 512


def disk_capacity_blocks(capacity_bytes: int, block_nbytes: int) -> int:
    """Blocks a store of ``capacity_bytes`` holds, keeping room for the B+tree, the free
    list and pages freed by the last transactions (not reusable until they commit)."""
    e = entry_bytes(block_nbytes)
    reserve = 64 * _PAGE + 2 * _BATCH * e
    return max(0, (capacity_bytes - reserve) // e)


class DiskStore:
    """An LMDB store at ``path`` holding at most ``capacity_bytes`` (the file never grows
    past it) for ``identity``. Writes (``put``, ``delete``, ``clear``) are queued to a copy
    thread, batched into transactions; ``get`` reads on the caller's thread (a payload
    still queued is served from memory). Raises ``ConfigError`` at open for an unwritable
    path, a limit beyond the file system's free space, a store in use by another process
    or unreadable, and ``KVStoreMismatchError`` for another identity's store."""

    def __init__(self, path: str, capacity_bytes: int, identity: StoreIdentity) -> None:
        import lmdb

        self.path = path = os.path.abspath(os.path.expanduser(path))
        self.identity = identity
        self.block_nbytes = identity.block_nbytes
        self.capacity_blocks = disk_capacity_blocks(capacity_bytes, self.block_nbytes)
        where = f"kv_offload disk:{path}"
        if self.capacity_blocks < 1:
            raise ConfigError(f"{where}: {capacity_bytes} bytes hold no block of "
                              f"{self.block_nbytes} bytes (plus LMDB's reserve); raise the size")
        try:
            os.makedirs(path, exist_ok=True)
            self._lock_file = open(os.path.join(path, "pagedkv.lock"), "a+")
        except OSError as e:
            raise ConfigError(f"{where}: cannot create or write the store directory: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ConfigError(f"{where}: the store is in use by another process") from None
        data_file = os.path.join(path, "data.mdb")
        used = os.path.getsize(data_file) if os.path.exists(data_file) else 0
        free = shutil.disk_usage(path).free
        self.map_size = capacity_bytes // _PAGE * _PAGE
        if used > self.map_size:
            self._fail(f"{where}: the store already takes {used} bytes, more than the limit {capacity_bytes}; "
                       "raise the limit or delete the store")
        if free + used < self.map_size:
            self._fail(f"{where}: the limit ({capacity_bytes} bytes) exceeds the free space of its "
                       f"file system ({free + used} bytes with the store); lower it or free space")
        try:
            self.env = lmdb.open(path, map_size=self.map_size, max_dbs=2, readahead=False,
                                 max_readers=64, sync=True, metasync=True)
            self._meta = self.env.open_db(b"meta")
            self._data = self.env.open_db(b"data")
            self._check_header()
        except lmdb.Error as e:
            self._fail(f"{where}: cannot open the LMDB store: {e}")
        self._lmdb = lmdb
        self._pending: dict[bytes, np.ndarray] = {}
        self._pending_lock = threading.Lock()
        self._failures: list[bytes] = []
        self._seq = 0
        self.write_seconds = 0.0
        self.bytes_written = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-disk", daemon=True)
        self._thread.start()

    def _fail(self, msg: str, cls: type = ConfigError) -> None:
        env = getattr(self, "env", None)
        if env is not None:
            env.close()
        self._lock_file.close()
        raise cls(msg)

    def _check_header(self) -> None:
        with self.env.begin(write=True, db=self._meta) as txn:
            raw = txn.get(_HEADER)
            if raw is None:
                txn.put(_HEADER, self.identity.to_json())
                return
        diff = self.identity.differences(StoreIdentity.from_json(raw))
        if diff:
            self._fail(f"kv_offload disk:{self.path}: the store was written for another model or "
                       f"format ({'; '.join(diff)}); it is not served. Use another path or delete it",
                       KVStoreMismatchError)

    # ---- the index, at open ---------------------------------------------------------------
    def scan(self) -> Iterator[TierEntry]:
        """Every entry whose metadata is well formed, oldest first (its LRU order)."""
        import msgpack

        rows = []
        with self.env.begin(db=self._meta) as txn:
            for key, raw in txn.cursor():
                if not key.startswith(b"e") or len(key) != 33:
                    continue
                try:
                    seq, parent, tb, extra, nbytes, _crc_ = msgpack.unpackb(raw)
                    ok = nbytes == self.block_nbytes and isinstance(tb, bytes) and isinstance(extra, bytes)
                except (ValueError, TypeError, msgpack.UnpackException):
                    ok = False
                if ok:
                    rows.append((seq, TierEntry(key[1:], parent, tb, extra)))
        rows.sort(key=lambda r: r[0])
        self._seq = rows[-1][0] + 1 if rows else 0
        return iter([e for _, e in rows])

    # ---- data path -------------------------------------------------------------------------
    def put(self, entry: TierEntry, payload: np.ndarray, wait: Any = None) -> None:
        """Queue ``payload`` (uint8 ``[block_nbytes]``) under ``entry``; ``wait()`` (if
        given) is called before its bytes are read (e.g. a device-to-host copy's event)."""
        with self._pending_lock:
            self._pending[entry.block_hash] = payload
        self._seq += 1
        self._queue.put(("put", entry, payload, wait, self._seq))

    def delete(self, block_hash: bytes) -> None:
        with self._pending_lock:
            self._pending.pop(block_hash, None)
        self._queue.put(("delete", block_hash))

    def clear(self) -> None:
        with self._pending_lock:
            self._pending.clear()
        self._queue.put(("clear",))

    def get(self, entry: TierEntry) -> np.ndarray | None:
        """The verified payload of ``entry`` (uint8 ``[block_nbytes]``), or ``None`` if it is
        missing, truncated or corrupt (a miss)."""
        import msgpack

        h = entry.block_hash
        with self._pending_lock:
            p = self._pending.get(h)
        if p is not None:
            return p
        try:
            with self.env.begin() as txn:
                raw_meta = txn.get(b"e" + h, db=self._meta)
                data = txn.get(h, db=self._data)
            if raw_meta is None or data is None:
                return None
            _seq, parent, tb, extra, nbytes, crc = msgpack.unpackb(raw_meta)
        except (self._lmdb.Error, ValueError, TypeError, msgpack.UnpackException) as e:
            logger.warning("kv_offload disk: unreadable entry %s: %s", h.hex()[:12], e)
            return None
        if (len(data) != nbytes or nbytes != self.block_nbytes or not entry.matches(parent, tb, extra)
                or _crc(h, data) != crc):
            logger.warning("kv_offload disk: entry %s fails verification; served as a miss", h.hex()[:12])
            return None
        return np.frombuffer(data, dtype=np.uint8)

    def take_failures(self) -> list[bytes]:
        """Hashes whose write failed since the last call (the index must forget them)."""
        with self._pending_lock:
            out, self._failures = self._failures, []
        return out

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every queued write is committed."""
        done = threading.Event()
        self._queue.put(("sync", done))
        done.wait(timeout)

    def close(self) -> None:
        """Commit what is queued, stop the copy thread, close the store (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if not self._lock_file.closed:
            self.env.close()
            self._lock_file.close()

    def file_bytes(self) -> int:
        return os.path.getsize(os.path.join(self.path, "data.mdb"))

    # ---- the copy thread --------------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                stop = True
                batch = [b for b in batch if b is not None]
            syncs = [b[1] for b in batch if b[0] == "sync"]
            self._write([b for b in batch if b[0] != "sync"])
            for ev in syncs:
                ev.set()

    def _write(self, batch: list[tuple]) -> None:
        """Apply a batch in one transaction; if it fails (e.g. ``MapFullError``), apply its
        ops one transaction each, in order, so only the puts that do not fit are lost."""
        if not batch:
            return
        t0 = time.perf_counter()
        puts = [b for b in batch if b[0] == "put"]
        failed: list[bytes] = []
        try:
            with self.env.begin(write=True) as txn:
                for op in batch:
                    self._apply(txn, op)
        except self._lmdb.Error:
            for op in batch:
                try:
                    with self.env.begin(write=True) as txn:
                        self._apply(txn, op)
                except self._lmdb.Error as e:
                    logger.warning("kv_offload disk: %s failed (%s)", op[0], e)
                    if op[0] == "put":
                        failed.append(op[1].block_hash)
        with self._pending_lock:
            self._failures.extend(failed)
            for p in puts:
                if self._pending.get(p[1].block_hash) is p[2]:
                    del self._pending[p[1].block_hash]
        self.bytes_written += sum(p[2].nbytes for p in puts) - len(failed) * self.block_nbytes
        self.write_seconds += time.perf_counter() - t0

    def _apply(self, txn: Any, op: tuple) -> None:
        import msgpack

        if op[0] == "put":
            _, e, payload, wait, seq = op
            if wait is not None:
                wait()
            h = e.block_hash
            meta = msgpack.packb([seq, e.parent_hash, e.token_bytes, e.extra_bytes, payload.nbytes, _crc(h, payload)])
            txn.put(h, payload, db=self._data)
            txn.put(b"e" + h, meta, db=self._meta)
        elif op[0] == "delete":
            txn.delete(op[1], db=self._data)
            txn.delete(b"e" + op[1], db=self._meta)
        elif op[0] == "clear":
            txn.drop(self._data, delete=False)
            for key in [k for k, _ in txn.cursor(db=self._meta) if k != _HEADER]:
                txn.delete(key, db=self._meta)
