"""Every kind of bad input gets its status and an OpenAI error object; the engine keeps
serving and no block leaks."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pagedkv.engine.engine import LLMEngine
from pagedkv.kv import check_invariants
from pagedkv.serving.app import build_app
from pagedkv.serving.threaded import ThreadedServer

MAX_MODEL_LEN = 256
BODY_LIMIT = 32 * 1024


@pytest.fixture(scope="module")
def server(loaded_model):
    engine = LLMEngine(loaded_model, num_blocks=64, block_size=16, max_model_len=MAX_MODEL_LEN,
                       enable_prefix_caching=True, debug_invariants=True)
    srv = ThreadedServer(build_app(engine, served_model_name="smol", max_body_bytes=BODY_LIMIT, max_n=4))
    http = httpx.Client(base_url=srv.url, timeout=60)
    yield http, engine
    http.close()
    srv.stop()


def _post(http, path, body, **kw):
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    return http.post(path, content=body, headers={"content-type": "application/json"}, **kw)


def _check(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture
def after_ok(server):
    """After each bad request: nothing queued, 0 blocks used, invariants clean, and the
    engine still answers a good request."""
    yield
    http, engine = server
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0
    check_invariants(engine.kv)
    ok = _post(http, "/v1/completions", {"model": "smol", "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


GOOD = {"model": "smol", "prompt": "Hello", "max_tokens": 4}


def test_malformed_json_400(server, after_ok):
    http, _ = server
    err = _check(_post(http, "/v1/completions", '{"model": "smol", "prompt": "Hello",'), 400)
    assert err["code"] == "invalid_json"
    _check(_post(http, "/v1/chat/completions", "[1, 2]"), 400)


def test_wrong_type_422(server, after_ok):
    http, _ = server
    _check(_post(http, "/v1/completions", {**GOOD, "max_tokens": "ten"}), 422, "max_tokens")
    _check(_post(http, "/v1/completions", {**GOOD, "prompt": {"text": "x"}}), 422)
    _check(_post(http, "/v1/chat/completions", {"model": "smol", "messages": "hello"}), 422, "messages")
    _check(_post(http, "/v1/completions", {**GOOD, "stream": "yes"}), 422, "stream")


def test_missing_field_422(server, after_ok):
    http, _ = server
    _check(_post(http, "/v1/completions", {"model": "smol"}), 422, "prompt")


def test_unknown_model_404(server, after_ok):
    http, _ = server
    err = _check(_post(http, "/v1/completions", {**GOOD, "model": "gpt-4"}), 404, "model")
    assert err["code"] == "model_not_found"
    _check(_post(http, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404)
    _check(http.get("/v1/models/nope"), 404)


def test_max_tokens_above_context_400(server, after_ok):
    http, _ = server
    err = _check(_post(http, "/v1/completions", {**GOOD, "max_tokens": MAX_MODEL_LEN + 10}), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"
    _check(_post(http, "/v1/chat/completions", {"model": "smol", "max_tokens": MAX_MODEL_LEN,
                                                "messages": [{"role": "user", "content": "x"}]}), 400, "max_tokens")


def test_prompt_too_long_400(server, after_ok):
    http, _ = server
    err = _check(_post(http, "/v1/completions", {**GOOD, "prompt": "hello " * 400}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    _check(_post(http, "/v1/completions", {**GOOD, "prompt": list(range(10, 10 + MAX_MODEL_LEN))}), 400, "prompt")
    _check(_post(http, "/v1/chat/completions", {"model": "smol", "messages": [{"role": "user", "content": "hi " * 400}]}),
           400, "messages")


def test_n_too_large_400(server, after_ok):
    http, _ = server
    _check(_post(http, "/v1/completions", {**GOOD, "n": 5}), 400, "n")
    _check(_post(http, "/v1/completions", {**GOOD, "n": 0}), 422, "n")


def test_negative_temperature_422(server, after_ok):
    http, _ = server
    _check(_post(http, "/v1/completions", {**GOOD, "temperature": -0.5}), 422, "temperature")
    _check(_post(http, "/v1/chat/completions", {"model": "smol", "temperature": -1,
                                                "messages": [{"role": "user", "content": "x"}]}), 422, "temperature")


def test_body_over_limit_413(server, after_ok):
    http, _ = server
    big = json.dumps({**GOOD, "prompt": "x" * (BODY_LIMIT + 100)})
    err = _check(_post(http, "/v1/completions", big), 413)
    assert err["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while reading
        for _ in range(BODY_LIMIT // 1024 + 4):
            yield b" " * 1024
        yield json.dumps(GOOD).encode()

    _check(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_bad_token_id_in_batch_aborts_admitted_prompts(server, after_ok):
    http, engine = server
    vocab = engine.model_config.vocab_size
    # the first prompt is admitted before the second is rejected: it must be aborted
    err = _check(_post(http, "/v1/completions", {**GOOD, "prompt": [[1, 2, 3], [vocab + 5]]}), 400)
    assert "token" in err["message"]


def test_other_limits_422(server, after_ok):
    http, _ = server
    _check(_post(http, "/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}), 422, "stop")
    _check(_post(http, "/v1/completions", {**GOOD, "logprobs": 50}), 422, "logprobs")
    _check(_post(http, "/v1/completions", {**GOOD, "cache_salt": "a\x00b"}), 422, "cache_salt")
    _check(_post(http, "/v1/completions", {**GOOD, "top_p": 0}), 422, "top_p")


def test_unknown_route_and_method(server, after_ok):
    http, _ = server
    _check(http.get("/v1/nothing"), 404)
    _check(http.get("/v1/completions"), 405)


def test_seed_out_of_range_and_echo_of_bad_ids_are_4xx(server, after_ok):
    # out of a schema range (int64 seeds, token ids >= 0): 422 naming the field; a token id
    # past the vocabulary is known only to the model: 400
    http, engine = server
    for path, body, status, param in (
        ("/v1/completions", {**GOOD, "seed": 2**64}, 422, "seed"),
        ("/v1/chat/completions", {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "seed": -(2**64)},
         422, "seed"),
        ("/v1/completions", {**GOOD, "prompt": [-3], "echo": True}, 422, "prompt"),
        ("/v1/completions", {**GOOD, "prompt": [engine.model_config.vocab_size], "echo": True}, 400, "prompt"),
    ):
        _check(_post(http, path, body), status, param)
