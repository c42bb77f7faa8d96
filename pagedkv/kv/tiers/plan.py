"""What one step moves between the block pool and the tiers: a ``KVTransfer``.

The KV manager decides (on the scheduler's thread, at schedule time) and records ops; the
model runner executes them before the step's forward, in order, through the attention
backend (``export_blocks`` / ``import_blocks``) and ``TierStores`` (the payload bytes). So
the memory system never touches a tensor, and the runner never decides anything.

Order inside a step: first every pool block in ``store_block_ids`` is exported (it was
evicted this step and is about to be rewritten by its new owner, so it is read before
anything else writes the pool), then ``ops`` run in the order they were decided (a
``Move`` that makes room before the ``Put`` it makes room for; a ``Load`` after the
``Put`` of the same hash), then loaded payloads are imported into their fresh pool blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from pagedkv.kv.tiers.index import TierEntry


@dataclass
class Put:
    """Store exported payload number ``src`` (of ``KVTransfer.store_block_ids``) in tier
    ``level`` under ``entry``."""

    level: int
    entry: TierEntry
    src: int


@dataclass
class Move:
    """Move ``entry``'s payload from tier ``src_level`` to tier ``level`` (an LRU victim
    pushed one tier down)."""

    src_level: int
    level: int
    entry: TierEntry


@dataclass
class Drop:
    """Tier ``level`` forgets ``block_hash`` (an LRU victim falling off the last tier)."""

    level: int
    block_hash: bytes


@dataclass
class Load:
    """Copy ``entry``'s payload from tier ``level`` into pool block ``block_id`` before the
    step's forward. ``position`` (tokens) is where the block starts in its sequence and
    ``context_block_ids`` the sequence's block table up to and including ``block_id``:
    if the payload fails verification the runner recomputes the block from
    ``entry.token_bytes`` over that context instead (never wrong K/V)."""

    level: int
    entry: TierEntry
    block_id: int
    position: int
    context_block_ids: list[int]


@dataclass
class Clear:
    """Tier ``level`` forgets everything (``reset_prefix_cache``)."""

    level: int


Op = Union[Put, Move, Drop, Load, Clear]


@dataclass
class KVTransfer:
    """One step's K/V moves (see the module doc). ``store_block_ids``: pool blocks whose
    payloads the runner exports first; ``ops``: tier operations in order."""

    store_block_ids: list[int] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)

    @property
    def loads(self) -> list[Load]:
        return [op for op in self.ops if isinstance(op, Load)]

    def __len__(self) -> int:
        return len(self.ops)
