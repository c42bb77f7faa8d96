"""Prefix-cache lookup and publish across the KV groups of a ``KVCacheManager`` (seed §03).

Every KV group has its own chain of block hashes (group ``g > 0``'s ``CacheKeys`` carry
``kv_group``, so its blocks, which hold other layers' K/V, never answer another group's
lookup). A full group needs every block of a prefix; a sliding-window group only the blocks
covering the last ``W`` tokens before the hit point; the hit is the longest prefix valid in
every group (``pagedkv.kv.groups.longest_valid_hit``).
"""

from __future__ import annotations

from typing import Any, Sequence

from pagedkv.kv.block_pool import KVCacheBlock
from pagedkv.kv.group_full import FullAttentionGroup
from pagedkv.kv.groups import LayerGroups, longest_valid_hit
from pagedkv.kv.prefix_cache import CacheKeys, HashFn


class PrefixLookup:
    """Finds and publishes prefix-cache blocks for the group managers ``groups`` (one per
    group of ``layout``, all over one pool whose ``null_block`` marks window placeholders),
    hashing blocks of ``block_size`` tokens with ``hash_fn``; ``tiers`` (a ``KVTiers`` or
    ``None``) continues a lookup past the pool."""

    def __init__(self, layout: LayerGroups, groups: Sequence[FullAttentionGroup], block_size: int,
                 hash_fn: HashFn, tiers: Any = None) -> None:
        self.layout = layout
        self.groups = list(groups)
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.tiers = tiers

    def find(self, token_ids: Sequence[int], cache_keys: CacheKeys | None = None,
             max_cached_tokens: int | None = None) -> tuple[list[list[KVCacheBlock]], int]:
        """Longest cached prefix of ``token_ids`` in whole blocks, never the whole prompt (at
        least the last token is left to compute), nor more than ``max_cached_tokens``. Pure.
        Returns ``(per-group hits, cached tokens)``: a window group's entries before its
        window are the null block; a block found in a tier is a ``TierHit``."""
        bs = self.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        if max_cached_tokens is not None:
            max_blocks = min(max_blocks, max(0, max_cached_tokens) // bs)
        tiers = self.tiers if self.tiers is not None and self.tiers.indexes else None
        found: list[list[KVCacheBlock | None]] = []
        limit = max_blocks
        for group in self.groups:  # full groups come first: their first miss bounds the rest
            blocks = group.lookup(token_ids, cache_keys, limit, self.hash_fn, tiers)
            if group.needs_whole_prefix:
                limit = len(blocks)
            found.append(blocks)
        if len(self.groups) == 1 and self.groups[0].needs_whole_prefix:
            k = limit
        else:
            present = [[b is not None for b in f] + [False] * (limit - len(f)) for f in found]
            k = longest_valid_hit(present, self.layout, bs, limit)
        hits = []
        for group, f in zip(self.groups, found):
            lo = group.first_live_block(k * bs)
            hits.append([group.pool.null_block] * lo + f[lo:k] if lo else f[:k])
        return hits, k * bs

    def publish(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                cache_keys: CacheKeys | None = None) -> int:
        """Publish the request's wholly written blocks in every group (see
        ``FullAttentionGroup.publish``). Returns how many blocks were newly published."""
        return sum(g.publish(req_id, token_ids, num_computed_tokens, cache_keys, self.hash_fn) for g in self.groups)
