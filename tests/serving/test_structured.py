"""Structured outputs through the server and the official ``openai`` client: ``parse`` with
a pydantic model, ``response_format`` json_object / json_schema, the ``guided_*`` extras,
streamed == non-streamed, and 400s naming the parameter for bad schemas and grammars."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")

from pagedkv.engine.engine import LLMEngine  # noqa: E402
from pagedkv.kv import check_invariants  # noqa: E402
from pagedkv.serving.app import build_app  # noqa: E402
from pagedkv.serving.threaded import ThreadedServer  # noqa: E402


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=50_000_000)
    kind: Literal["capital", "town", "village"]


SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 30},
                   "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                   "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]},
                              "minItems": 1, "maxItems": 2}},
    "required": ["title", "year", "genres"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(loaded_model):
    engine = LLMEngine(loaded_model, num_blocks=192, block_size=16, max_model_len=512, debug_invariants=True)
    srv = ThreadedServer(build_app(engine, served_model_name=["smol"]))
    yield srv, engine
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    srv, _ = server
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _idle(engine, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0
    check_invariants(engine.kv)


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model(server, client):
    _, engine = server
    for temperature in (0.0, 1.0):
        done = client.chat.completions.parse(model="smol", messages=_chat("Describe Paris as JSON."),
                                             response_format=City, temperature=temperature, seed=3,
                                             max_tokens=200)
        msg = done.choices[0].message
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, City)
        assert msg.parsed == City.model_validate_json(msg.content)
    _idle(engine)


def test_json_object_mode(client):
    ask = 'Reply with a JSON object with the keys "name" and "age" of a person.'
    r = client.chat.completions.create(model="smol", messages=_chat(ask),
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=150)
    obj = json.loads(r.choices[0].message.content)
    assert isinstance(obj, dict) and set(obj) == {"name", "age"}
    assert r.choices[0].finish_reason == "stop"


def test_json_schema_stream_equals_nonstream(server, client):
    _, engine = server
    kw = dict(model="smol", messages=_chat("A film as JSON."), temperature=1.0, seed=5, max_tokens=200,
              response_format={"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA,
                                                                      "strict": True}})
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    pieces, finish = [], None
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == text and finish == "stop"
    _idle(engine)


def test_guided_extras_on_completions(client):
    cases = [
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_regex": r"[A-Z]{2}-[0-9]{4}"}, lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{4}", t)),
        ({"guided_grammar": 'root ::= "x=" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x=[0-9][0-9]?", t)),
        ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ]
    for extra, ok in cases:
        r = client.completions.create(model="smol", prompt="Answer:", max_tokens=120, temperature=0.7, seed=1,
                                      n=2, extra_body=extra)
        assert len(r.choices) == 2
        for c in r.choices:
            assert ok(c.text), (extra, c.text)
            assert c.finish_reason == "stop"


@pytest.mark.parametrize("body,param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
    ({"guided_grammar": "root ::= root"}, "guided_grammar", "accepts no output"),  # empty language
    ({"guided_regex": "\\"}, "guided_regex", "lone backslash"),
])
def test_bad_constraints_are_400_naming_the_problem(server, body, param, needle):
    srv, engine = server
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"model": "smol", "messages": _chat("hi"), "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_value"
    assert needle in err["message"]
    _idle(engine)


def test_response_format_schema_errors_are_422_or_400(server):
    srv, _ = server
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"model": "smol", "messages": _chat("hi"), "response_format": {"type": "json_schema"}})
    assert r.status_code in (400, 422)
    assert "json_schema" in r.text
    text = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                      json={"model": "smol", "messages": _chat("hi"), "max_tokens": 3,
                            "response_format": {"type": "text"}})
    assert text.status_code == 200


def test_openapi_document_lists_the_new_fields(server):
    srv, _ = server
    doc = httpx.get(srv.url + "/openapi.json").json()
    for model in ("ChatCompletionRequest", "CompletionRequest"):
        props = doc["components"]["schemas"][model]["properties"]
        for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            assert name in props, (model, name)
    fmt = doc["components"]["schemas"]["ResponseFormat"]["properties"]["type"]
    assert set(fmt["enum"]) == {"text", "json_object", "json_schema"}


def test_runtime_grammar_failure_is_finish_error_and_counted(server, client):
    """``root ::= "ab" root`` never ends (llguidance's parser limit): the choice ends with
    finish_reason "error" and text within the grammar, never unconstrained text; streamed
    the same; the failure is in /metrics by reason."""
    srv, engine = server
    for _ in range(2):
        r = client.completions.create(model="smol", prompt="Say ab:", max_tokens=20, temperature=0,
                                      extra_body={"guided_grammar": 'root ::= "ab" root'})
        c = r.choices[0]
        assert re.fullmatch(r"(ab)*a?", c.text) and c.finish_reason == "error", (c.text, c.finish_reason)
    chunks = list(client.completions.create(model="smol", prompt="Say ab:", max_tokens=20, temperature=0,
                                            stream=True, extra_body={"guided_grammar": 'root ::= "ab" root'}))
    assert chunks[-1].choices[0].finish_reason == "error"
    assert re.fullmatch(r"(ab)*a?", "".join(ch.choices[0].text for ch in chunks if ch.choices))
    _idle(engine)
    text = httpx.get(srv.url + "/metrics").text
    line = next(ln for ln in text.splitlines()
                if ln.startswith("pagedkv_grammar_failures_total{") and 'reason="parser_limit"' in ln)
    assert float(line.rsplit(" ", 1)[1]) >= 3
    assert 'pagedkv_requests_finished_total{finish_reason="error",model_name="smol"}' in text
