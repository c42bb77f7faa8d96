"""OutputProcessor (pagedkv/engine/output.py) with a fake tokenizer: stop strings (one
spanning two tokens, the earliest of several), streamed and final text, finish reasons and the
RequestOutput built from a hand-made SequenceGroup."""

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
    assert r.output_text == "Hello" and tok.calls == 1
    assert proc.detokenize(r) is None and tok.calls == 1  # nothing new: no decode
    r.append_output_token(3)
    proc.detokenize(r)
    assert r.output_text == "Hello wo" and tok.calls == 2 and r.stop_reason is None


def test_stop_string_spanning_two_tokens_cuts_the_text():
    proc = OutputProcessor(FakeTokenizer())
    r = _req(params=SamplingParams(stop=["END"]), tokens=[1, 2, 7])
    assert proc.detokenize(r) is None and r.output_text == "HelloEN"
    r.append_output_token(8)  # "EN" + "D" completes the stop string across tokens
    fin = proc.detokenize(r)
    assert fin == Finish(r, RequestStatus.FINISHED_STOPPED)
    assert r.output_text == "Hello" and r.stop_reason == "END"
    assert r.output_token_ids == [1, 2, 7, 8]  # the stop string's tokens stay


def test_earliest_of_several_stop_strings_wins():
    proc = OutputProcessor(FakeTokenizer())
    r = _req(params=SamplingParams(stop=["rld", "lo"]), tokens=[1, 2, 3, 4])
    fin = proc.detokenize(r)
    assert fin.status is RequestStatus.FINISHED_STOPPED
    assert (r.output_text, r.stop_reason) == ("Hel", "lo")


def test_after_a_stop_string_text_is_frozen():
    tok = FakeTokenizer()
    proc = OutputProcessor(tok)
    r = _req(params=SamplingParams(stop="!"), tokens=[1, 5])
    assert proc.detokenize(r) is not None and r.output_text == "Hel"
    r.append_output_token(2)  # a token sampled in the same step, before the finish applied
    assert proc.detokenize(r) is None and r.output_text == "Hel" and tok.calls == 1


def test_skip_special_tokens_is_passed_to_the_tokenizer():
    proc = OutputProcessor(FakeTokenizer())
    r = _req(tokens=[1, 2, 0])
    proc.detokenize(r)
    assert r.output_text == "Hello"
    r2 = _req(params=SamplingParams(skip_special_tokens=False), tokens=[1, 2, 0])
    proc.detokenize(r2)
    assert r2.output_text == "Hello<eos>"


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
