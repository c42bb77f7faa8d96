"""Tool calling through the server and the ``openai`` client: named and ``required``
calls constrained by the tools' schemas, ``auto`` parsing of ``<tool_call>`` blocks,
``none``, streamed tool-call deltas == the non-streamed calls, multi-turn messages with
earlier calls, and 400s for inconsistent ``tool_choice``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")

from pagedkv.engine.engine import LLMEngine  # noqa: E402
from pagedkv.serving.app import build_app  # noqa: E402
from pagedkv.serving.schemas import ChatCompletionRequest  # noqa: E402
from pagedkv.serving.threaded import ThreadedServer  # noqa: E402
from pagedkv.serving.tools import ToolCalls  # noqa: E402

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a zone",
                                      "parameters": TIME}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(loaded_model):
    engine = LLMEngine(loaded_model, num_blocks=192, block_size=16, max_model_len=1024, debug_invariants=True)
    srv = ThreadedServer(build_app(engine, served_model_name=["smol"]))
    yield srv, engine
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    srv, _ = server
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call, schemas):
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_tool_choice_is_a_valid_call(client):
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model="smol", messages=ASK, tools=TOOLS, temperature=temperature, seed=2, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls"
        assert ch.message.content is None
        assert [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
        _check_call(ch.message.tool_calls[0], {"get_weather": WEATHER})


def test_required_calls_declared_tools(client):
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for parallel in (True, False):
        r = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, temperature=1.0, seed=4, max_tokens=200)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls"
        assert 1 <= len(ch.message.tool_calls) <= (10 if parallel else 1)
        for call in ch.message.tool_calls:
            _check_call(call, schemas)


def test_streamed_tool_call_equals_non_streamed(client):
    kw = dict(model="smol", messages=ASK, tools=TOOLS, temperature=1.0, seed=9, max_tokens=120,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    full = client.chat.completions.create(**kw).choices[0]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                cur = calls.setdefault(d.index, {"name": "", "arguments": ""})
                cur["name"] += d.function.name or ""
                cur["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": full.message.tool_calls[0].function.arguments}}


def test_none_hides_the_tools_and_auto_shows_them(client):
    none = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8)
    plain = client.chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=8)
    auto = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools' system message


def test_auto_parses_tool_call_blocks():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": TOOLS})
    tc = ToolCalls.of(body)
    assert tc.mode == "auto" and tc.names == ["get_weather", "get_time"]
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '\n</tool_call>\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
    msg, finish = tc.message(text, "stop")
    assert finish == "tool_calls"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert msg["content"].startswith("Let me check.") and "get_weather" not in msg["content"]
    # not finished by the model: no calls parsed
    assert tc.message(text, "length") == ({"role": "assistant", "content": text}, "length")
    assert tc.message("Sunny.", "stop") == ({"role": "assistant", "content": "Sunny."}, "stop")
    msgs = tc.messages([{"role": "system", "content": "Be brief."}, *ASK])
    assert len(msgs) == 2 and msgs[0]["content"].startswith("Be brief.") and '"get_time"' in msgs[0]["content"]


def test_multi_turn_with_an_earlier_call(server):
    srv, _ = server
    convo = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"model": "smol", "messages": convo, "tools": TOOLS, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    tok = httpx.post(srv.url + "/tokenize", json={"messages": convo, "return_token_strs": False}).json()
    assert tok["count"] > 0


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
])
def test_inconsistent_tool_choice_is_400(server, extra, param):
    srv, engine = server
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"model": "smol", "messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not engine.has_unfinished_requests()
