"""API keys and tenant isolation: 401 without a valid key; two tenants never share a
prefix-cache block, the same tenant does (seed §04)."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from pagedkv.engine.engine import LLMEngine
from pagedkv.kv import check_invariants
from pagedkv.kv import CacheKeys, hash_blocks
from pagedkv.serving.api_keys import load_api_keys
from pagedkv.serving.app import build_app
from pagedkv.serving.threaded import ThreadedServer

KEYS = {"key-alice": "alice", "key-alice-2": "alice", "key-bob": "bob"}
PROMPT = ("The paged KV cache splits every request into fixed-size blocks of tokens; a block table "
          "maps each logical block to a physical block anywhere in the pool, so memory is not "
          "reserved contiguously for the longest possible request.")


@pytest.fixture(scope="module")
def server(loaded_model):
    engine = LLMEngine(loaded_model, num_blocks=96, block_size=16, max_model_len=512,
                       enable_prefix_caching=True, debug_invariants=True)
    srv = ThreadedServer(build_app(engine, served_model_name="smol", api_keys=KEYS))
    http = httpx.Client(base_url=srv.url, timeout=60)
    yield srv, http, engine
    http.close()
    srv.stop()


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


def _complete(http, key, **kw):
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **kw}
    r = http.post("/v1/completions", json=body, headers=_auth(key))
    assert r.status_code == 200, r.text
    return r.json()


def _wait_idle(engine):
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.kv.num_used_blocks == 0
    check_invariants(engine.kv)


def test_missing_or_bad_key_401(server):
    _, http, engine = server
    for headers in ({}, _auth("wrong"), {"Authorization": "Basic a2V5LWFsaWNl"}):
        for method, path, body in (("POST", "/v1/completions", {"model": "smol", "prompt": "x"}),
                                   ("POST", "/v1/chat/completions", {"model": "smol", "messages": [{"role": "user", "content": "x"}]}),
                                   ("GET", "/v1/models", None), ("GET", "/ui/state", None)):
            r = http.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            assert r.headers.get("www-authenticate") == "Bearer"
    assert engine.get_stats().num_prompt_tokens == 0  # nothing reached the engine
    assert http.get("/v1/models", headers=_auth("key-bob")).status_code == 200
    assert http.get("/health").status_code == 200  # only health stays open
    for path in ("/metrics", "/ui", "/openapi.json"):
        assert http.get(path).status_code == 401, path
        assert http.get(path, headers=_auth("key-bob")).status_code == 200, path


def test_two_tenants_never_hit_each_other(server):
    _, http, engine = server
    a = _complete(http, "key-alice")
    b = _complete(http, "key-bob")  # same prompt, other tenant: a miss
    a2 = _complete(http, "key-alice-2")  # same tenant, other key: a hit
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    n_full = (len(engine.tokenize(PROMPT)) - 1) // 16  # whole blocks, never the whole prompt
    assert n_full >= 2
    assert a2["usage"]["prompt_tokens_details"]["cached_tokens"] == n_full * 16
    assert a["choices"][0]["text"] == b["choices"][0]["text"] == a2["choices"][0]["text"]
    # the same user salt in two tenants is still two identities; a new salt is a miss
    s1 = _complete(http, "key-alice", cache_salt="s")
    s2 = _complete(http, "key-bob", cache_salt="s")
    s3 = _complete(http, "key-alice", cache_salt="s")
    assert s1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert s2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert s3["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    _wait_idle(engine)


@contextlib.contextmanager
def _running_stream(http, key):
    """Open a streaming completion, wait for its first token, yield its engine request id."""
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body, headers=_auth(key)) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                break
        yield chunk["id"] + "-0"


def test_concurrent_tenants_share_no_block(server):
    srv, http, engine = server
    loop = srv.server.config.app.state.pagedkv.loop
    with _running_stream(http, "key-alice") as ra, _running_stream(http, "key-bob") as rb, \
            _running_stream(http, "key-alice-2") as ra2:
        assert loop.pause()
        try:
            ta, tb, ta2 = (set(engine.kv.get_block_ids(r)) for r in (ra, rb, ra2))
            assert ta and tb and ta2
            assert not ta & tb and not ta2 & tb  # 0 shared blocks across tenants
            n_full = (len(engine.tokenize(PROMPT)) - 1) // 16
            assert len(ta & ta2) == n_full  # the same tenant shares its prompt's full blocks
            snap = engine.kv.snapshot()
            for blk in snap["blocks"]:
                if rb in blk["owners"]:
                    assert blk["owners"] == [rb]
            # the /ui data shows bob his own request; alice's blocks only as "other"
            view = http.get("/ui/state", headers=_auth("key-bob")).json()
            assert [r["request_id"] for r in view["requests"]] == [rb]
            owners = view["blocks"]["owners"]
            assert {o for v in owners.values() for o in v} == {rb, "other"}
            assert sorted(int(b) for b, v in owners.items() if v == [rb]) == sorted(tb)
        finally:
            loop.resume()
    _wait_idle(engine)  # the three disconnects were aborted and freed


def test_api_key_file_formats(tmp_path):
    j = tmp_path / "keys.json"
    j.write_text(json.dumps({"k1": "t1", "k2": "t2"}))
    assert load_api_keys(str(j)) == {"k1": "t1", "k2": "t2"}
    t = tmp_path / "keys.txt"
    t.write_text("# key tenant\nk1 t1\n\nk2   t2\n")
    assert load_api_keys(str(t)) == {"k1": "t1", "k2": "t2"}
    bad = tmp_path / "bad.txt"
    bad.write_text("k1\n")
    with pytest.raises(ValueError):
        load_api_keys(str(bad))
    # the tenant is its own typed key of the block identity: never equal to a salt
    toks = list(range(8))
    h = lambda **kw: hash_blocks(toks, 4, CacheKeys(**kw))  # noqa: E731
    assert h(tenant="a") != h(tenant="b")
    assert h(tenant="7") != h(cache_salt="7")
    assert h(tenant="a", cache_salt="s") != h(tenant="a")
    assert h(tenant="a") == h(tenant="a")
