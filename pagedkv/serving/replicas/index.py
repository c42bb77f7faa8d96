"""A replica's prefix index: the block hashes the router believes one replica holds.

Hashes are the engine's own chained block hashes (:func:`pagedkv.kv.prefix_cache.iter_block_hashes`
over :class:`pagedkv.kv.prefix_cache.CacheKeys` with the model id, revision, KV cache format,
tenant and cache salt), so an index fed by the replica's KV events (BlockStored / BlockRemoved) and the
approximate index (the prompts the router sent there) hold the same keys. The tenant is part of
every hash: one tenant's lookup can only ever match its own blocks, so another tenant's
prefixes never guide its routing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from pagedkv.kv.prefix_cache import CacheKeys, iter_block_hashes


def prompt_hashes(token_ids: Sequence[int], block_size: int, *, model_id: Optional[str], revision: Optional[str],
                  tenant: Optional[str], cache_salt: Optional[str], kv_format: Optional[str] = None) -> list[bytes]:
    """The chained hashes (32-byte sha256 each) of every full ``block_size``-token block of a
    prompt, exactly as the replica's engine computes them (``kv_format``: its
    ``LLMEngine.kv_format_id``, e.g. ``"float32"`` or ``"int8/g64"``). Raises
    ``InvalidRequestError`` for token ids that are not int64."""
    keys = CacheKeys(model_id=model_id, revision=revision, cache_salt=cache_salt, tenant=tenant,
                     kv_cache_dtype=kv_format)
    return [h for h, *_ in iter_block_hashes(token_ids, block_size, keys)]


class PrefixIndex:
    """Block hashes of one replica, least recently used first. ``capacity``: most hashes kept
    (blocks; ``None``: unbounded; the approximate index uses the replica's pool size, since the
    replica itself cannot hold more)."""

    def __init__(self, capacity: Optional[int] = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, h: bytes) -> bool:
        return h in self._hashes

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a chain this replica holds (stops at the first miss:
        a block is only usable after its whole prefix)."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def insert(self, hashes: Iterable[bytes]) -> None:
        """Add (or refresh) hashes as most recently used; the oldest go past ``capacity``."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        if self.capacity is not None:
            while len(self._hashes) > self.capacity:
                self._hashes.popitem(last=False)

    def remove(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self._hashes.pop(h, None)

    def clear(self) -> None:
        self._hashes.clear()
