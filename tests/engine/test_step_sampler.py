"""StepSampler (pagedkv/engine/step_sampler.py) with hand-made requests, a real Sampler and
hand-written logits (no model): the rows a step asks for, plain rows sampled, prompt logprob
rows split off into the group, n > 1 siblings forked onto their parent's row, beam rows
offered to their search (not sampled), and draft rows verified (runs cut by the hook)."""

import torch

from pagedkv.engine.request import Request, RequestStatus, SamplingParams
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.sequence_group import SequenceGroup, SequenceGroups
from pagedkv.engine.step_plan import SchedulerOutput
from pagedkv.engine.step_sampler import StepSampler

V = 6


def _seq(rid, prompt, params, computed=0, outputs=()):
    r = Request(rid, list(prompt), params, arrival_time=1.0, parent_id=rid, max_total_tokens=64)
    for t in outputs:
        r.append_output_token(t)
    r.num_computed_tokens = computed
    r.status = RequestStatus.RUNNING
    return r


def _groups(*seqs, pending=0):
    groups = SequenceGroups()
    for r in seqs:
        groups.add(SequenceGroup(r.request_id, None, r.prompt_token_ids, r.sampling_params, 1.0,
                                 pending_children=pending if r.sampling_params.n > 1 else 0), r)
    return groups


def _onehot(*tokens):
    """fp32 logits [len(tokens), V], row i peaking at tokens[i]."""
    x = torch.full((len(tokens), V), -5.0)
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return x


GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def test_plain_rows_are_sampled_in_order():
    a = _seq("a", [1, 2, 3], GREEDY)  # a prefill that completes this step
    b = _seq("b", [1, 2], GREEDY, computed=2, outputs=[4])  # a decode
    c = _seq("c", [1, 2, 3, 4], GREEDY)  # a prefill chunk that does not end the prompt: no row
    out = SchedulerOutput(scheduled=[(a, 3), (b, 1), (c, 2)], copies=[], preempted=[], step_id=1)
    st = StepSampler(Sampler(), _groups(a, b, c))
    rows = st.rows(out)
    assert (rows.sampling, rows.prompt, rows.extra) == ([a, b], [0, 0, 0], [0, 0, 0])
    chosen = st.choose(out, rows, _onehot(5, 2), num_sample_rows=2)
    assert {k: t for k, (t, _) in chosen.sampled.items()} == {"a": 5, "b": 2}
    assert chosen.seqs == [a, b] and chosen.forks == [] and chosen.runs == {} and chosen.touched == {"a", "b"}
    assert a.output_token_ids == [] and b.output_token_ids == [4]  # the scheduler appends, not the sampler


def test_prompt_logprob_rows_go_to_the_group_and_the_last_row_is_sampled():
    p = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)
    a = _seq("a", [1, 2, 3], p)
    groups = _groups(a)
    out = SchedulerOutput(scheduled=[(a, 3)], copies=[], preempted=[], step_id=1)
    st = StepSampler(Sampler(), groups)
    rows = st.rows(out)
    assert rows.prompt == [2] and rows.extra == [2]  # positions 0, 1 score prompt tokens 2, 3
    logits = torch.cat([_onehot(4), _onehot(2, 0)])  # the sampling row first, then the extra rows
    chosen = st.choose(out, rows, logits, num_sample_rows=1)
    assert chosen.sampled["a"][0] == 4
    lps = groups.get("a").prompt_logprobs
    assert lps[0] is None and list(lps[1]) == [2] and list(lps[2])[:1] == [3]
    assert abs(lps[1][2] - torch.log_softmax(_onehot(2)[0], -1)[2].item()) < 1e-6


def test_siblings_fork_onto_their_parents_row():
    p = SamplingParams(n=3, temperature=0.0, max_tokens=4)
    a = _seq("a", [1, 2, 3], p)
    out = SchedulerOutput(scheduled=[(a, 3)], copies=[], preempted=[], step_id=1)
    st = StepSampler(Sampler(), _groups(a, pending=2))
    chosen = st.choose(out, st.rows(out), _onehot(3), num_sample_rows=1)
    assert [f.child.request_id for f in chosen.forks] == ["a#1", "a#2"]
    assert [r.request_id for r in chosen.seqs] == ["a", "a#1", "a#2"]
    assert {k: t for k, (t, _) in chosen.sampled.items()} == {"a": 3, "a#1": 3, "a#2": 3}
    assert chosen.touched == {"a"}


def test_beam_rows_are_offered_not_sampled():
    beam = _seq("g", [1, 2, 3], SamplingParams(beam_width=2, max_tokens=4))
    b = _seq("b", [1, 2], GREEDY, computed=2, outputs=[4])
    out = SchedulerOutput(scheduled=[(beam, 3), (b, 1)], copies=[], preempted=[], step_id=1)
    groups = _groups(beam, b)
    st = StepSampler(Sampler(), groups)
    chosen = st.choose(out, st.rows(out), _onehot(1, 5), num_sample_rows=2)
    assert list(chosen.sampled) == ["b"] and chosen.seqs == [b] and chosen.beam_groups == {"g"}
    assert chosen.touched == {"g", "b"}
    assert torch.equal(groups.get("g").beam.pending["g"], _onehot(1)[0])  # its row, for the beam step


def test_draft_rows_are_verified_and_the_run_goes_through_the_cut_hook():
    a = _seq("a", [1, 2], GREEDY, computed=3, outputs=[4, 5])
    out = SchedulerOutput(scheduled=[(a, 3)], copies=[], preempted=[], step_id=1, drafts={"a": [1, 2]})
    cuts = []

    def cut(req, run):
        cuts.append((req.request_id, [t for t, _ in run]))
        return run[:2]

    st = StepSampler(Sampler(), _groups(a), cut=cut)
    rows = st.rows(out)
    assert rows.sampling == [a] and rows.extra == [2]
    # draft positions: 1 (accepted), 2 (accepted); the last position samples 3
    logits = torch.cat([_onehot(3), _onehot(1, 2)])
    chosen = st.choose(out, rows, logits, num_sample_rows=1)
    assert cuts == [("a", [1, 2, 3])]
    assert chosen.sampled == {} and [t for t, _ in chosen.runs["a"]] == [1, 2]
