"""Fast server checks without the model: request schemas and the engine loop's routing,
abort-on-close and step-failure handling (a fake engine)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from pydantic import ValidationError

from pagedkv.engine.request import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams
from pagedkv.engine.sampler import SamplingError
from pagedkv.serving.engine_loop import EngineLoop, EngineStepError, PromptSpec
from pagedkv.serving.schemas import ChatCompletionRequest, CompletionRequest


def test_schema_prompts_and_limits():
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi"}).prompts() == ["hi"]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": "\n"}).stop == ["\n"]
    for bad in ({"prompt": ""}, {"prompt": []}, {"prompt": ["a"] * 17}, {"prompt": "x", "max_tokens": 0},
                {"prompt": "x", "max_tokens": 1.5}, {"prompt": "x", "n": True}, {"prompt": "x", "temperature": "1"},
                {"prompt": "x", "temperature": 2.5}, {"prompt": "x", "seed": "7"}, {"prompt": [1, "a"]}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", **bad})
    msg = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]})
    assert msg.messages[0].text() == "ab"
    for bad in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"model": "m", **bad})


class FakeEngine:
    """Emits one token per step per request; ``fail_next`` makes the next step raise."""

    def __init__(self, max_tokens: int = 3) -> None:
        self.lock = threading.Lock()
        self.reqs: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.max_tokens = max_tokens
        self.fail_next = False
        self.fail_sampling: list[str] = []

    def add_request(self, rid, prompt, params, *, cache_salt=None, tenant=None, stream=False):
        with self.lock:
            self.reqs[rid] = []
        return rid

    def abort_request(self, ids):
        with self.lock:
            for rid in ([ids] if isinstance(ids, str) else ids):
                if self.reqs.pop(rid, None) is not None:
                    self.aborted.append(rid)

    def has_unfinished_requests(self):
        with self.lock:
            return bool(self.reqs)

    def get_num_unfinished_requests(self):
        with self.lock:
            return len(self.reqs)

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        if self.fail_sampling:  # the sampler refuses these sequences (a fork of one too)
            ids, self.fail_sampling = self.fail_sampling, []
            raise SamplingError("non-finite logits", ids)
        outs = []
        with self.lock:
            for rid, toks in list(self.reqs.items()):
                toks.append(len(toks))
                done = len(toks) >= self.max_tokens
                outs.append(RequestOutput(rid, None, [1], [CompletionOutput(0, "x" * len(toks), list(toks),
                                                                            "length" if done else None)],
                                          done, RequestMetrics(0.0)))
                if done:
                    del self.reqs[rid]
        return outs


def _spec():
    return PromptSpec([1], SamplingParams(max_tokens=3))


def test_loop_routes_outputs_and_aborts_on_close():
    eng = FakeEngine(max_tokens=3)
    loop = EngineLoop(eng, idle_wait_s=0.01)
    loop.start()

    async def go():
        sub = await loop.submit(["a-0", "a-1"], [_spec(), _spec()])
        seen = [(i, o.finished) async for i, o in sub.outputs()]
        assert sorted(i for i, f in seen if f) == [0, 1]
        eng.max_tokens = 10**6
        sub2 = await loop.submit(["b-0"], [_spec()])
        async for _, out in sub2.outputs():
            break  # leaving early aborts
        return seen

    asyncio.run(go())
    assert eng.aborted == ["b-0"]
    assert loop.shutdown(1.0)["aborted"] == 0
    assert not loop.running


def test_loop_survives_a_failed_step():
    eng = FakeEngine(max_tokens=3)
    loop = EngineLoop(eng, idle_wait_s=0.01)
    loop.start()

    async def go():
        eng.fail_next = True
        sub = await loop.submit(["c-0"], [_spec()])
        with pytest.raises(EngineStepError):
            async for _ in sub.outputs():
                pass
        sub2 = await loop.submit(["d-0"], [_spec()])  # the loop still serves
        return [o async for _, o in sub2.outputs()]

    outs = asyncio.run(go())
    assert outs[-1].finished and "c-0" in eng.aborted
    assert loop.num_step_errors == 1
    loop.shutdown(1.0)


def test_a_sampling_error_fails_only_its_request():
    eng = FakeEngine(max_tokens=5)
    loop = EngineLoop(eng, idle_wait_s=0.01)
    loop.start()

    async def go():
        loop.pause()
        bad = await loop.submit(["s-0", "s-1"], [_spec(), _spec()])
        good = await loop.submit(["g-0"], [_spec()])
        eng.fail_sampling = ["s-1#2"]  # a parallel-sampling fork of s-1
        loop.resume()
        with pytest.raises(EngineStepError) as e:
            async for _ in bad.outputs():
                pass
        assert e.value.code == "sampling_error"
        return [o async for _, o in good.outputs()]

    outs = asyncio.run(go())
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [0, 1, 2, 3, 4]
    assert "s-1" in eng.aborted and "g-0" not in eng.aborted  # (s-0: aborted by close, or done first)
    loop.shutdown(1.0)


def test_loop_pause_holds_steps():
    eng = FakeEngine(max_tokens=10**6)
    loop = EngineLoop(eng, idle_wait_s=0.01)
    loop.start()

    async def go():
        sub = await loop.submit(["p-0"], [_spec()])
        it = sub.outputs().__aiter__()
        await it.__anext__()
        assert await asyncio.to_thread(loop.pause)
        n = loop.num_steps
        await asyncio.sleep(0.1)
        assert loop.num_steps == n and loop.paused
        loop.resume()
        for _ in range(200):
            if loop.num_steps > n:
                break
            await asyncio.sleep(0.01)
        assert loop.num_steps > n
        await it.aclose()

    asyncio.run(go())
    loop.shutdown(1.0)
    assert eng.aborted == ["p-0"]


# ---- the JSON boundary (pagedkv.serving.validation) ---------------------------------------
def test_json_depth_counts_structure_not_strings():
    from pagedkv.serving.validation import json_depth

    assert json_depth(b'{"a": [1, {"b": []}]}') <= 32
    deep = b"[" * 40 + b"]" * 40
    assert json_depth(deep) == 40
    assert json_depth(b'{"p": "' + b"[" * 100 + b'"}') == 1  # brackets inside a string
    assert json_depth(b'{"p": "\\"' + b"[" * 100 + b'"}') == 1  # after an escaped quote too
    assert json_depth(b'[' * 33 + b'"]]]"' + b"]" * 33) == 33


def test_parse_json_body_limits():
    from pagedkv.serving.errors import APIError
    from pagedkv.serving.validation import MAX_INT_DIGITS, parse_json_body

    assert parse_json_body(b'{"seed": -18446744073709551615, "x": [1.5]}') == {"seed": -(2**64 - 1), "x": [1.5]}
    cases = [
        (b"[" * 1000 + b"]" * 1000, 400, None, "invalid_json"),
        (b'{"seed": 1' + b"0" * MAX_INT_DIGITS + b"}", 422, "seed", "invalid_value"),
        (b'{"a": {"b": [0, 1e400]}}', 422, "a.b.1", "invalid_value"),
        (b'{"t": -Infinity}', 400, None, "invalid_json"),
        (b'{"p": ["ok", "\\udc00"]}', 400, "p.1", "invalid_unicode"),
        (b'{"\\ud800": 1}', 400, None, "invalid_unicode"),  # a key
        (b"\xc3\x28", 400, None, "invalid_json"),
        (b"[1]", 400, None, "invalid_json"),
    ]
    for raw, status, param, code in cases:
        with pytest.raises(APIError) as e:
            parse_json_body(raw)
        assert (e.value.status, e.value.param, e.value.code) == (status, param, code), raw[:40]


def test_unsupported_parameters():
    from pagedkv.serving.errors import APIError
    from pagedkv.serving.validation import check_unsupported

    table = ChatCompletionRequest.UNSUPPORTED
    check_unsupported({"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "x": 1}, table)
    with pytest.raises(APIError) as e:
        check_unsupported({"prediction": {"type": "content", "content": "x"}}, table)
    assert (e.value.status, e.value.param, e.value.code) == (400, "prediction", "unsupported_parameter")
    assert "response_format" not in table  # structured outputs are implemented


def test_serve_leaves_cores_to_the_http_side_unless_threads_are_given(monkeypatch):
    import os

    from pagedkv.errors import ConfigError
    import argparse

    from pagedkv.serving.cli import add_serve_parser, serve_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    p = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    assert serve_threads(p.parse_args([])) == 4  # 4 usable cores, none reserved by default
    assert serve_threads(p.parse_args(["--reserved-cpus", "1"])) == 3
    assert serve_threads(p.parse_args(["--reserved-cpus", "0"])) == 4
    assert serve_threads(p.parse_args(["--reserved-cpus", "9"])) == 1  # never below one thread
    assert serve_threads(p.parse_args(["--threads", "2", "--reserved-cpus", "3"])) == 2  # explicit wins
    with pytest.raises(ConfigError, match="--reserved-cpus"):
        serve_threads(p.parse_args(["--reserved-cpus", "-1"]))


def test_serve_warns_when_threads_exceed_the_cores(monkeypatch, caplog):
    import argparse
    import logging
    import os

    from pagedkv.serving.cli import add_serve_parser, serve_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    p = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    with caplog.at_level(logging.WARNING, logger="pagedkv.serving"):
        assert serve_threads(p.parse_args(["--threads", "2"])) == 2
        assert not caplog.records
        assert serve_threads(p.parse_args(["--threads", "3"])) == 3
    assert [r.getMessage() for r in caplog.records] == [
        '--threads 3 is more than the 2 usable cores: OpenMP\'s waiting threads then sleep after every '
        'parallel op (docs/performance.md, "One OpenMP pool")']
