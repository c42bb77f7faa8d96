"""Adversarial requests through the library (``LLMEngine.add_request`` /
``apply_chat_template``) and the output processor's stop strings: each bad request is a typed
``InvalidRequestError`` (nothing queued, no block taken), never a bare ``TypeError`` /
``jinja2`` error from deep inside; a stop string never matches a half-generated character.

Found by the break-it pass over the input processor split (``pagedkv/engine/input_processor.py``,
``pagedkv/engine/output.py``)."""

from __future__ import annotations

import pytest

from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.output import OutputProcessor, find_stop_string
from pagedkv.engine.request import Request, RequestStatus, SamplingParams
from pagedkv.errors import InvalidRequestError


class ByteTokenizer:
    """Token id = one UTF-8 byte; decoding replaces incomplete characters by U+FFFD, as a
    byte-level BPE tokenizer's ``decode`` does."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text_bytes: bytes, stops: list[str], max_tokens: int = 64):
    """Feed ``text_bytes`` one byte-token at a time (the last of ``max_tokens`` finishes the
    request by length first, as ``Scheduler.update`` does); (tokens seen when it stopped or
    None, the Finish's stop string, the final text)."""
    proc = OutputProcessor(ByteTokenizer())
    r = Request("r", [1], SamplingParams(stop=stops, max_tokens=max_tokens), arrival_time=0.0, parent_id="r")
    for i, t in enumerate(text_bytes):
        r.append_output_token(t)
        if r.num_output_tokens == max_tokens:
            r.status = RequestStatus.FINISHED_LENGTH
        fin = proc.detokenize(r)
        if fin is not None:
            assert fin.status is RequestStatus.FINISHED_STOPPED
            return i + 1, fin.stop_reason, proc.text(r)
    return None, None, proc.text(r)


def test_replacement_char_stop_string_does_not_match_a_half_generated_character():
    # "日本" is 6 bytes; after 1, 2, 4, 5 of them the decoded text ends in U+FFFD
    assert _stream("日本".encode(), ["\ufffd"]) == (None, None, "日本")


def test_stop_string_split_across_byte_tokens_ends_when_its_last_byte_arrives():
    assert _stream("日本語".encode(), ["本"]) == (6, "本", "日")
    assert _stream("x😀y".encode(), ["😀y"]) == (6, "😀y", "x")


def test_a_real_replacement_char_inside_the_text_still_matches():
    # an invalid byte (0xff) followed by a complete character: its U+FFFD is final
    assert _stream(b"a\xffb", ["\ufffd"]) == (3, "\ufffd", "a")


def test_a_request_that_ends_on_a_half_character_matches_its_final_replacement_char():
    # max_tokens cuts "日" after 2 of its 3 bytes: the U+FFFD is final text, the stop string ends it
    assert _stream("日".encode()[:2], ["\ufffd"], max_tokens=2) == (2, "\ufffd", "")


def test_find_stop_string_ignores_only_trailing_replacement_chars():
    assert find_stop_string("ab\ufffd\ufffd", ["\ufffd"], 0) is None
    assert find_stop_string("ab\ufffd\ufffd", ["b"], 0) == (1, "b")
    assert find_stop_string("a\ufffdb", ["\ufffd"], 0) == (1, "\ufffd")
    assert find_stop_string("ab\ufffd", ["\ufffd"], 0, partial=False) == (2, "\ufffd")


def test_ignore_eos_must_be_a_bool():
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos="no").validate()
    SamplingParams(ignore_eos=True).validate()


@pytest.fixture(scope="module")
def engine(loaded_model):
    return LLMEngine(loaded_model, num_blocks=32, block_size=16, max_model_len=256)


def _untouched(engine, free0):
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == free0 == 32
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)


@pytest.mark.parametrize("prompt", ["\ud800abc", "ok \udfff"])
def test_lone_surrogate_prompt_is_invalid_request(engine, prompt):
    free0 = engine.kv.num_free_blocks
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        engine.add_request("s", prompt, SamplingParams(max_tokens=1))
    _untouched(engine, free0)


@pytest.mark.parametrize("arrival", [float("inf"), float("-inf"), float("nan")])
def test_arrival_time_must_be_finite(engine, arrival):
    free0 = engine.kv.num_free_blocks
    with pytest.raises(InvalidRequestError, match="arrival_time"):
        engine.add_request("t", "hi", SamplingParams(max_tokens=1), arrival_time=arrival)
    _untouched(engine, free0)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "user", "content": "\ud800"}],
])
def test_chat_messages_the_template_cannot_render_are_invalid_requests(engine, messages):
    with pytest.raises(InvalidRequestError, match="cannot apply the chat template"):
        engine.apply_chat_template(messages)
    # a good conversation still renders: the template's user turn holds the text
    ids = engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "hi" in engine.tokenizer.decode(ids)


def test_engine_still_serves_after_the_bad_requests(engine):
    free0 = engine.kv.num_free_blocks
    rid = engine.add_request("good", "Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == rid and len(outs[-1].outputs[0].token_ids) == 3
    _untouched(engine, free0)


def test_a_failed_generate_call_leaves_no_request_behind(loaded_model):
    """A step that raises inside ``LLM.generate`` aborts that call's requests: the next call
    runs only its own (before: the stale requests ran on, 50 tokens each, holding blocks)."""
    from pagedkv import LLM

    llm = LLM(loaded_model, num_blocks=32, block_size=16, max_model_len=256)
    real, calls = llm.engine.executor.execute, []

    def flaky(inp):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(inp)

    llm.engine.executor.execute = flaky
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(["Hello", "Once upon a time"], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                     use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate(["Hello"], params, use_tqdm=False)
    fresh = LLM(loaded_model, num_blocks=32, block_size=16, max_model_len=256)
    fresh = fresh.generate(["Hello"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [fresh[0].outputs[0].token_ids]
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == 32 and all(b.ref_cnt == 0 for b in llm.engine.kv.pool.blocks)
