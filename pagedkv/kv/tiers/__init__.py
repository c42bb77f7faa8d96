"""Tiers behind the block pool: host memory and an LMDB disk store keep the K/V of cached
blocks the pool evicts, a prefix lookup continues into them, and KV events report every
change. ``kv_offload=["host:4GiB", "disk:PATH:50GiB"]``, ``kv_events="tcp://..."``.

* ``spec``: parsing the tier specs; ``StoreIdentity`` (whose K/V a disk store holds)
* ``index``: ``TierIndex`` (LRU of hashes per tier), ``TierEntry``, ``TierHit``
* ``offload``: ``KVTiers``, the decisions (store on eviction, push down, lookup, loads)
* ``plan``: ``KVTransfer`` and its ops, what the runner executes before a step's forward
* ``stores``: ``TierStores``, the payload bytes (host dict, disk store)
* ``disk``: ``DiskStore`` (LMDB, crash-safe, identity-checked, size-capped)
* ``events``: ``KVEventRecorder``, ``ZmqEventPublisher`` (vLLM's event shapes), ``decode_batch``
"""

from __future__ import annotations

from typing import Any, Sequence

from pagedkv.kv.tiers.disk import DiskStore, KVStoreMismatchError
from pagedkv.kv.tiers.events import KVEventRecorder, ZmqEventPublisher, decode_batch, replay_endpoint_for
from pagedkv.kv.tiers.index import TierEntry, TierHit, TierIndex
from pagedkv.kv.tiers.offload import KVTiers, cached_tokens_by_tier
from pagedkv.kv.tiers.plan import KVTransfer, Load
from pagedkv.kv.tiers.spec import StoreIdentity, TierSpec, parse_tier_specs
from pagedkv.kv.tiers.stores import TierStores


def open_tiers(specs: Sequence[TierSpec], identity: StoreIdentity | None, block_size: int,
               publisher: Any = None) -> tuple[KVTiers, TierStores | None]:
    """The tiers' bookkeeping (for the KV manager) and data plane (for the runner; ``None``
    without tiers; ``identity`` is needed only with tiers). ``publisher``: a
    ``ZmqEventPublisher`` or anything with ``publish(events)`` (``None``: no events).
    Raises ``ConfigError`` / ``KVStoreMismatchError`` if a store cannot be opened or
    belongs to another model."""
    stores = TierStores(specs, identity) if specs else None
    events = KVEventRecorder(block_size, publisher) if publisher is not None else None
    return KVTiers(stores.indexes() if stores else [], block_size, events, stores), stores


__all__ = [
    "DiskStore", "KVEventRecorder", "KVStoreMismatchError", "KVTiers", "KVTransfer", "Load",
    "StoreIdentity", "TierEntry", "TierHit", "TierIndex", "TierSpec", "TierStores",
    "ZmqEventPublisher", "cached_tokens_by_tier", "decode_batch", "open_tiers",
    "parse_tier_specs", "replay_endpoint_for",
]
