"""Decisions (pagedkv/engine/decisions.py): the records deciders hand the scheduler, and how
one step's decisions add up."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.engine.decisions import Decisions, Finish, Fork
from pagedkv.engine.request import Request, RequestStatus, SamplingParams
from pagedkv.kv import CacheKeys


def _req(rid: str) -> Request:
    return Request(request_id=rid, prompt_token_ids=[3, 4, 5], sampling_params=SamplingParams(max_tokens=4),
                   arrival_time=0.0, cache_keys=CacheKeys(model_id="m"), max_total_tokens=7, parent_id="p")


def test_decisions_add_up_in_order():
    p, c1, c2, s = _req("p"), _req("p#1"), _req("p#2"), _req("s")
    first = Decisions(forks=[Fork(p, c1, 3)], generated_tokens=2)
    second = Decisions(forks=[Fork(p, c2, 4)], finishes=[Finish(s, RequestStatus.FINISHED_STOPPED)],
                       generated_tokens=1)
    total = first
    total += second
    assert total is first  # in place
    assert [(f.parent.request_id, f.child.request_id, f.num_computed_tokens) for f in total.forks] == [
        ("p", "p#1", 3), ("p", "p#2", 4)]
    assert [(f.request.request_id, f.status) for f in total.finishes] == [("s", RequestStatus.FINISHED_STOPPED)]
    assert total.generated_tokens == 3
    assert len(second.forks) == 1  # the right-hand side is left as it was


def test_records_are_frozen_and_empty_decisions_start_empty():
    fork = Fork(_req("p"), _req("p#1"), 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fork.num_computed_tokens = 5
    d = Decisions()
    assert (d.forks, d.finishes, d.generated_tokens) == ([], [], 0)
    assert Decisions().forks is not d.forks  # no shared default list
