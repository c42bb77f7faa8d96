"""Step fences (seed §04): references a step may still read are held until it ends.

``begin_step(req_ids)`` records which requests a step reads and writes; until ``end_step``
confirms the device is done with that step, every drop of a block reference for one of
those requests (finish, abort, preemption, copy-on-write, a sliding window moving past a
block) is only *held*, so the block cannot be handed to another request whose writes could
land in it mid-step. A held reference counts in ``ref_cnt`` exactly like a table's.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable

from pagedkv.errors import InvalidRequestError
from pagedkv.kv.block_pool import BlockPool, KVCacheBlock


class _Hold:
    """References kept alive by a step fence until every step in ``waiting`` has ended."""

    __slots__ = ("key", "req_id", "blocks", "waiting")

    def __init__(self, key: int, req_id: str, blocks: list[KVCacheBlock], waiting: set[int]) -> None:
        self.key = key
        self.req_id = req_id
        self.blocks = blocks
        self.waiting = waiting


class StepFences:
    """Open steps, their holds, and ``drop`` (release now, or hold until the steps that used
    the request end). A collaborator of ``KVCacheManager``, given what it needs: ``pool`` (the
    ``BlockPool`` held references go back to) and ``tiers`` (a ``KVTiers`` that hears of every
    ended step, or ``None``). ``num_deferred_frees`` counts the drops that were held."""

    def __init__(self, pool: BlockPool, tiers: Any = None) -> None:
        self.pool = pool
        self.tiers = tiers
        self._step_ids = itertools.count(1)
        self._last_step = 0
        self._open_steps: dict[int, set[str]] = {}
        self._step_holds: dict[int, list[_Hold]] = {}
        self._holds: dict[int, _Hold] = {}
        self._hold_ids = itertools.count()
        self.num_deferred_frees = 0

    @property
    def holds(self) -> list[tuple[str, list[KVCacheBlock], set[int]]]:
        """Fence holds: ``(req_id, blocks, steps still open)`` (do not mutate)."""
        return [(h.req_id, h.blocks, h.waiting) for h in self._holds.values()]

    @property
    def open_steps(self) -> dict[int, set[str]]:
        """Open steps: step id -> the request ids it uses (do not mutate)."""
        return self._open_steps

    def drop(self, req_id: str, blocks: list[KVCacheBlock]) -> None:
        """Release ``req_id``'s references on ``blocks`` (in that order), or, while an open
        step uses the request, hold them until every such step has ended."""
        # Open steps are few (1-2 in flight), so scanning them is cheaper than keeping a
        # per-request index up to date on every begin/end_step.
        if not blocks:
            return
        steps = {sid for sid, rids in self._open_steps.items() if req_id in rids}
        if not steps:
            self.pool.release(blocks)
            return
        hold = _Hold(next(self._hold_ids), req_id, blocks, steps)
        self._holds[hold.key] = hold
        for s in steps:
            self._step_holds.setdefault(s, []).append(hold)
        self.num_deferred_frees += 1

    def begin_step(self, req_ids: Iterable[str]) -> int:
        """Open a step fence over the requests whose blocks the step reads or writes.
        Returns its step id (increasing ints)."""
        sid = next(self._step_ids)
        self._last_step = sid
        self._open_steps[sid] = set(req_ids)
        return sid

    def end_step(self, step_id: int) -> None:
        """Confirm the device finished ``step_id``: references held for it are released.
        Ending a step twice is a no-op; an id never returned by ``begin_step`` raises
        ``InvalidRequestError``."""
        if self._open_steps.pop(step_id, None) is None:
            if isinstance(step_id, int) and 0 < step_id <= self._last_step:
                return
            raise InvalidRequestError(f"end_step: unknown step id {step_id!r}")
        for hold in self._step_holds.pop(step_id, ()):
            hold.waiting.discard(step_id)
            if not hold.waiting:
                del self._holds[hold.key]
                self.pool.release(hold.blocks)
        if self.tiers is not None:
            self.tiers.end_step()  # this step's KV events, one batch
