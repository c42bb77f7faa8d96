"""InputProcessor (pagedkv/engine/input_processor.py) with a fake tokenizer and no model: the
checks add_request ran (same errors, same messages, in the same order), tokenisation, the
KV blocks a request could ever need, the prefix-cache identity and the Request / group it
builds."""

import math

import pytest

from pagedkv.engine.input_processor import InputLimits, InputProcessor
from pagedkv.engine.request import RequestStatus, SamplingParams
from pagedkv.engine.structured import StructuredSpec
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.kv import CacheKeys


class FakeTokenizer:
    """Token id = the word's length + 10; counts calls (a refused request is not tokenised)."""

    bos_token = None
    bos_token_id = None
    chat_template = None

    def __init__(self):
        self.calls = 0

    def __call__(self, text, add_special_tokens=True):
        self.calls += 1
        return {"input_ids": [10 + len(w) for w in text.split()]}


def _proc(tok=None, num_blocks=8, compile_grammar=None, **kw):
    limits = InputLimits(vocab_size=100, max_model_len=64, max_n=4, num_blocks=num_blocks, block_size=16,
                         enable_paging=True, chunk=32)
    return InputProcessor(tok or FakeTokenizer(), limits, model_id="m", revision="r1", kv_format_id="float32",
                          eos_token_ids=[0], compile_grammar=compile_grammar, **kw)


def test_text_prompt_is_tokenised_and_capped_by_max_model_len():
    tok = FakeTokenizer()
    req = _proc(tok).process("a bb ccc", SamplingParams(max_tokens=100), priority=2, cache_salt="s")
    assert req.token_ids == [11, 12, 13] and req.prompt == "a bb ccc" and tok.calls == 1
    assert req.max_total_tokens == 64  # 3 + 100 tokens clipped to max_model_len
    assert (req.priority, req.cache_salt, req.arrival_time, req.stream) == (2, "s", None, False)
    ids = _proc().process([5, 6, 7])
    assert ids.token_ids == [5, 6, 7] and ids.prompt is None and ids.max_total_tokens == 3 + 16
    assert ids.params == SamplingParams()  # the defaults


def test_a_given_tokenize_replaces_the_processors_own():
    req = _proc().process("x y", tokenize=lambda text: [1, 2, 3, 4])
    assert req.token_ids == [1, 2, 3, 4]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[1, 100]), "prompt token ids must be integers in [0, 100)"),
    (dict(prompt=[1, True]), "prompt token ids must be integers in [0, 100)"),
    (dict(prompt=7), "prompt must be a string or a list of token ids, got int"),
    (dict(prompt=list(range(64))), "prompt has 64 tokens; max_model_len is 64 (the prompt plus at least one "
                                    "output token must fit)"),
    (dict(tenant=3), "tenant must be a string or None, got int"),
    (dict(sampling_params={"n": 1}), "sampling_params must be a SamplingParams"),
    (dict(sampling_params=SamplingParams(n=5)), "SamplingParams.n: must be <= 4, got 5"),
    (dict(sampling_params=SamplingParams(logit_bias={100: 1.0})), "SamplingParams.logit_bias: token ids must be "
                                                                   "integers in [0, 100), got 100"),
    (dict(arrival_time=math.nan), "arrival_time must be seconds (a finite number), got nan"),
    (dict(arrival_time=math.inf), "arrival_time must be seconds (a finite number), got inf"),
    (dict(arrival_time=True), "arrival_time must be seconds (a finite number), got True"),
    (dict(priority=1.5), "priority must be an integer, got 1.5"),
    (dict(cache_salt=7), "cache_salt must be a string or None, got int"),
    (dict(adapter_id=b"a"), "adapter_id must be a string or None, got bytes"),
    (dict(mm_hashes=[("h", -1, 2)]), "mm_hashes must be a list of (content_hash: str, offset, length) tuples"),
    (dict(mm_hashes="h"), "mm_hashes must be a list of (content_hash: str, offset, length) tuples"),
])
def test_bad_requests_raise_the_add_request_errors(kwargs, message):
    kwargs.setdefault("prompt", [1, 2, 3])
    prompt = kwargs.pop("prompt")
    params = kwargs.pop("sampling_params", None)
    with pytest.raises(InvalidRequestError) as e:
        _proc().process(prompt, params, **kwargs)
    assert str(e.value) == message


def test_a_refused_text_prompt_is_not_tokenised():
    tok = FakeTokenizer()
    with pytest.raises(InvalidRequestError, match="priority"):
        _proc(tok).process("a b", priority="high")
    assert tok.calls == 0


def test_a_request_larger_than_the_pool_is_refused():
    # 40 prompt + 60 output tokens clip to 64: ceil(64 / 16) = 4 blocks; n does not add blocks
    assert _proc(num_blocks=4).process([1] * 40, SamplingParams(max_tokens=60)).max_total_tokens == 64
    with pytest.raises(InvalidRequestError) as e:
        _proc(num_blocks=3).process([1] * 40, SamplingParams(max_tokens=60))
    assert str(e.value) == "request needs 4 KV blocks (64 tokens) but the pool has only 3: it could never fit"
    # beam search: prompt 3 blocks + 2 beams * (ceil(24 / 16) + 1) = 3 + 6 = 9
    with pytest.raises(InvalidRequestError, match="request needs 9 KV blocks"):
        _proc(num_blocks=8).process([1] * 40, SamplingParams(max_tokens=60, beam_width=2))


def test_structured_specs_are_compiled_at_admission():
    seen = []
    proc = _proc(compile_grammar=seen.append)
    spec = StructuredSpec("choice", ["ab", "cd"])
    proc.process([1, 2], SamplingParams(structured=spec))
    assert seen == [spec]

    def refuse(spec):
        raise InvalidRequestError("structured: bad regex")

    with pytest.raises(InvalidRequestError, match="bad regex"):
        _proc(compile_grammar=refuse).process([1, 2], SamplingParams(structured=spec))
    with pytest.raises(InvalidRequestError, match="not available"):
        _proc().process([1, 2], SamplingParams(structured=spec))


def test_make_builds_the_request_its_group_and_its_cache_identity():
    proc = _proc()
    req = proc.process([1, 2, 3], SamplingParams(n=3, max_tokens=5), arrival_time=7.5, priority=1, cache_salt="s",
                       adapter_id="lora", mm_hashes=[("img", 0, 2)], tenant="t", stream=True)
    proc.revision = "r2"  # read when the request is made (the engine's revision setter)
    group, seq = proc.make(42, req, in_use=lambda rid: False)
    assert seq.request_id == "42" and seq.parent_id == "42" and seq.status is RequestStatus.WAITING
    assert (seq.prompt_token_ids, seq.arrival_time, seq.priority, seq.max_total_tokens, seq.eos_token_ids) == (
        [1, 2, 3], 7.5, 1, 8, (0,))
    assert seq.cache_keys == CacheKeys(model_id="m", revision="r2", adapter_id="lora", cache_salt="s",
                                       mm_hashes=(("img", 0, 2),), tenant="t", kv_cache_dtype="float32")
    assert (group.request_id, group.pending_children, group.stream, group.arrival_time) == ("42", 2, True, 7.5)
    assert group.seqs == []  # the engine registers the first sequence (SequenceGroups.add)


def test_make_refuses_reserved_and_used_ids():
    proc = _proc()
    req = proc.process([1, 2])
    with pytest.raises(InvalidRequestError) as e:
        proc.make("a#1", req, in_use=lambda rid: False)
    assert str(e.value) == "request id 'a#1' must not contain '#'"
    with pytest.raises(InvalidRequestError) as e:
        proc.make("a", req, in_use=lambda rid: rid == "a")
    assert str(e.value) == "request id 'a' is already in use"
    # a zero-length multimodal item passes the type check and is refused by CacheKeys, after the id
    bad = proc.process([1, 2], mm_hashes=[("img", 0, 0)])
    with pytest.raises(InvalidRequestError, match="mm_hashes"):
        proc.make("b", bad, in_use=lambda rid: False)


def test_chat_template_option(tmp_path):
    assert not _proc().has_chat_template
    assert _proc(chat_template="{{ messages }}").has_chat_template
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert _proc(chat_template=str(path)).chat_template == path.read_text()
    with pytest.raises(ConfigError, match="chat_template: cannot read"):
        _proc(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(InvalidRequestError):  # no template at all: chat requests are refused
        _proc().apply_chat_template([{"role": "user", "content": "hi"}])
