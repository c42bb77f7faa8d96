"""SequenceGroup / SequenceGroups (pagedkv/engine/sequence_group.py) with hand-made requests:
n > 1 forks after the prefill, seeds of the siblings, metrics over the sequences, beam steps as
fork/finish decisions, and request_blocks."""

from types import SimpleNamespace

import torch

from pagedkv.engine.decisions import Finish, Fork
from pagedkv.engine.request import Request, RequestStatus, SamplingParams
from pagedkv.engine.sequence_group import SequenceGroup, SequenceGroups, request_blocks


def _first(params, rid="g"):
    r = Request(rid, [1, 2, 3, 4, 5], params, arrival_time=2.0, priority=3, eos_token_ids=(0,),
                max_total_tokens=9, parent_id=rid, prompt="p")
    r.status = RequestStatus.RUNNING
    return r


def _register(params, n_pending):
    groups = SequenceGroups()
    first = _first(params)
    g = SequenceGroup("g", "p", first.prompt_token_ids, params, 2.0, pending_children=n_pending)
    groups.add(g, first)
    return groups, g, first


def test_siblings_fork_the_first_sequence_when_its_prefill_completes():
    params = SamplingParams(n=3, seed=100)
    groups, g, first = _register(params, 2)
    first.num_computed_tokens, first.num_cached_tokens = 0, 0
    other = _first(SamplingParams(), rid="solo")
    out = SimpleNamespace(scheduled=[(other, 5), (first, 5)])
    rows, reqs, forks = groups.expand_forks(out, [other, first])
    assert rows == [0, 1, 1, 1]  # the siblings reuse their parent's logits row
    assert [r.request_id for r in reqs] == ["solo", "g", "g#1", "g#2"]
    assert [(f.parent.request_id, f.child.request_id, f.num_computed_tokens) for f in forks] == [
        ("g", "g#1", 5), ("g", "g#2", 5)]
    kids = [f.child for f in forks]
    assert [(k.index, k.parent_id, k.priority, k.max_total_tokens, k.eos_token_ids) for k in kids] == [
        (1, "g", 3, 9, (0,)), (2, "g", 3, 9, (0,))]
    assert [(k.sampling_params.seed, k.sampling_params.n) for k in kids] == [(101, 1), (102, 1)]
    assert g.pending_children == 0 and [s.request_id for s in g.seqs] == ["g", "g#1", "g#2"]
    assert groups.of("g#2") is g and groups.of("solo") is None
    # once forked, a later step adds nothing
    rows, reqs, forks = groups.expand_forks(SimpleNamespace(scheduled=[(first, 1)]), [first])
    assert (rows, [r.request_id for r in reqs], forks) == ([0], ["g"], [])


def test_unseeded_siblings_share_the_params_and_aborted_rows_are_dropped():
    params = SamplingParams(n=2)
    groups, g, first = _register(params, 1)
    gone = _first(SamplingParams(), rid="gone")
    gone.status = RequestStatus.FINISHED_ABORTED
    rows, reqs, forks = groups.expand_forks(SimpleNamespace(scheduled=[(gone, 5), (first, 2)]), [gone, first])
    assert rows == [1, 1] and forks[0].child.sampling_params is params
    assert forks[0].num_computed_tokens == 2  # computed (0) + this step's 2 tokens


def test_finished_abort_and_pop():
    groups, g, first = _register(SamplingParams(n=2), 1)
    assert not g.finished  # a child is still to fork
    assert groups.abort("g") == ["g"] and g.pending_children == 0
    assert groups.abort("nope") == []
    first.status = RequestStatus.FINISHED_ABORTED
    assert g.finished and groups.finished_ids() == {"g"} and len(groups) == 1
    groups.pop("g")
    assert len(groups) == 0 and groups.get("g") is None and groups.of("g") is None


def test_metrics_sum_the_sequences_and_the_retired_ones():
    groups, g, first = _register(SamplingParams(n=2), 0)
    second = _first(SamplingParams(), rid="g#1")
    second.index = 1
    g.seqs.append(second)
    first.scheduled_time, first.first_token_time = 2.5, 3.0
    first.num_prefix_query_tokens, first.num_cached_tokens = 5, 4
    second.num_cached_tokens = 4  # copied from the parent, but it looked nothing up
    first.num_preemptions, second.num_preemptions = 1, 2
    first.num_cow_copies, second.num_cow_copies = 0, 1
    gone = _first(SamplingParams(), rid="g#old")
    gone.num_preemptions, gone.num_cow_copies, gone.num_prefix_query_tokens, gone.num_cached_tokens = 1, 2, 8, 8
    g.retire(gone)
    m = g.metrics()
    assert (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finish_time) == (2.0, 2.5, 3.0, None)
    assert (m.num_preemptions, m.num_cow_copies) == (4, 3)
    assert (m.prefix_query_tokens, m.prefix_hit_tokens) == (13, 12)
    for s, t in ((first, 7.0), (second, 8.0)):
        s.status, s.finish_time = RequestStatus.FINISHED_LENGTH, t
    assert g.metrics().finish_time == 8.0


def test_beam_step_continues_in_place_forks_and_frees():
    params = SamplingParams(beam_width=2, max_tokens=4)
    groups, g, first = _register(params, 0)
    assert g.beam is not None and g.beam.stop_ids == frozenset({0}) and g.beam.max_new_tokens == 4
    first.num_computed_tokens = first.num_tokens
    assert not groups.beam_step("g").forks  # no logits offered yet: nothing decided
    rows, reqs, touched = groups.offer_beam_rows(torch.tensor([[0.0, 2.0, 1.0, -1.0]]).log_softmax(-1), [0], [first])
    assert (rows, reqs, touched) == ([], [], {"g"})
    dec = groups.beam_step("g")
    assert first.output_token_ids == [1]  # the first child continues the beam in place
    (fork,) = dec.forks
    assert (fork.parent, fork.child.request_id, fork.child.output_token_ids, fork.num_computed_tokens) == (
        first, "g#beam1", [2], 5)
    assert dec.finishes == [] and dec.generated_tokens == 2
    assert [(s.request_id, s.index) for s in g.seqs] == [("g", 0), ("g#beam1", 1)]
    # next step: beam "g" puts its mass on EOS (a hypothesis); both running candidates come
    # from beam "g#beam1", so beam "g" has no child and is freed
    child = fork.child
    child.status = RequestStatus.RUNNING
    for b in (first, child):
        b.num_computed_tokens = b.num_tokens
    groups.offer_beam_rows(torch.tensor([[5.0, -9.0, -9.0, -9.0], [-9.0, 3.0, 2.9, -9.0]]), [0, 1], [first, child])
    dec = groups.beam_step("g")
    assert dec.finishes == [Finish(first, RequestStatus.FINISHED_STOPPED)]
    assert [(f.parent.request_id, f.child.output_token_ids) for f in dec.forks] == [("g#beam1", [2, 2])]
    assert child.output_token_ids == [2, 1] and groups.of("g") is None
    assert [h.token_ids for h in g.beam.hypotheses] == [[1, 0]] and not g.beam.done
    assert g.metrics().num_preemptions == 0 and [s.request_id for s in g.seqs] == ["g#beam1", "g#beam2"]


def test_request_blocks():
    p = SamplingParams()
    # paged: ceil(40 / 16) = 3; contiguous: ceil(100 / 16) = 7 per sequence
    assert request_blocks(20, 40, p, 16, True, 100) == 3
    assert request_blocks(20, 40, p, 16, False, 100) == 7
    beam = SamplingParams(beam_width=3)
    # prompt 2 blocks + 3 beams * (ceil(20 / 16) + 1) = 2 + 3 * 3
    assert request_blocks(20, 40, beam, 16, True, 100) == 11
    assert request_blocks(20, 40, beam, 16, False, 100) == 21
    assert request_blocks(20, 40, p, 16, True, 100, windows=(None, None)) == 6


class _RefuseGrammar:
    """A GrammarState stand-in that refuses ``bad`` tokens (as a failed matcher does)."""

    def __init__(self, bad):
        self.bad, self.seen = set(bad), []

    def accept(self, t):
        if t in self.bad:
            return False
        self.seen.append(t)
        return True

    def copy(self):
        g = _RefuseGrammar(self.bad)
        g.seen = list(self.seen)
        return g


def test_beam_step_drops_beams_whose_grammar_fails():
    """A fork whose token the grammar refuses is not made; a beam continued in place with a
    refused token finishes with "error" (its token not appended); the order of the others
    is kept."""
    params = SamplingParams(beam_width=2, max_tokens=4)
    groups, g, first = _register(params, 0)
    first.num_computed_tokens = first.num_tokens
    first.grammar = _RefuseGrammar({2})
    groups.offer_beam_rows(torch.tensor([[0.0, 2.0, 1.0, -1.0]]).log_softmax(-1), [0], [first])
    dec = groups.beam_step("g")  # candidates: token 1 (in place), token 2 (fork: refused)
    assert dec.forks == [] and first.output_token_ids == [1] and first.grammar.seen == [1]
    assert [s.request_id for s in g.seqs] == ["g"] and dec.generated_tokens == 1
    first.grammar = _RefuseGrammar({1})
    first.num_computed_tokens = first.num_tokens
    groups.offer_beam_rows(torch.tensor([[-9.0, 3.0, 2.9, -9.0]]), [0], [first])
    dec = groups.beam_step("g")  # in place: token 1 (refused) -> error; fork: token 2
    assert dec.finishes == [Finish(first, RequestStatus.FINISHED_ERROR)]
    assert first.output_token_ids == [1]
    (fork,) = dec.forks
    assert fork.child.output_token_ids == [1, 2] and [s.request_id for s in g.seqs] == [fork.child.request_id]
    assert fork.child.index == 0
