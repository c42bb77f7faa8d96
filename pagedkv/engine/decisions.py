"""What the step's deciders (sequence groups, beam search, stop strings) ask of the scheduler.

The deciders never hold the scheduler: they return these records, and the engine hands them
to ``Scheduler.update`` (the forks of ``n > 1`` siblings, which join the step being
finished) or ``Scheduler.apply`` (beam forks and frees, stop-string finishes, right after
``update``). Only the scheduler changes its queues, the KV manager and a request's status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class Fork:
    """``child`` (a new sequence, not yet known to the scheduler) shares every KV block of
    ``parent`` (``ref_cnt += 1``; the partly filled last block is copied on its first
    divergent write) and runs on from ``num_computed_tokens`` (tokens)."""

    parent: Request
    child: Request
    num_computed_tokens: int


@dataclass(frozen=True)
class Finish:
    """End ``request`` with ``status`` (a finished status) and free its blocks behind the
    step fence. A request that already finished keeps its status, except that a stop string
    found in the final text of a ``FINISHED_LENGTH`` request relabels it
    ``FINISHED_STOPPED``. ``stop_reason``: the stop string that ended it (set on the request
    whatever its status; ``None``: left as it is)."""

    request: Request
    status: RequestStatus
    stop_reason: Any = None


@dataclass
class Decisions:
    """One step's decisions after ``update``, applied in this order: ``forks`` (they read
    their sources' blocks), then ``finishes``. ``generated_tokens``: tokens chosen outside
    the sampler (beam search), counted in the scheduler's statistics."""

    forks: list[Fork] = field(default_factory=list)
    finishes: list[Finish] = field(default_factory=list)
    generated_tokens: int = 0

    def __iadd__(self, other: "Decisions") -> "Decisions":
        self.forks += other.forks
        self.finishes += other.finishes
        self.generated_tokens += other.generated_tokens
        return self
