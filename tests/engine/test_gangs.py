"""Gangs (pagedkv/engine/gangs.py) with hand-made beam sequences: the fork point of a gang,
parking members behind their leader, releasing them, and splitting after a preemption."""

from pagedkv.engine.gangs import Gangs
from pagedkv.engine.request import Request, SamplingParams


def _seq(rid, out, parent="g", computed=0):
    r = Request(rid, [1, 2, 3], SamplingParams(beam_width=3), arrival_time=0.0, parent_id=parent)
    for t in out:
        r.append_output_token(t)
    r.num_computed_tokens = computed
    return r


def _gang():
    g = Gangs()
    g.ids.add("g")
    lead, m1, m2 = _seq("g", [4, 5, 6]), _seq("g#beam1", [4, 5, 7]), _seq("g#beam2", [4, 9])
    return g, lead, m1, m2


def test_fork_point_is_the_longest_common_prefix_short_of_every_end():
    g, lead, m1, m2 = _gang()
    other = _seq("x", [4], parent="h")
    members, at = g.members_and_fork_point(lead, [lead, m1, m2, other])
    assert members == [m1, m2] and at == 4  # [1, 2, 3, 4] shared; m2 diverges at index 4
    members, at = g.members_and_fork_point(lead, [lead, m1])
    assert members == [m1] and at == 5  # [1, 2, 3, 4, 5]: one short of both ends (6 tokens)


def test_identical_members_fork_one_short_of_the_end():
    g, lead, _, _ = _gang()
    twin = _seq("g#beam3", [4, 5, 6])
    assert g.members_and_fork_point(lead, [twin]) == ([twin], 5)


def test_request_outside_a_gang_or_alone_has_no_members():
    g, lead, m1, _ = _gang()
    solo = _seq("s", [4, 4], parent="s")
    assert g.members_and_fork_point(solo, [solo, m1]) == ([], 5)
    assert g.members_and_fork_point(lead, [lead]) == ([], 6)


def test_parked_members_wait_until_the_leader_reaches_the_fork_point():
    g, lead, m1, m2 = _gang()
    lone = _seq("y", [1], parent="y")
    g.park(lead, 4, [m1, m2])
    assert g.unparked([m1, lone, m2]) == [lone]
    assert g.fork_point(lead, 6) == 4 and g.fork_point(m1, 6) == 6
    lead.num_computed_tokens = 3
    assert not g.ready_to_fork(lead) and not g.ready_to_fork(m1)
    lead.num_computed_tokens = 4
    assert g.ready_to_fork(lead)
    assert g.release(lead) == (4, [m1, m2])
    assert g.unparked([m1, m2]) == [m1, m2] and g.fork_point(lead, 6) == 6 and not g.ready_to_fork(lead)


def test_unpark_and_forget():
    g, lead, m1, m2 = _gang()
    g.park(lead, 4, [m1, m2])
    g.unpark(lead)  # the leader was preempted before the fork
    assert g.unparked([m1, m2]) == [m1, m2] and g.fork_point(lead, 9) == 9
    g.unpark(lead)  # no-op the second time
    g.park(lead, 4, [m1, m2])
    g.forget(m1)  # a parked member finished (aborted)
    assert g.unparked([m1, m2]) == [m1]
    g.forget(lead)
    assert g.unparked([m1, m2]) == [m1, m2]


def test_split_members_are_the_running_siblings_of_an_unparked_waiting_member():
    g, lead, m1, m2 = _gang()
    stranger = _seq("z", [5], parent="z")
    assert g.split_members([], [lead, m1]) == []
    assert g.split_members([m2], [lead, m1, stranger]) == [lead, m1]
    g.park(lead, 4, [m2])  # a parked member does not split its gang
    assert g.split_members([m2], [lead, m1, stranger]) == []
    assert Gangs().split_members([m2], [lead]) == []  # no gangs at all
