"""/tokenize, /detokenize (vLLM's shapes) and /version, behind the API key."""

from __future__ import annotations

import httpx
import pytest

import pagedkv
from pagedkv.engine.engine import LLMEngine
from pagedkv.serving.app import build_app
from pagedkv.serving.threaded import ThreadedServer

AUTH = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def served(loaded_model):
    engine = LLMEngine(loaded_model, num_blocks=16, block_size=16, max_model_len=256)
    srv = ThreadedServer(build_app(engine, served_model_name="smol", api_keys={"k": "t"}))
    client = httpx.Client(base_url=srv.url, timeout=60, headers=AUTH)
    yield client, engine
    client.close()
    srv.stop()


def test_tokenize_detokenize_round_trip(served):
    http, engine = served
    text = "Héllo wörld, 東京 🙂"
    r = http.post("/tokenize", json={"model": "smol", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = list(engine.tokenizer(text)["input_ids"])
    assert body == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                    "token_strs": engine.tokenizer.convert_ids_to_tokens(ids)}
    assert http.post("/detokenize", json={"model": "smol", "tokens": ids}).json() == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    want = engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat["tokens"] == want and chat["count"] == len(want) and chat["token_strs"] is None
    no_gen = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}],
                                          "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == want[:no_gen["count"]] and no_gen["count"] < len(want)
    assert http.get("/version").json() == {"version": pagedkv.__version__}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 422, None),
    ("/tokenize", {}, 422, None),
    ("/tokenize", {"prompt": 3}, 422, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 422, None),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 422, "tokens"),
])
def test_bad_input_is_a_4xx_openai_error(served, path, body, status, param):
    http, _ = served
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param


def test_key_required(served):
    http, _ = served
    for method, path in (("GET", "/version"), ("POST", "/tokenize"), ("POST", "/detokenize")):
        r = httpx.request(method, str(http.base_url).rstrip("/") + path, json={"tokens": [1]})
        assert r.status_code == 401, (path, r.text)


def test_a_served_fast_tokenizer_builds_transformers_tokenizer_at_start(loaded_model, tmp_path):
    """A warm start's ``FastTokenizer`` (no transformers import): the server builds its
    transformers tokenizer before serving (chat templates render through it), and the routes
    answer as with transformers' tokenizer."""
    import dataclasses
    import shutil

    from pagedkv.model import weight_cache
    from pagedkv.model.fast_tokenizer import FastTokenizer, open_fast

    assert loaded_model.cache_dir is not None
    entry = tmp_path / loaded_model.cache_dir.name
    shutil.copytree(loaded_model.cache_dir, entry)
    hf = getattr(loaded_model.tokenizer, "hf", loaded_model.tokenizer)
    assert weight_cache.record_fast_tokenizer(entry, hf) is True
    fast = open_fast(entry, entry / "tokenizer")
    assert isinstance(fast, FastTokenizer) and fast._hf is None
    engine = LLMEngine(dataclasses.replace(loaded_model, tokenizer=fast), num_blocks=16, block_size=16,
                       max_model_len=256)
    srv = ThreadedServer(build_app(engine, served_model_name="smol"))
    try:
        assert fast._hf is not None  # built by the app's start, before the first request
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            text = "Héllo wörld, 東京 🙂<|im_end|>"
            body = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
            assert body["tokens"] == list(hf(text, add_special_tokens=False)["input_ids"])
            assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"])
            assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": text}
            msgs = [{"role": "user", "content": "Hi"}]
            chat = http.post("/tokenize", json={"messages": msgs}).json()
            want = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
            assert chat["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
            r = http.post("/v1/chat/completions", json={"model": "smol", "messages": msgs, "max_tokens": 4,
                                                        "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == chat["count"]
            assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    finally:
        srv.stop()
