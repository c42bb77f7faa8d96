"""Loopback load: 64 concurrent streaming clients, 10% of them disconnect mid-stream. Every
other response is complete and equals the non-streamed answer; afterwards the pool has 0
blocks in use and the invariant checker is clean. Bounded: 64 requests, 8 tokens each
(the disconnecting ones ask for 64 and leave after 2 chunks), 240 s at most."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pagedkv.engine.engine import LLMEngine
from pagedkv.kv import check_invariants
from pagedkv.serving.app import build_app
from pagedkv.serving.threaded import ThreadedServer

N_CLIENTS = 64
DISCONNECT = set(range(0, N_CLIENTS, 11))  # 6 of 64 (~10%)
MAX_TOKENS = 8
PROMPTS = [
    "Write one sentence about the sea and the wind over it on a cold morning:",
    "List three fruits that are red, then explain briefly why they are red:",
    "The paged KV cache lets an inference server keep many requests in memory because",
    "Translate to French, please, the sentence: the cat sleeps on the warm windowsill.",
]


@pytest.fixture(scope="module")
def server(loaded_model):
    engine = LLMEngine(loaded_model, num_blocks=320, block_size=16, max_model_len=256,
                       enable_prefix_caching=True, max_num_seqs=64, max_num_batched_tokens=512)
    srv = ThreadedServer(build_app(engine, served_model_name="smol"))
    yield srv, engine
    srv.stop()


async def _client(http: httpx.AsyncClient, i: int) -> dict:
    leave = i in DISCONNECT
    body = {"model": "smol", "prompt": PROMPTS[i % len(PROMPTS)], "temperature": 0, "ignore_eos": True,
            "max_tokens": 64 if leave else MAX_TOKENS, "stream": True}
    t0 = time.perf_counter()
    res = {"i": i, "text": "", "finish": None, "done": False, "chunks": 0, "ttft": None}
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                res["done"] = True
                break
            ch = json.loads(line[6:])
            assert "error" not in ch, ch
            res["chunks"] += 1
            for c in ch["choices"]:
                if c["text"] and res["ttft"] is None:
                    res["ttft"] = time.perf_counter() - t0
                res["text"] += c["text"]
                res["finish"] = c["finish_reason"] or res["finish"]
            if leave and res["chunks"] >= 2:
                break  # leaving the block closes the connection mid-stream
    res["elapsed"] = time.perf_counter() - t0
    return res


async def _run_all(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=N_CLIENTS + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return await asyncio.wait_for(asyncio.gather(*(_client(http, i) for i in range(N_CLIENTS))), 240)


def test_64_streaming_clients_with_disconnects(server):
    srv, engine = server
    expected = []
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        for p in PROMPTS:
            r = http.post("/v1/completions", json={"model": "smol", "prompt": p, "temperature": 0,
                                                   "ignore_eos": True, "max_tokens": MAX_TOKENS})
            expected.append(r.json()["choices"][0]["text"])
    stats0 = engine.get_stats()

    t0 = time.perf_counter()
    results = asyncio.run(_run_all(srv.url))
    wall = time.perf_counter() - t0

    complete = [r for r in results if r["i"] not in DISCONNECT]
    for r in complete:
        assert r["done"] and r["finish"] == "length", r
        assert r["text"] == expected[r["i"] % len(PROMPTS)], r
    for r in results:
        if r["i"] in DISCONNECT:
            assert not r["done"] and r["finish"] is None  # really left mid-stream

    deadline = time.monotonic() + 20
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0
    check_invariants(engine.kv)
    st = engine.get_stats()
    generated = st.num_generated_tokens - stats0.num_generated_tokens
    assert generated >= len(complete) * MAX_TOKENS
    metrics = httpx.get(srv.url + "/metrics").text
    aborted = [ln for ln in metrics.splitlines()
               if ln.startswith("pagedkv_requests_finished_total") and 'finish_reason="abort"' in ln]
    assert float(aborted[0].split()[-1]) == len(DISCONNECT)
    ttfts = sorted(r["ttft"] for r in complete)
    print(f"\n[load] {N_CLIENTS} clients ({len(DISCONNECT)} disconnect) in {wall:.1f}s; "
          f"{generated} tokens generated ({generated / wall:.0f} tok/s); TTFT p50 {ttfts[len(ttfts) // 2]:.2f}s "
          f"p90 {ttfts[int(len(ttfts) * 0.9)]:.2f}s; peak running {st.peak_running}; "
          f"prefix hit rate {st.kv_prefix_hit_rate:.2f}; preemptions {st.num_preemptions}")


def test_nonstream_client_that_gives_up_is_aborted(server):
    srv, engine = server
    before = engine.get_stats().num_finished_requests
    body = {"model": "smol", "prompt": PROMPTS[0], "temperature": 0, "ignore_eos": True, "max_tokens": 200}
    with pytest.raises(httpx.ReadTimeout):  # the client closes the connection after 1.5 s
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    deadline = time.monotonic() + 20
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    st = engine.get_stats()
    assert st.num_finished_requests == before + 1
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0
    check_invariants(engine.kv)
    metrics = httpx.get(srv.url + "/metrics").text
    disc = [ln for ln in metrics.splitlines() if ln.startswith("pagedkv_client_disconnects_total")]
    assert float(disc[0].split()[-1]) == len(DISCONNECT) + 1
    aborted = [ln for ln in metrics.splitlines()
               if ln.startswith("pagedkv_requests_finished_total") and 'finish_reason="abort"' in ln]
    assert float(aborted[0].split()[-1]) == len(DISCONNECT) + 1  # aborted, not run to the end
