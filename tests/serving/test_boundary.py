"""The server's input boundary: the seven inputs that used to reach a 500, a NaN
or a silent ignore, each with its status and OpenAI error object; logit_bias and best_of
honoured; every route but /health behind the API key; slow clients cut; a 500 logged with
a request id."""

from __future__ import annotations

import json
import logging
import math
import socket
import time

import httpx
import pytest

from pagedkv.engine.engine import LLMEngine
from pagedkv.kv import check_invariants
from pagedkv.serving.app import build_app
from pagedkv.serving.threaded import ThreadedServer

MAX_MODEL_LEN = 256
KEYS = {"key-a": "a"}
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(loaded_model):
    return LLMEngine(loaded_model, num_blocks=64, block_size=16, max_model_len=MAX_MODEL_LEN,
                     enable_prefix_caching=True, debug_invariants=True)


@pytest.fixture(scope="module")
def http(engine):
    srv = ThreadedServer(build_app(engine, served_model_name="smol", max_n=4))
    client = httpx.Client(base_url=srv.url, timeout=120)
    yield client
    client.close()
    srv.stop()


@pytest.fixture
def idle_after(engine, http):
    """After each test: nothing queued, no KV block in use, invariants clean, still serving."""
    yield
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.kv.num_used_blocks == 0
    check_invariants(engine.kv)
    ok = http.post(CMPL, json={"model": "smol", "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


def _post(http, path, body, **kw):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return http.post(path, content=content, headers={"content-type": "application/json", **kw.pop("headers", {})},
                     **kw)


def _err(resp, status, param=None, code=None):
    """The response is ``status`` with exactly OpenAI's error object (and ``param``/``code``)."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _chat(content="Hi", **kw):
    return {"model": "smol", "messages": [{"role": "user", "content": content}], **kw}


def _cmpl(prompt=PROMPT, **kw):
    return {"model": "smol", "prompt": prompt, "max_tokens": 4, **kw}


def _strict(text):
    def no_constant(c):
        raise AssertionError(f"non-JSON constant {c} in {text[:200]}")

    return json.loads(text, parse_constant=no_constant)


# ---- 1. a penalty that made logprobs NaN ---------------------------------------------
def test_1_repetition_penalty_that_made_nan_is_422(http, idle_after):
    bad = {"repetition_penalty": 1e-300, "temperature": 0.8}
    for stream in (False, True):
        _err(_post(http, CMPL, _cmpl(logprobs=1, stream=stream, **bad)), 422, "repetition_penalty", "invalid_value")
        _err(_post(http, CHAT, _chat(logprobs=True, top_logprobs=1, stream=stream, **bad)), 422,
             "repetition_penalty")
    _err(_post(http, CMPL, _cmpl(**bad)), 422, "repetition_penalty")  # no longer 200 with empty text
    _err(_post(http, CMPL, _cmpl(repetition_penalty=101)), 422, "repetition_penalty")


def test_1_extreme_allowed_parameters_give_finite_logprobs(http, engine, idle_after):
    """Every bound at once, streamed and not: strict JSON, finite logprobs, real text."""
    tok = engine.tokenize(" Paris")[0]
    for rep in (0.01, 100):
        params = {"repetition_penalty": rep, "temperature": 2, "frequency_penalty": 2, "presence_penalty": -2,
                  "logit_bias": {str(tok): 100, "0": -100}, "seed": 3, "logprobs": 5, "max_tokens": 6}
        r = _post(http, CMPL, _cmpl(**params))
        assert r.status_code == 200, r.text
        lp = _strict(r.text)["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == 6 and all(math.isfinite(v) and v <= 0 for v in lp["token_logprobs"])
        r = _post(http, CMPL, _cmpl(stream=True, **params))
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        streamed = [v for e in events[:-1] for v in (_strict(e)["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
        assert len(streamed) == 6 and all(math.isfinite(v) for v in streamed)


# ---- 2. deeply nested JSON --------------------------------------------------------------
def test_2_deeply_nested_body_is_400(http, idle_after):
    body = "[" * 50_000 + "]" * 50_000  # 100 KB, depth 50,000: under the body limit
    err = _err(_post(http, CMPL, body), 400, code="invalid_json")
    assert "nested 50000 levels" in err["message"]
    inner = '{"model": "smol", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    _err(_post(http, CHAT, inner), 400, code="invalid_json")
    # brackets inside strings do not count; 32 levels pass the parser (then fail the schema)
    assert _post(http, CMPL, _cmpl(prompt="[{" * 100)).status_code == 200  # 200 brackets, 200 tokens
    _err(_post(http, CMPL, _cmpl(prompt=json.loads("[" * 31 + "]" * 31))), 422, "prompt")


# ---- 3. huge integers -------------------------------------------------------------------
def test_3_huge_integer_is_422_naming_the_field(http, idle_after):
    digits = "9" * 5000
    body = json.dumps(_cmpl()).replace('"max_tokens": 4', f'"max_tokens": 4, "seed": {digits}')
    err = _err(_post(http, CMPL, body), 422, "seed", "invalid_value")
    assert "5000 characters" in err["message"]
    body = json.dumps(_chat()).replace('"messages"', f'"n": -{digits}, "messages"')
    _err(_post(http, CHAT, body), 422, "n")
    body = json.dumps(_cmpl()).replace('"max_tokens": 4', '"max_tokens": 4, "temperature": 1e999')
    _err(_post(http, CMPL, body), 422, "temperature")  # parses as inf
    body = json.dumps(_cmpl()).replace('"max_tokens": 4', '"max_tokens": 4, "temperature": NaN')
    _err(_post(http, CMPL, body), 400, code="invalid_json")  # not JSON


# ---- 4. invalid Unicode -----------------------------------------------------------------
def test_4_lone_surrogate_is_400_on_both_endpoints(http, idle_after):
    raw = lambda body: json.dumps(body)  # noqa: E731 - json.dumps writes "\ud800" as an escape
    _err(_post(http, CMPL, raw(_cmpl(prompt="Hello \ud800 world"))), 400, "prompt", "invalid_unicode")
    _err(_post(http, CMPL, raw(_cmpl(prompt=["ok", "bad \udfff"]))), 400, "prompt.1", "invalid_unicode")
    _err(_post(http, CHAT, raw(_chat("Hello \ud800"))), 400, "messages.0.content", "invalid_unicode")
    _err(_post(http, CMPL, raw(_cmpl(stop=["\ud800"]))), 400, "stop.0", "invalid_unicode")
    _err(_post(http, CMPL, b'{"model": "smol", "prompt": "\xff\xfe"}'), 400, code="invalid_json")  # not UTF-8
    # a valid pair (an emoji) is fine
    assert _post(http, CMPL, raw(_cmpl(prompt="Hello \U0001F600"))).status_code == 200


# ---- 5. every route behind the key ------------------------------------------------------
def test_5_every_route_but_health_needs_the_key(engine):
    with ThreadedServer(build_app(engine, served_model_name="smol", api_keys=KEYS)) as srv:
        auth = {"Authorization": "Bearer key-a"}
        for path in ("/openapi.json", "/metrics", "/ui", "/ui/state", "/v1/models", "/v1/models/smol"):
            r = httpx.get(srv.url + path)
            _err(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
            assert httpx.get(srv.url + path, headers=auth).status_code == 200, path
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/ui?key=key-a").status_code == 200  # a browser cannot send the header
        _err(httpx.get(srv.url + "/ui?key=wrong"), 401)
        _err(httpx.get(srv.url + "/ui/state?key=key-a"), 401)  # the query key is for the page only
        doc = httpx.get(srv.url + "/openapi.json", headers=auth).json()
        assert doc["paths"]["/metrics"]["get"]["security"] == [{"apiKey": []}]
        assert "security" not in doc["paths"]["/health"]["get"]
        # the document describes the bodies the routes parse (for clients and the fuzzer)
        body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        req = doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
        assert req["required"] == ["model", "prompt"] and req["properties"]["model"]["enum"] == ["smol"]
        assert {"logit_bias", "best_of", "seed", "stop"} <= set(req["properties"])
        assert doc["paths"]["/v1/completions"]["post"]["responses"]["4XX"]["content"]["application/json"]
    app = build_app(engine, served_model_name="smol", api_keys=KEYS, open_routes=("/metrics",))
    with ThreadedServer(app) as srv:  # an explicit opening serves that route alone
        assert httpx.get(srv.url + "/metrics").status_code == 200
        for path in ("/openapi.json", "/ui", "/v1/models"):
            assert httpx.get(srv.url + path).status_code == 401, path
    with pytest.raises(ValueError, match="cannot be opened"):
        build_app(engine, api_keys=KEYS, open_routes=("/v1/completions",))


# ---- 6. every accepted parameter honoured or refused ------------------------------------
def test_6_logit_bias_changes_the_tokens(http, engine, idle_after):
    base = _post(http, CMPL, _cmpl(temperature=0, max_tokens=3, logprobs=0)).json()["choices"][0]
    first = engine.tokenize(PROMPT + base["text"])[len(engine.tokenize(PROMPT))]  # greedy first token
    banned = _post(http, CMPL, _cmpl(temperature=0, max_tokens=3, logit_bias={str(first): -100})).json()
    assert engine.tokenize(PROMPT + banned["choices"][0]["text"])[len(engine.tokenize(PROMPT))] != first
    bang = engine.tokenize("!")[0]
    forced = _post(http, CHAT, _chat(temperature=0, max_tokens=4, logit_bias={str(bang): 100})).json()
    assert forced["choices"][0]["message"]["content"] == "!!!!"
    vocab = engine.model_config.vocab_size
    _err(_post(http, CMPL, _cmpl(logit_bias={str(vocab): 1})), 400, "logit_bias")
    _err(_post(http, CMPL, _cmpl(logit_bias={"1": 100.5})), 422, "logit_bias")
    _err(_post(http, CMPL, _cmpl(logit_bias={"-1": 1})), 422, "logit_bias")
    _err(_post(http, CMPL, _cmpl(logit_bias={str(i): 1 for i in range(301)})), 422, "logit_bias")


def test_6_best_of_returns_the_best_by_cumulative_logprob(http, idle_after):
    common = {"temperature": 1.0, "seed": 11, "max_tokens": 5, "ignore_eos": True}
    all3 = _post(http, CMPL, _cmpl(n=3, logprobs=0, **common)).json()
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in all3["choices"]]
    assert len(set(c["text"] for c in all3["choices"])) > 1  # the candidates differ
    best = _post(http, CMPL, _cmpl(n=1, best_of=3, **common)).json()
    assert len(best["choices"]) == 1 and best["choices"][0]["logprobs"] is None
    assert best["choices"][0]["text"] == all3["choices"][scores.index(max(scores))]["text"]
    assert best["usage"]["completion_tokens"] == 15  # every candidate's tokens
    two = _post(http, CHAT, _chat(n=2, best_of=3, **common)).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    _err(_post(http, CMPL, _cmpl(n=2, best_of=1)), 400, "best_of")
    _err(_post(http, CMPL, _cmpl(best_of=5)), 400, "best_of")  # over max_n = 4
    _err(_post(http, CMPL, _cmpl(best_of=2, stream=True)), 400, "best_of")
    _err(_post(http, CMPL, _cmpl(best_of=0)), 422, "best_of")


def test_6_unimplemented_openai_parameters_are_400(http, idle_after):
    for path, extra, param in (
        (CHAT, {"functions": [{"name": "f"}]}, "functions"),
        (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        (CHAT, {"echo": True}, "echo"),
        (CMPL, {"suffix": "end"}, "suffix"),
    ):
        body = _chat(**extra) if path == CHAT else _cmpl(**extra)
        _err(_post(http, path, body), 400, param, "unsupported_parameter")
    _err(_post(http, CHAT, _chat(top_logprobs=2)), 400, "top_logprobs")  # without logprobs: true
    # their "off" values are accepted (clients send them)
    ok = _post(http, CHAT, _chat(max_tokens=2, tools=[], tool_choice="none", response_format={"type": "text"},
                                 suffix=None, parallel_tool_calls=False))
    assert ok.status_code == 200, ok.text


# ---- 7. slow clients --------------------------------------------------------------------
class _IdleEngine:
    """Just enough engine for /health: the slow-client test needs no model."""

    model_id = "idle"
    config = None

    def has_unfinished_requests(self):
        return False

    def get_num_unfinished_requests(self):
        return 0


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing (raises if still open after ``seconds``)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_7_slow_clients_are_cut_and_do_not_exhaust_the_server():
    srv = ThreadedServer(build_app(_IdleEngine()), header_timeout_s=1.0, body_timeout_s=1.5)
    try:
        addr = (srv.host, srv.port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{"
        trickle_head = [socket.create_connection(addr) for _ in range(150)]
        trickle_body = [socket.create_connection(addr) for _ in range(150)]
        quiet = [socket.create_connection(addr) for _ in range(20)]  # connect, then nothing
        half = [socket.create_connection(addr) for _ in range(20)]  # half a head, then nothing
        for s in trickle_head:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        for s in trickle_body:
            s.sendall(head)
        for s in half:
            s.sendall(b"GET /health HTTP/1.1\r\n")
        t0 = time.monotonic()
        # while 340 slow sockets are open, a normal client is served at once
        r = httpx.get(srv.url + "/health", timeout=5)
        assert r.status_code == 200 and time.monotonic() - t0 < 5
        cut = set()
        while time.monotonic() - t0 < 4.0:  # a byte each 0.2 s: never done, always "active"
            for s in trickle_head + trickle_body:
                if s not in cut:
                    try:
                        s.send(b"a")
                    except OSError:
                        cut.add(s)
            time.sleep(0.2)
        for s in trickle_head + trickle_body:
            _closed_within(s, 3.0)  # raises socket.timeout if the server kept it open
        for s in quiet:  # idle: closed without a word (a client might be about to reuse it)
            assert _closed_within(s, 3.0) == b""
        for s in half:
            data = _closed_within(s, 3.0)
            assert data.startswith(b"HTTP/1.1 408"), data[:100]
            err = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
            assert err["code"] == "request_timeout" and set(err) == {"message", "type", "param", "code"}
        # the body phase answers 408 too when the client stops sending
        s = socket.create_connection(addr)
        s.sendall(head)
        assert _closed_within(s, 4.0).startswith(b"HTTP/1.1 408")
        # a keep-alive connection that trickles its next request after a response is cut
        s = socket.create_connection(addr)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        t1 = time.monotonic()
        with pytest.raises(OSError):
            while time.monotonic() - t1 < 5:
                s.send(b"G")
                time.sleep(0.2)
        assert time.monotonic() - t1 < 3.5
        for s in trickle_head + trickle_body + quiet + half:
            s.close()
        deadline = time.monotonic() + 5
        while len(srv.server.server_state.connections) > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(srv.server.server_state.connections) == 0
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    finally:
        srv.stop()


# ---- a 500 is a bug, logged with a request id ---------------------------------------------
def test_internal_error_is_500_with_a_logged_request_id(http, engine, monkeypatch, caplog):
    def broken(prompt):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "tokenize", broken)
    with caplog.at_level(logging.ERROR, logger="pagedkv.serving"):
        r = _post(http, CMPL, _cmpl())
    err = _err(r, 500, code="internal_error")
    rid = r.headers["x-request-id"]
    assert rid.startswith("req-") and rid in err["message"] and "boom" not in err["message"]
    assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)


def test_bytes_that_are_not_http_get_an_openai_error():
    with ThreadedServer(build_app(_IdleEngine())) as srv:
        for raw in (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                    b"GET /h\xc3\xa9alth HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\r\n\r\n"):
            s = socket.create_connection((srv.host, srv.port))
            s.sendall(raw)
            data = _closed_within(s, 5.0)
            assert data.startswith(b"HTTP/1.1 400"), data[:80]
            err = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
            assert err["code"] == "invalid_http" and set(err) == {"message", "type", "param", "code"}
