"""Routing policies over data-parallel replicas (plain Python: no Ray, no HTTP).

* ``round-robin``: replicas in turn.
* ``least-loaded``: the replica with the fewest requests in flight (running + waiting), ties
  broken by KV-cache usage, then in turn.
* ``prefix-aware`` (the default): the replica whose prefix index holds the longest prefix of
  the prompt's block chain (score = cached prefix length in blocks), ties broken by load.
  **Load rule**: when the chosen replica has more than ``load_gap`` (default
  :data:`DEFAULT_LOAD_GAP` = 4) requests in flight beyond the least-loaded replica, the
  request goes to the least-loaded replica instead; a prompt with no cached block anywhere
  also goes to the least-loaded replica.

A replica's *load* is the number of requests this ingress has sent to it that have not ended
(its running + waiting requests when the ingress is its only client; exact and never stale);
the KV usage polled from the replica breaks ties. Unhealthy replicas are never chosen.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from pagedkv.serving.replicas.index import PrefixIndex

POLICIES = ("round-robin", "least-loaded", "prefix-aware")
DEFAULT_POLICY = "prefix-aware"
DEFAULT_LOAD_GAP = 4


class NoReplicaError(RuntimeError):
    """No healthy replica is left to take a request (the ingress answers 503)."""


@dataclass
class ReplicaView:
    """What the router knows of one replica. ``url``: its HTTP server (None until it reports
    one). ``in_flight``: requests sent by this ingress and not yet ended. ``kv_usage``: used
    KV blocks / pool (0-1, polled). ``index``: its prefix index; ``events``: whether KV events
    feed that index too (the router always inserts the prompts it routes there: events come
    only after a prefill)."""

    rank: int
    url: Optional[str] = None
    healthy: bool = False
    pid: Optional[int] = None
    in_flight: int = 0
    kv_usage: float = 0.0
    index: PrefixIndex = field(default_factory=PrefixIndex)
    events: bool = False
    routed: int = 0             # requests routed here (retries included)
    matched_blocks: int = 0     # blocks of those requests the index predicted as cached
    failures: int = 0           # requests that failed here (connection lost, replica gone)
    restarts: int = 0           # times it came back with a new process

    def load(self) -> tuple[int, float]:
        return (self.in_flight, self.kv_usage)


@dataclass(frozen=True)
class Decision:
    """A routing decision: the replica, the blocks its index matched and why it won
    (``prefix``, ``least-loaded``, ``load-gap`` (prefix choice overruled), ``round-robin``)."""

    replica: ReplicaView
    matched_blocks: int
    reason: str


class Router:
    """Chooses a replica per request under ``policy`` (one of :data:`POLICIES`; ``ValueError``
    otherwise). ``load_gap``: in-flight requests beyond the least-loaded replica that the
    prefix choice may carry (>= 0). Thread-safe."""

    def __init__(self, replicas: Sequence[ReplicaView], policy: str = DEFAULT_POLICY,
                 load_gap: int = DEFAULT_LOAD_GAP) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        if load_gap < 0:
            raise ValueError(f"load_gap must be >= 0, got {load_gap}")
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self.policy = policy
        self.load_gap = load_gap
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def healthy(self, exclude: Iterable[int] = ()) -> list[ReplicaView]:
        skip = set(exclude)
        return [r for r in self.replicas if r.healthy and r.url is not None and r.rank not in skip]

    def _rotate(self, cands: list[ReplicaView]) -> list[ReplicaView]:
        k = next(self._turn) % len(cands)
        return cands[k:] + cands[:k]

    def _least_loaded(self, cands: list[ReplicaView]) -> ReplicaView:
        return min(self._rotate(cands), key=ReplicaView.load)  # min keeps the first of equals

    def choose(self, hashes: Sequence[bytes] = (), exclude: Iterable[int] = ()) -> Decision:
        """The replica for a prompt whose block chain is ``hashes`` (see
        :func:`pagedkv.serving.replicas.index.prompt_hashes`), skipping ranks in ``exclude`` (replicas
        that already failed this request). Records the decision (``in_flight`` += 1; the
        approximate index learns the prompt); call :meth:`release` when the request ends.
        Raises :class:`NoReplicaError` when no healthy replica is left."""
        with self._lock:
            cands = self.healthy(exclude)
            if not cands:
                raise NoReplicaError("no healthy replica is available")
            matches = {r.rank: r.index.match(hashes) for r in cands}
            if self.policy == "round-robin":
                d = Decision(self._rotate(cands)[0], 0, "round-robin")
            elif self.policy == "least-loaded":
                d = Decision(self._least_loaded(cands), 0, "least-loaded")
            else:
                least = self._least_loaded(cands)
                best = max(self._rotate(cands), key=lambda r: (matches[r.rank], -r.in_flight, -r.kv_usage))
                if matches[best.rank] == 0:
                    d = Decision(least, 0, "least-loaded")
                elif best.in_flight - least.in_flight > self.load_gap:
                    d = Decision(least, matches[least.rank], "load-gap")
                else:
                    d = Decision(best, matches[best.rank], "prefix")
            d = Decision(d.replica, matches[d.replica.rank], d.reason)
            r = d.replica
            r.in_flight += 1
            r.routed += 1
            r.matched_blocks += d.matched_blocks
            if hashes:  # also with KV events: they arrive only after the prefill
                r.index.insert(hashes)
            return d

    def release(self, replica: ReplicaView, failed: bool = False) -> None:
        """A request routed to ``replica`` ended (``failed``: the replica lost it)."""
        with self._lock:
            replica.in_flight = max(0, replica.in_flight - 1)
            if failed:
                replica.failures += 1

    def update_index(self, replica: ReplicaView, stored: Iterable[bytes] = (), removed: Iterable[bytes] = (),
                     cleared: bool = False) -> None:
        """Apply a replica's KV events to its index (BlockStored / BlockRemoved / AllBlocksCleared)."""
        with self._lock:
            if cleared:
                replica.index.clear()
            replica.index.remove(removed)
            replica.index.insert(stored)

    def mark_down(self, replica: ReplicaView) -> None:
        """Take a replica out of routing (its process died or stopped answering)."""
        with self._lock:
            replica.healthy = False

    def mark_up(self, replica: ReplicaView, url: str, pid: Optional[int] = None) -> None:
        """A replica answers at ``url``; a new process (another ``pid``) starts with an empty
        prefix index."""
        with self._lock:
            if replica.pid is not None and pid is not None and pid != replica.pid:
                replica.index.clear()
                replica.restarts += 1
            replica.url, replica.pid, replica.healthy = url, pid, True
