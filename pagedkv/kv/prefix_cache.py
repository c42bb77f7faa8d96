"""Prefix-cache hashing (seed §02, §04): a chained hash over full blocks.

``hash(block i) = sha256(hash(block i-1) | token ids of block i (int64 LE) | extra keys)``

The extra keys say *whose* K/V these are and how they are stored: model id + revision, the
KV cache format (``int8/g64`` K/V are different bytes from ``float32`` ones), adapter id, cache salt
(applied to every block) and the multimodal items overlapping the block's token range
(content hash, offset, length). They are serialised with their types, so salt ``"7"`` and
adapter ``7`` never produce the same bytes. The published block also keeps the exact bytes
it was hashed from, so a lookup confirms a hit by comparison (a collision is a miss).

Tokens are turned into bytes once per call with numpy; the only Python loop is per block.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from pagedkv.errors import InvalidRequestError

#: ``hash_fn(parent_hash or None, token_bytes, extra_bytes) -> bytes``.
HashFn = Callable[[bytes | None, bytes, bytes], bytes]

_ROOT = b"\x00" * 32


def sha256_block_hash(parent_hash: bytes | None, token_bytes: bytes, extra_bytes: bytes) -> bytes:
    """The default block hash: 32-byte sha256 digest of parent | tokens | extra keys."""
    return hashlib.sha256((parent_hash if parent_hash is not None else _ROOT)
                          + token_bytes + extra_bytes).digest()


def _typed(v: object) -> str:
    """A value with its type, e.g. ``str:'7'`` vs ``int:7``."""
    return f"{type(v).__name__}:{v!r}"


@dataclass(frozen=True)
class CacheKeys:
    """Who a prompt's K/V belong to, beyond its token ids (seed §04: model version, adapter,
    cache isolation). ``tenant``: the isolation domain (e.g. the API key's owner); two
    tenants never share a block, whatever their salts. Typed: ``CacheKeys(cache_salt="7") != CacheKeys(adapter_id=7)`` and
    they hash differently.

    ``mm_hashes``: one ``(content_hash, offset, length)`` per multimodal item, ``offset`` and
    ``length`` in token positions of the placeholder tokens it fills. ``kv_cache_dtype``: the
    storage format of the K/V (e.g. ``"float32"``, ``"int8/g64"``); a block written in one
    format is never served to a cache of another.
    Raises ``InvalidRequestError`` on a malformed ``mm_hashes`` entry.
    """

    model_id: str | None = None
    revision: str | None = None
    adapter_id: int | str | None = None
    cache_salt: str | None = None
    mm_hashes: tuple[tuple[str, int, int], ...] = ()
    tenant: str | None = None
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        items = []
        for item in self.mm_hashes:
            try:
                content, offset, length = item
            except (TypeError, ValueError):
                raise InvalidRequestError(f"mm_hashes: expected (content_hash, offset, length), got {item!r}") from None
            if (not isinstance(offset, int) or not isinstance(length, int)
                    or offset < 0 or length < 1):
                raise InvalidRequestError(f"mm_hashes: bad offset/length in {item!r}")
            items.append((content, offset, length))
        object.__setattr__(self, "mm_hashes", tuple(sorted(items, key=lambda t: (t[1], t[2]))))
        base = "|".join((
            "model=" + _typed(self.model_id), "rev=" + _typed(self.revision),
            "adapter=" + _typed(self.adapter_id), "salt=" + _typed(self.cache_salt),
            "tenant=" + _typed(self.tenant),
        ) + (("kv=" + _typed(self.kv_cache_dtype),) if self.kv_cache_dtype is not None else ()))
        object.__setattr__(self, "_base", base.encode())

    def extra_bytes(self, start: int, end: int) -> bytes:
        """The extra keys of a block covering token positions ``start .. end-1``."""
        if not self.mm_hashes:
            return self._base  # type: ignore[attr-defined]
        mm = [f"mm={_typed(c)}@{o}+{n}" for c, o, n in self.mm_hashes if o < end and o + n > start]
        if not mm:
            return self._base  # type: ignore[attr-defined]
        return self._base + b"|" + "|".join(mm).encode()  # type: ignore[attr-defined]


NO_KEYS = CacheKeys()


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as int64 little-endian bytes (one C-level conversion, no Python loop;
    ``struct.pack`` is ~2x faster than numpy for a Python list)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype("<i8", copy=False).tobytes()
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise InvalidRequestError(f"token ids must be int64 integers ({exc})") from None


def iter_block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    keys: CacheKeys = NO_KEYS,
    parent_hash: bytes | None = None,
    first_block: int = 0,
    hash_fn: HashFn = sha256_block_hash,
    end_block: int | None = None,
) -> Iterator[tuple[bytes, bytes | None, bytes, bytes]]:
    """Yield ``(hash, parent_hash, token_bytes, extra_bytes)`` for each *full* block of
    ``token_ids`` from logical block ``first_block`` up to (excluding) ``end_block``
    (default: all full blocks). ``token_ids`` are the request's tokens from position 0;
    ``parent_hash`` is the hash of block ``first_block - 1``. Lazy: a lookup stops hashing
    at the first miss."""
    n_full = len(token_ids) // block_size
    if end_block is not None and end_block < n_full:
        n_full = end_block
    if first_block >= n_full:
        return
    start = first_block * block_size
    raw = token_bytes(token_ids[start:n_full * block_size])
    stride = 8 * block_size
    extra = keys.extra_bytes(0, 0) if not keys.mm_hashes else None
    for i in range(n_full - first_block):
        tb = raw[i * stride:(i + 1) * stride]
        if keys.mm_hashes:
            pos = start + i * block_size
            extra = keys.extra_bytes(pos, pos + block_size)
        h = hash_fn(parent_hash, tb, extra)
        yield h, parent_hash, tb, extra
        parent_hash = h


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    keys: CacheKeys = NO_KEYS,
    hash_fn: HashFn = sha256_block_hash,
) -> list[bytes]:
    """The chained hashes of every full block of ``token_ids`` (for tests and benchmarks)."""
    return [h for h, *_ in iter_block_hashes(token_ids, block_size, keys, hash_fn=hash_fn)]
