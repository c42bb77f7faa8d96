"""The KV group manager of sliding-window layers (window rule: ``pagedkv.kv.groups``).

A step computing from position ``p`` reads keys ``p - W + 1 .. p`` only: the logical blocks
wholly before ``first_live_block(p) = max(0, p - W + 1) // block_size`` are never read again
by that request, so ``slide`` replaces them with the null block (block id 0) and hands the
real blocks back to the coordinator (which frees them behind the step fence). A prefix hit
needs only the blocks covering the last ``W`` tokens before the hit point.
"""

from __future__ import annotations

from pagedkv.kv.block_pool import KVCacheBlock
from pagedkv.kv.group_full import FullAttentionGroup
from pagedkv.kv.groups import first_live_block


class SlidingWindowGroup(FullAttentionGroup):
    """Block tables of a group of layers with a sliding window of ``window`` tokens (see
    ``FullAttentionGroup`` for the arguments). A request holds at most about ``(W + chunk)
    / block_size + 1`` real blocks; its earlier entries are the null placeholder."""

    kind = "sliding_window"
    needs_whole_prefix = False

    def first_live_block(self, num_computed: int) -> int:
        """First logical block a step computing from position ``num_computed`` reads
        (``pagedkv.kv.groups.first_live_block``, the one window rule)."""
        return first_live_block(self.window, num_computed, self.block_size)

    def slide(self, req_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Replace the request's blocks before the window of a step computing from
        ``num_computed_tokens`` with the null block; returns the replaced real blocks in
        logical order ([] for an unknown request)."""
        table = self.tables.get(req_id)
        if table is None:
            return []
        lo = min(self.first_live_block(num_computed_tokens), len(table.blocks))
        return table.nullify(lo, self.pool.null_block)
