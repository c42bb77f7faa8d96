"""Prefix-cache lookup and publish of ``KVCacheManager``, across layer groups.

Every layer group has its own chain of block hashes (group ``g > 0``'s ``CacheKeys`` carry
``kv_group``, so its blocks, which hold other layers' K/V, never answer another group's
lookup). A full group needs every block of a prefix; a sliding-window group only the blocks
covering the last ``W`` tokens before the hit point; the hit is the longest prefix valid in
every group (``pagedkv.kv.groups.longest_valid_hit``).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any, Sequence

from pagedkv.errors import InvalidRequestError
from pagedkv.kv.block_pool import KVCacheBlock
from pagedkv.kv.groups import longest_valid_hit
from pagedkv.kv.prefix_cache import NO_KEYS, CacheKeys, iter_block_hashes


@lru_cache(maxsize=1024)
def _group_keys(keys: CacheKeys, tag: str) -> CacheKeys:
    return replace(keys, kv_group=tag)


class PrefixLookup:
    """Mixin: ``get_computed_blocks`` / ``cache_blocks`` over ``self._gtables`` (per group,
    the block tables by request id), ``self.groups``, ``self.pool`` and ``self.null_block``."""

    # ------------------------------------------------------------------ prefix cache
    def _keys(self, keys: CacheKeys | None, g: int) -> CacheKeys:
        keys = keys or NO_KEYS
        return keys if g == 0 else _group_keys(keys, self._gtags[g])

    def get_computed_blocks(
        self, req_id: str, token_ids: Sequence[int], cache_keys: CacheKeys | None = None,
        max_cached_tokens: int | None = None, record: bool = True,
    ) -> tuple[Any, int]:
        """Longest cached prefix of ``token_ids`` in whole blocks, never the whole prompt
        (at least the last token is left to compute), nor more than ``max_cached_tokens``.
        Pure: no ``ref_cnt`` changes; pass the hits to ``allocate_slots(new_computed_blocks=
        ...)`` before anything else allocates. Returns ``(hits, num_cached_tokens)``; ``([],
        0)`` when disabled. With one layer group ``hits`` is a list of blocks; with several,
        a tuple of such lists, one per group. A full group needs every block of the prefix
        cached; a window group only the blocks covering the last ``W`` tokens before the hit
        point (its earlier entries are the null block): the hit is the longest prefix valid
        in every group. With tiers, a block found in a tier is a ``TierHit`` (loaded into a
        fresh pool block at admission). ``record``: count this lookup in the
        ``prefix_queries`` / ``prefix_hits`` stats when ``allocate_slots`` admits the request
        (the scheduler passes False for a preempted request's recompute: vLLM counts a
        request's first computation only)."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        n = len(token_ids)
        max_blocks = max(0, (n - 1) // bs)
        if max_cached_tokens is not None:
            max_blocks = min(max_blocks, max(0, max_cached_tokens) // bs)
        found: list[list[KVCacheBlock | None]] = []
        lookup = self.pool.lookup
        tiers = self.tiers if self.tiers is not None and self.tiers.indexes else None
        limit = max_blocks
        for g, w in enumerate(self.groups.windows):
            blocks: list[KVCacheBlock | None] = []
            if limit:
                for h, parent, tb, extra in iter_block_hashes(
                    token_ids, bs, self._keys(cache_keys, g), hash_fn=self.hash_fn, end_block=limit
                ):
                    block = lookup(h, parent, tb, extra)
                    if block is None and tiers is not None:  # pool -> host -> disk
                        block = tiers.lookup(h, parent, tb, extra)
                    if block is None and w is None:
                        break  # a full group needs every block: stop at the first miss
                    blocks.append(block)
            if w is None:
                limit = len(blocks)
            found.append(blocks)
        if self.groups.num_groups == 1 and self.groups.windows[0] is None:
            k = limit
        else:
            present = [[b is not None for b in f] + [False] * (limit - len(f)) for f in found]
            k = longest_valid_hit(present, self.groups, bs, limit)
        hits = []
        for g, f in enumerate(found):
            lo = self.groups.first_live_block(g, k * bs, bs)
            hits.append([self.null_block] * lo + f[lo:k] if lo else f[:k])
        if record:
            self._pending_query[req_id] = (n, k * bs)
        else:
            self._pending_query.pop(req_id, None)
        return (hits[0] if len(hits) == 1 else tuple(hits)), k * bs

    def _group_hits(self, hits: Any) -> list[Sequence[KVCacheBlock]]:
        """``get_computed_blocks``' hits as one list per group (``[]`` each when none)."""
        if not hits:
            return [()] * self.groups.num_groups
        if self.groups.num_groups == 1:
            return [hits]
        if len(hits) != self.groups.num_groups:
            raise InvalidRequestError(f"new_computed_blocks: expected {self.groups.num_groups} "
                                      f"per-group lists, got {len(hits)}")
        return list(hits)

    def cache_blocks(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_keys: CacheKeys | None = None,
    ) -> int:
        """Publish the request's full blocks whose every slot is written (the first
        ``num_computed_tokens // block_size`` blocks; ``token_ids`` are the request's tokens
        from position 0), in every layer group (placeholders are skipped). Incremental: each
        block is hashed once. Returns how many blocks were newly published (0 when disabled
        or the request is unknown)."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        if self._single:  # the common case, every decode step: nothing new to publish yet
            table = self._tables.get(req_id)
            if table is None or num_computed_tokens // bs <= table.num_hashed:
                return 0
        published = 0
        for g, tables in enumerate(self._gtables):
            table = tables.get(req_id)
            if table is None or num_computed_tokens // bs <= table.num_hashed:
                continue
            n_full = min(num_computed_tokens, len(token_ids), table.num_tokens) // bs
            done = table.num_hashed
            if n_full <= done:
                continue
            i = done
            for h, parent, tb, extra in iter_block_hashes(
                token_ids, bs, self._keys(cache_keys, g), table.last_hash, done, self.hash_fn, n_full
            ):
                block = table.blocks[i]
                if (i >= table.num_null and block.block_hash is None
                        and self.pool.publish(block, h, parent, tb, extra)):
                    published += 1
                table.last_hash = h
                i += 1
            table.num_hashed = n_full
        return published

