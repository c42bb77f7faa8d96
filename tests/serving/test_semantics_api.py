"""Output semantics through the OpenAI-compatible server (SmolLM2 greedy; Gemma-3 for BOS):
``stop_token_ids`` / ``include_stop_str_in_output`` (streamed = non-streamed), ``min_tokens``,
chat ``continue_final_message`` / ``add_generation_prompt`` (and the ingress's prompt ids),
chat logprobs ``bytes`` of tokens that hold part of a character, one BOS."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from pagedkv.engine.engine import LLMEngine
from pagedkv.kv import check_invariants
from pagedkv.model.tokenizer import token_bytes
from pagedkv.serving.app import build_app
from pagedkv.serving.threaded import ThreadedServer
from pagedkv.serving.replicas.ingress import Ingress

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
PARIS = "The capital of France is"  # greedy: ' Paris' '.' '\n' '\n' 'The' ' answer' ' is' ...
SUM_Q = "What is 2+2? Answer with a number only."  # greedy chat answer: '2 + 2 = 4' <|im_end|>
YES_NO = "Reply with one word: yes or no? Is the sky blue?"  # greedy: 'No' <|im_end|>
CONV = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def server(loaded_model):
    engine = LLMEngine(loaded_model, num_blocks=128, block_size=16, max_model_len=256, debug_invariants=True)
    srv = ThreadedServer(build_app(engine, served_model_name="smol", max_n=4))
    client = httpx.Client(base_url=srv.url, timeout=120)
    yield client, engine
    client.close()
    srv.stop()
    assert engine.kv.num_used_blocks == 0
    check_invariants(engine.kv)


def post(http, path, body, status=200, model="smol"):
    r = http.post(path, json={"model": model, "temperature": 0, **body})
    assert r.status_code == status, r.text
    return r.json()


def stream(http, path, body, model="smol"):
    """The streamed text joined (chat: the deltas' content), the finish reason, the usage."""
    with http.stream("POST", path, json={"model": model, "temperature": 0, **body, "stream": True,
                                         "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text, finish, usage = "", None, None
    for e in map(json.loads, events[:-1]):
        usage = e.get("usage") or usage
        for c in e["choices"]:
            text += (c["delta"].get("content") or "") if "delta" in c else c["text"]
            finish = c["finish_reason"] or finish
    return text, finish, usage


def _chat_text(resp):
    return resp["choices"][0]["message"]["content"]


def test_stop_token_ids_and_include_stop_str_in_output(server):
    http, _ = server
    cases = [  # (path, body, text, text with include_stop_str_in_output)
        (CMPL, {"prompt": PARIS, "max_tokens": 12, "stop_token_ids": [30]}, " Paris", " Paris."),
        (CMPL, {"prompt": PARIS, "max_tokens": 12, "stop": ["."]}, " Paris", " Paris."),
        (CHAT, {"messages": [{"role": "user", "content": SUM_Q}], "max_tokens": 20, "stop_token_ids": [36]},
         "2 + 2 = ", "2 + 2 = 4"),
        (CHAT, {"messages": [{"role": "user", "content": SUM_Q}], "max_tokens": 20}, "2 + 2 = 4", "2 + 2 = 4"),
    ]
    for path, body, want, want_incl in cases:
        for incl, expect in ((False, want), (True, want_incl)):
            b = {**body, "include_stop_str_in_output": incl}
            resp = post(http, path, b)
            text = _chat_text(resp) if path == CHAT else resp["choices"][0]["text"]
            assert text == expect, (body, incl)
            assert resp["choices"][0]["finish_reason"] == "stop"
            s_text, s_finish, s_usage = stream(http, path, b)
            assert (s_text, s_finish) == (expect, "stop")
            assert s_usage["completion_tokens"] == resp["usage"]["completion_tokens"]
    # the stop token is counted (it is in token_ids): ' Paris' '.'
    assert post(http, CMPL, cases[0][1])["usage"]["completion_tokens"] == 2


def test_min_tokens(server):
    http, _ = server
    body = {"messages": [{"role": "user", "content": YES_NO}], "max_tokens": 10}
    resp = post(http, CHAT, body)
    assert (_chat_text(resp), resp["usage"]["completion_tokens"]) == ("No", 2)  # 'No' <|im_end|>
    resp = post(http, CHAT, {**body, "min_tokens": 5})
    assert resp["usage"]["completion_tokens"] >= 5 and _chat_text(resp).startswith("No")
    text, _, usage = stream(http, CHAT, {**body, "min_tokens": 5})
    assert text == _chat_text(resp) and usage["completion_tokens"] == resp["usage"]["completion_tokens"]
    # the '.' stop string inside the first 3 tokens (' Paris' '.' '\n') does not end it
    resp = post(http, CMPL, {"prompt": PARIS, "max_tokens": 12, "stop": ["."], "min_tokens": 3})
    assert resp["choices"][0]["text"] == " Paris.\n\nThe answer is: 201"
    err = post(http, CMPL, {"prompt": PARIS, "max_tokens": 4, "min_tokens": 5}, status=400)["error"]
    assert err["param"] == "min_tokens" and err["code"] == "invalid_value"
    post(http, CMPL, {"prompt": PARIS, "max_tokens": 4, "min_tokens": -1}, status=422)
    post(http, CHAT, {**body, "min_tokens": 2, "response_format": {"type": "json_object"}}, status=400)


def test_continue_final_message(server):
    http, engine = server
    want_ids = engine.apply_chat_template(CONV, add_generation_prompt=False, continue_final_message=True)
    body = {"messages": CONV, "max_tokens": 8, "add_generation_prompt": False, "continue_final_message": True}
    resp = post(http, CHAT, body)
    assert _chat_text(resp) == " Paris." and resp["usage"]["prompt_tokens"] == len(want_ids)
    assert stream(http, CHAT, body)[0] == " Paris."
    tok = post(http, "/tokenize", {"messages": CONV, "add_generation_prompt": False, "continue_final_message": True})
    assert tok["tokens"] == want_ids
    # vLLM's rules: both flags true, or a last message that is not the assistant's: 400
    for bad in ({"messages": CONV, "continue_final_message": True},
                {"messages": CONV[:1], "add_generation_prompt": False, "continue_final_message": True}):
        err = post(http, CHAT, bad, status=400)["error"]
        assert err["param"] == "continue_final_message"
    # add_generation_prompt false without continuing: the closed conversation
    closed = engine.apply_chat_template(CONV, add_generation_prompt=False)
    resp = post(http, CHAT, {"messages": CONV, "max_tokens": 1, "add_generation_prompt": False})
    assert resp["usage"]["prompt_tokens"] == len(closed) == len(want_ids) + 2  # <|im_end|> '\n'
    # the ingress hashes the same prompt ids the replica runs
    ing = SimpleNamespace(tokenizer=engine.tokenizer)
    assert Ingress.prompt_ids(ing, CHAT, {"model": "smol", **body}) == want_ids
    assert Ingress.prompt_ids(ing, CHAT, {"model": "smol", "messages": CONV[:1]}) == \
        engine.apply_chat_template(CONV[:1])


def test_chat_logprob_bytes_rebuild_multibyte_text(server):
    http, engine = server
    word = "日本 é"
    resp = post(http, CHAT, {"messages": [{"role": "user", "content": "Say Japan in Japanese."}],
                             "max_tokens": 12, "logprobs": True, "top_logprobs": 2, "guided_choice": [word]})
    ch = resp["choices"][0]
    assert ch["message"]["content"] == word
    entries = ch["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries) == word.encode("utf-8")
    # some token holds part of a character: its text is U+FFFD, its bytes are its own
    partial = [e for e in entries if e["token"] == "\ufffd"]
    assert partial and all(bytes(e["bytes"]) != "\ufffd".encode() for e in partial)
    for e in entries:  # greedy under the grammar's mask: the chosen token is the top alternative
        assert e["top_logprobs"][0]["bytes"] == e["bytes"] and e["top_logprobs"][0]["logprob"] == e["logprob"]
    tok = engine.tokenizer
    ids = tok("日本", add_special_tokens=False)["input_ids"]
    assert b"".join(token_bytes(tok, i) for i in ids) == "日本".encode()
    assert [token_bytes(tok, i) for i in ids] == [b"\xe6\x97", b"\xa5", "本".encode()]


@pytest.fixture(scope="module")
def gemma_server(gemma3_loaded):
    engine = LLMEngine(gemma3_loaded, num_blocks=64, block_size=16, max_model_len=256)
    srv = ThreadedServer(build_app(engine, served_model_name="gemma"))
    client = httpx.Client(base_url=srv.url, timeout=120)
    yield client, engine
    client.close()
    srv.stop()
    assert engine.kv.num_used_blocks == 0


def test_gemma3_prompt_starting_with_bos_gets_one(gemma_server):
    http, _ = gemma_server
    want = [2, 818, 5279, 529, 7001, 563]
    plain = post(http, CMPL, {"prompt": PARIS, "max_tokens": 4}, model="gemma")
    with_bos = post(http, CMPL, {"prompt": "<bos>" + PARIS, "max_tokens": 4}, model="gemma")
    assert plain["usage"]["prompt_tokens"] == with_bos["usage"]["prompt_tokens"] == len(want)
    assert plain["choices"][0]["text"] == with_bos["choices"][0]["text"]
    assert post(http, "/tokenize", {"prompt": "<bos>" + PARIS}, model="gemma")["tokens"] == want
    assert post(http, "/tokenize", {"prompt": "<bos>" + PARIS, "add_special_tokens": False},
                model="gemma")["tokens"] == want
