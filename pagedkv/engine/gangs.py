"""Beam groups as gangs, scheduled all or nothing (scheduler state: only the scheduler
changes it). See :class:`Gangs`."""

from __future__ import annotations

from typing import Any

from pagedkv.engine.request import Request


class Gangs:
    """Beam groups, scheduled all or nothing: a beam step needs every live beam's logits, so
    preempting one member preempts the whole gang, and a waiting gang is admitted at once.
    It re-enters as one *leader* that recomputes the tokens all members share (at least one
    short of its end, so it samples nothing); the other members are *parked* until the
    leader reaches that fork point, then fork its blocks (the shared prefix stored once,
    prefix caching or not) and each recomputes only its own suffix. ``ids``: the gangs'
    parent request ids (the scheduler adds one with a beam request's first sequence and
    drops it when the gang's last sequence finishes)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self._forks: dict[str, tuple[int, list[Request]]] = {}  # leader id -> (fork at, members)
        self._parked: set[str] = set()  # waiting members that fork from their running leader

    def unparked(self, waiting: Any) -> Any:
        """The waiting sequences that may be admitted (parked members wait for their leader)."""
        return [r for r in waiting if r.request_id not in self._parked] if self._parked else waiting

    def split_members(self, waiting: Any, running: list[Request]) -> list[Request]:
        """Running members of gangs that last step's preemption split (a member waits,
        unparked): they must be preempted too, or they would hold blocks waiting for
        siblings that cannot get any."""
        if not self.ids or not waiting:
            return []
        split = {r.parent_id for r in waiting if r.parent_id in self.ids and r.request_id not in self._parked}
        return [r for r in running if r.parent_id in split]

    def members_and_fork_point(self, req: Request, waiting: Any) -> tuple[list[Request], int]:
        """``req``'s waiting gang members and the tokens they all share with it (where they
        fork), or ``([], req.num_tokens)`` for a request outside a gang."""
        if req.parent_id not in self.ids:
            return [], req.num_tokens
        members = [r for r in waiting if r.parent_id == req.parent_id and r is not req]
        if not members:
            return [], req.num_tokens
        toks = req.all_token_ids
        end = min(req.num_tokens - 1, *(m.num_tokens - 1 for m in members))
        for m in members:
            mt = m.all_token_ids
            j = 0
            while j < end and mt[j] == toks[j]:
                j += 1
            end = j
        return members, end

    def park(self, leader: Request, at: int, members: list[Request]) -> None:
        """``leader`` was admitted: ``members`` wait until it has computed ``at`` tokens."""
        self._forks[leader.request_id] = (at, members)
        self._parked.update(m.request_id for m in members)

    def fork_point(self, req: Request, default: int) -> int:
        """Where a leader stops computing (its members' fork point), else ``default``."""
        fk = self._forks.get(req.request_id)
        return fk[0] if fk is not None else default

    def ready_to_fork(self, leader: Request) -> bool:
        fk = self._forks.get(leader.request_id)
        return fk is not None and leader.num_computed_tokens >= fk[0]

    def release(self, leader: Request) -> tuple[int, list[Request]]:
        """The leader reached the fork point: ``(fork point, members)``, no longer parked."""
        at, members = self._forks.pop(leader.request_id)
        for m in members:
            self._parked.discard(m.request_id)
        return at, members

    def unpark(self, leader: Request) -> None:
        """``leader`` stops (preempted or finished) before its members forked: they wait
        again as ordinary members of their gang."""
        fk = self._forks.pop(leader.request_id, None)
        if fk is not None:
            for m in fk[1]:
                self._parked.discard(m.request_id)

    def forget(self, req: Request) -> None:
        """``req`` finished: neither a leader nor a parked member any more."""
        self.unpark(req)
        self._parked.discard(req.request_id)
