"""OutputProcessor (pagedkv/engine/output.py) with a fake tokenizer: stop strings (one
spanning two tokens, the earliest of several), streamed and final text, finish reasons, the
RequestOutput built from a hand-made SequenceGroup, the text state it keeps (not the
Request) and the step's decisions (stop strings, beam hypotheses' text)."""

from pagedkv.engine.decisions import Finish
from pagedkv.engine.output import OutputProcessor
from pagedkv.engine.request import Request, RequestStatus, SamplingParams
from pagedkv.engine.sequence_group import SequenceGroup

VOCAB = {0: "<eos>", 1: "Hel", 2: "lo", 3: " wo", 4: "rld", 5: "!", 6: "\n", 7: "EN", 8: "D"}
SPECIAL = {0}


class FakeTokenizer:
    """Concatenates fixed pieces; counts calls so tests can see when text is decoded."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i in SPECIAL))


def _req(rid="r", params=None, index=0, tokens=()):
    r = Request(rid, [100, 101], params or SamplingParams(), arrival_time=5.0, index=index, parent_id="g")
    for t in tokens:
        r.append_output_token(t)
    return r


def test_plain_text_is_decoded_once_per_new_token():
    tok = FakeTokenizer()
    proc = OutputProcessor(tok)
    r = _req(tokens=[1, 2])
    assert proc.detokenize(r) is None
    assert proc.text(r) == "Hello" and tok.calls == 1
    assert proc.detokenize(r) is None and tok.calls == 1  # nothing new: no decode
    r.append_output_token(3)
    proc.detokenize(r)
    assert proc.text(r) == "Hello wo" and tok.calls == 2 and r.stop_reason is None
    assert proc.state(r).num_tokens == 3


def test_stop_string_spanning_two_tokens_cuts_the_text():
    proc = OutputProcessor(FakeTokenizer())
    r = _req(params=SamplingParams(stop=["END"]), tokens=[1, 2, 7])
    assert proc.detokenize(r) is None and proc.text(r) == "HelloEN"
    r.append_output_token(8)  # "EN" + "D" completes the stop string across tokens
    fin = proc.detokenize(r)
    assert fin == Finish(r, RequestStatus.FINISHED_STOPPED, stop_reason="END")
    assert proc.text(r) == "Hello" and r.stop_reason is None  # the scheduler sets it when it applies the Finish
    assert r.output_token_ids == [1, 2, 7, 8]  # the stop string's tokens stay


def test_earliest_of_several_stop_strings_wins():
    proc = OutputProcessor(FakeTokenizer())
    r = _req(params=SamplingParams(stop=["rld", "lo"]), tokens=[1, 2, 3, 4])
    fin = proc.detokenize(r)
    assert fin.status is RequestStatus.FINISHED_STOPPED
    assert (proc.text(r), fin.stop_reason) == ("Hel", "lo")


def test_after_a_stop_string_text_is_frozen():
    tok = FakeTokenizer()
    proc = OutputProcessor(tok)
    r = _req(params=SamplingParams(stop="!"), tokens=[1, 5])
    assert proc.detokenize(r) is not None and proc.text(r) == "Hel"
    r.append_output_token(2)  # a token sampled in the same step, before the finish applied
    assert proc.detokenize(r) is None and proc.text(r) == "Hel" and tok.calls == 1


def test_skip_special_tokens_is_passed_to_the_tokenizer():
    proc = OutputProcessor(FakeTokenizer())
    r = _req(tokens=[1, 2, 0])
    proc.detokenize(r)
    assert proc.text(r) == "Hello"
    r2 = _req("r2", params=SamplingParams(skip_special_tokens=False), tokens=[1, 2, 0])
    proc.detokenize(r2)
    assert proc.text(r2) == "Hello<eos>"


def _group(seqs, params, stream=False, pending=0):
    g = SequenceGroup("g", "prompt", [100, 101], params, arrival_time=5.0, stream=stream, pending_children=pending)
    g.seqs = list(seqs)
    return g


def test_streaming_outputs_grow_by_deltas_and_finish_with_a_reason():
    tok = FakeTokenizer()
    proc = OutputProcessor(tok)
    r = _req()
    g = _group([r], SamplingParams(), stream=True)
    texts = []
    for t in (1, 2, 3):
        r.append_output_token(t)
        out = proc.make_output(g)
        texts.append(out.text)
        assert not out.finished and out.finish_reason is None
    assert texts == ["Hel", "Hello", "Hello wo"]
    r.append_output_token(4)
    r.status = RequestStatus.FINISHED_LENGTH
    r.finish_time = 9.0
    out = proc.make_output(g)
    assert out.finished and out.text == "Hello world" and out.finish_reason == "length"
    assert out.token_ids == [1, 2, 3, 4] and out.metrics.finish_time == 9.0 and tok.calls == 4


def test_non_streamed_text_is_decoded_only_at_the_end():
    tok = FakeTokenizer()
    proc = OutputProcessor(tok)
    r = _req(tokens=[1, 2])
    g = _group([r], SamplingParams())
    out = proc.make_output(g)
    assert out.text == "" and out.token_ids == [1, 2] and tok.calls == 0
    r.status = RequestStatus.FINISHED_STOPPED
    out = proc.make_output(g)
    assert out.text == "Hello" and out.finish_reason == "stop" and tok.calls == 1


def test_n_samples_sorted_by_index_with_logprobs_and_cache_hits():
    params = SamplingParams(n=2, logprobs=1)
    a = _req("g", params, index=0)
    a.append_output_token(1, {1: -0.5})
    b = _req("g#1", params, index=1)
    b.append_output_token(3, {3: -1.0})
    a.num_cached_tokens, a.num_cached_tokens_by_tier = 16, {"pool": 16}
    for s in (a, b):
        s.status = RequestStatus.FINISHED_LENGTH
    out = OutputProcessor(FakeTokenizer()).make_output(_group([b, a], params))
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.text for c in out.outputs] == ["Hel", " wo"]
    assert [c.logprobs for c in out.outputs] == [[{1: -0.5}], [{3: -1.0}]]
    assert out.num_cached_tokens == 16 and out.num_cached_tokens_by_tier == {"pool": 16}
    assert out.finished and out.prompt == "prompt" and out.prompt_token_ids == [100, 101]


def test_group_with_pending_children_is_not_finished():
    r = _req(tokens=[1])
    r.status = RequestStatus.FINISHED_LENGTH
    out = OutputProcessor(FakeTokenizer()).make_output(_group([r], SamplingParams(n=3), pending=2))
    assert not out.finished and out.metrics.finish_time is None
    assert out.outputs[0].logprobs is None  # logprobs were not asked for


# ---- the text state is the output processor's --------------------------------------------
def test_text_state_is_kept_per_sequence_and_forgotten_with_its_request():
    tok = FakeTokenizer()
    proc = OutputProcessor(tok)
    a, b = _req("g", tokens=[1, 2]), _req("g#1", index=1, tokens=[3, 4])
    proc.detokenize(a)
    proc.detokenize(b)
    assert (proc.text(a), proc.text(b)) == ("Hello", " world")
    assert not hasattr(a, "output_text") and not hasattr(a, "_text_tokens")  # nothing written on the Request
    proc.forget("g")  # the group finished: its sequences' state goes
    assert (proc.text(a), proc.text(b)) == ("", "")
    again = _req("g", tokens=[5])  # the id reused by a new request starts from nothing
    proc.detokenize(again)
    assert proc.text(again) == "!" and tok.calls == 3


def test_min_tokens_floor_is_cached_in_the_text_state():
    tok = FakeTokenizer()
    proc = OutputProcessor(tok)
    r = _req(params=SamplingParams(stop=["lo"], min_tokens=2), tokens=[1, 2])
    assert proc.stop_text_floor(r, [1]) is None  # within min_tokens: no stop string yet
    assert proc.detokenize(r) is None and proc.text(r) == "Hello"  # "lo" ends inside the first 2 tokens
    r.append_output_token(3)
    assert proc.stop_text_floor(r, r.output_token_ids) == 5 and proc.state(r).min_tokens_chars == 5
    calls = tok.calls
    assert proc.stop_text_floor(r, r.output_token_ids) == 5 and tok.calls == calls  # cached: no decode


def test_cut_at_stop_string_keeps_a_speculative_run_up_to_the_stop():
    proc = OutputProcessor(FakeTokenizer())
    r = _req(params=SamplingParams(stop=["END"]), tokens=[1])
    run = [(2, None), (7, None), (8, None), (3, None)]  # "lo", "EN", "D" completes "END", " wo"
    assert proc.cut_at_stop_string(r, run) == run[:3]
    assert proc.cut_at_stop_string(r, run[:2]) == run[:2]  # no stop string in it: whole
    plain = _req("p", tokens=[1])
    assert proc.cut_at_stop_string(plain, run) == run  # no stop strings asked for


def test_decide_finds_stop_strings_of_stop_and_streamed_sequences_only():
    from pagedkv.engine.sequence_group import SequenceGroups

    tok = FakeTokenizer()
    proc = OutputProcessor(tok)
    groups = SequenceGroups()
    stop = _req("s", params=SamplingParams(stop=["lo"]), tokens=[1, 2])
    plain = _req("p", tokens=[1, 2])
    streamed = _req("t", params=SamplingParams(stop=None), tokens=[1])
    for r, stream in ((stop, False), (plain, False), (streamed, True)):
        r.parent_id = r.request_id
        groups.add(SequenceGroup(r.request_id, None, r.prompt_token_ids, r.sampling_params, 5.0, stream=stream), r)
    dec = proc.decide([stop, plain, streamed], [], groups)
    assert dec.finishes == [Finish(stop, RequestStatus.FINISHED_STOPPED, stop_reason="lo")]
    assert (proc.text(stop), proc.text(plain), proc.text(streamed)) == ("Hel", "", "Hel")
    assert tok.calls == 2  # the plain sequence is decoded once, at its end


def test_finished_beam_search_outputs_its_hypotheses_with_their_text():
    from pagedkv.engine.beam import BeamHypothesis, BeamSearch

    tok = FakeTokenizer()
    proc = OutputProcessor(tok)
    params = SamplingParams(beam_width=2, skip_special_tokens=False)  # the EOS is left out all the same
    beam = _req(params=params, tokens=[1, 2])
    beam.status = RequestStatus.FINISHED_STOPPED
    g = _group([beam], params)
    g.beam = BeamSearch(2, 4, stop_ids=[0])
    g.beam.hypotheses = [BeamHypothesis([1, 2, 0], -0.5, -0.25, "stop"), BeamHypothesis([3, 4], -1.0, -0.5, "length")]
    g.beam.done = True
    out = proc.make_output(g)
    assert [(c.index, c.text, c.token_ids, c.finish_reason, c.score) for c in out.outputs] == [
        (0, "Hello", [1, 2, 0], "stop", -0.25), (1, " world", [3, 4], "length", -0.5)]
    assert tok.calls == 2 and proc.text(beam) == ""  # the live beams' own text is never decoded
