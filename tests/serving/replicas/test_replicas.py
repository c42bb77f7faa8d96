"""Two tiny replicas on one local Ray (module-scoped: Ray starts once): prefix-aware routing
asserted by the replicas' own prefix-hit counters; the same endpoints, streams and errors
through the ingress; each replica's block map on /ui; a replica whose process is killed loses
no request that had not started (retried on the other), a stream running on a killed replica
ends with an error event, Ray restarts it and it rejoins; everything stops at the end."""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from pagedkv.serving.threaded import ThreadedServer
from pagedkv.serving.replicas.launch import ReplicaService
from pagedkv.testing.tiny import tiny_random_model

pytestmark = pytest.mark.slow  # the replicas load the bundled model's tokenizer and config

BLOCK = 8
ENGINE = {"num_blocks": 320, "block_size": BLOCK, "max_model_len": 1024, "kv_events": "auto", "seed": 0}


@pytest.fixture(scope="module")
def service():
    svc = ReplicaService.start(2, None, ENGINE, {}, num_cpus=2, model_factory=tiny_random_model)
    app = svc.build_ingress("prefix-aware", poll_s=0.2)
    srv = ThreadedServer(app)
    yield svc, app.state.ingress, srv
    srv.stop()
    svc.stop()


def _complete(url: str, prompt: list[int], max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _hits(url: str) -> dict[str, float]:
    """Prompt tokens each replica served from its prefix cache (the ingress's merged /metrics)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^pagedkv_prefix_cache_hits_tokens_total\{[^}]*replica="(\w+)"\} (\S+)$', text, re.M)}


def test_prefix_aware_routing_follows_each_users_prefix(service):
    svc, ing, srv = service
    systems = {"a": list(range(1000, 1040)), "b": list(range(2000, 2040))}  # 40 tokens = 5 blocks each
    before = _hits(srv.url)
    served: dict[str, list[str]] = {"a": [], "b": []}
    for turn in range(4):
        for user, sys_ids in systems.items():
            r = _complete(srv.url, sys_ids + [3000 + 10 * turn + k for k in range(5)])
            assert r.status_code == 200, r.text
            served[user].append(r.headers["x-pagedkv-replica"])
    after = _hits(srv.url)
    # every turn of a user went where its first turn went
    assert all(len(set(v)) == 1 for v in served.values()), served
    # turns 2-4 each found the user's 40-token system prompt cached on that replica, and nothing else hit
    gained = {rank: after[rank] - before.get(rank, 0.0) for rank in ("0", "1")}
    expected = {"0": 0.0, "1": 0.0}
    for user in systems:
        expected[served[user][0]] += 3 * 40
    assert gained == expected
    assert after["all"] - before.get("all", 0.0) == 6 * 40
    health = httpx.get(srv.url + "/health").json()
    assert [r["healthy"] for r in health["replicas"]] == [True, True]


def test_same_endpoints_streams_and_errors_through_the_ingress(service):
    svc, ing, srv = service
    prompt = list(range(1000, 1040)) + [77, 78]
    whole = _complete(srv.url, prompt, max_tokens=6).json()["choices"][0]["text"]
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
        events = list(_stream_lines(resp))
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == whole
    bad = _complete(srv.url, prompt, max_tokens=0)  # the replica's own 4xx, relayed
    assert bad.status_code in (400, 422) and "error" in bad.json()
    assert httpx.post(srv.url + "/v1/completions", json={**body, "model": "nope"}).status_code == 404
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "tiny-random"
    page = httpx.get(srv.url + "/ui")
    assert page.status_code == 200 and "replicas/" in page.text
    state = httpx.get(srv.url + "/replicas/1/ui/state").json()
    assert state["num_blocks"] == ENGINE["num_blocks"] and len(state["blocks"]["ref_cnt"]) == ENGINE["num_blocks"]
    assert httpx.get(srv.url + "/replicas/7/ui").status_code == 404


GRID = """const g = document.getElementById('grid');
return g ? Array.from(g.children).filter(c => c.dataset.block !== undefined).map(c => c.className) : [];"""


def test_ui_shows_each_replicas_block_map(service, browser):
    svc, ing, srv = service
    browser.get(srv.url + "/ui")
    deadline = time.monotonic() + 30
    while len(frames := browser.find_elements("tag name", "iframe")) < 2:
        assert time.monotonic() < deadline, "no replica frames"
        time.sleep(0.05)
    assert [f.get_attribute("src").split("/", 3)[3] for f in frames] == ["replicas/0/ui", "replicas/1/ui"]
    shown = []
    for rank, frame in enumerate(frames):
        state = httpx.get(f"{srv.url}/replicas/{rank}/ui/state").json()  # idle: the map stays still
        browser.switch_to.frame(frame)
        while len(cells := browser.execute_script(GRID)) != ENGINE["num_blocks"]:
            assert time.monotonic() < deadline + 30, f"replica {rank}: no block map"
            time.sleep(0.05)
        shown.append(sum("cached" in c for c in cells))
        assert shown[-1] == sum(state["blocks"]["cached"])  # its own cached prefixes, not the other's
        browser.switch_to.default_content()
    assert sum(shown) > 0


def _stream_lines(resp: httpx.Response):
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


def _until(cond, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (v := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return v


def test_the_replicas_kv_events_feed_the_router_with_the_same_hashes(service):
    svc, ing, srv = service
    feeds, views = svc.control.feeds, ing.router.replicas
    assert set(feeds) == {0, 1}
    svc.reset_prefix_caches()  # AllBlocksCleared, published with a replica's next step
    seen = {r: f.batches for r, f in feeds.items()}
    prompt = list(range(900, 940))  # 5 full blocks; with 4 answer tokens no 6th fills
    mine = ing.hashes("/v1/completions", json.dumps({"prompt": prompt}).encode(), None)  # the router's
    resp = _complete(srv.url, prompt, max_tokens=4)
    rank = int(resp.headers["x-pagedkv-replica"])
    # the batch of that step clears the index (the router's own insert too), then BlockStored
    # adds the engine's hashes: the index holds the router's 5 keys again only if they are the same
    idx = views[rank].index
    _until(lambda: feeds[rank].batches > seen[rank] and len(idx) == 5 and idx.match(mine) == 5,
           "the engine's BlockStored hashes to equal the router's")


def _wait_rejoined(srv, rank: int, restarts: int) -> None:
    """Ray Serve replaces the replica; the ingress's poll puts it back (deadline: 120 s)."""
    deadline = time.monotonic() + 120
    while True:
        reps = httpx.get(srv.url + "/health").json()["replicas"]
        if reps[rank]["healthy"] and reps[rank]["restarts"] == restarts:
            return
        assert time.monotonic() < deadline, reps
        time.sleep(0.2)


def test_killed_replica_loses_no_unstarted_request(service):
    svc, ing, srv = service
    prompts = [list(range(500, 540)) + [600 + i] for i in range(6)]  # one shared 5-block prefix
    before = [_complete(srv.url, p) for p in prompts]
    expected = [r.json()["choices"][0]["text"] for r in before]
    holders = {r.headers["x-pagedkv-replica"] for r in before}
    assert len(holders) == 1  # the prefix keeps them on one replica
    victim = int(holders.pop())
    pids = svc.pids()
    ing.refresh_paused = True  # the death must be found by the requests below, not by a poll
    try:  # resumed also on a failure: a paused poll would fail the next test too
        deadline = time.monotonic() + 30
        while not ing.refresh_idle:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(pids[victim], 9)  # the replica's process ends; the router still routes to it
        with ThreadPoolExecutor(6) as pool:  # routed by prefix to the dead replica, then retried
            outs = list(pool.map(_complete, [srv.url] * 6, prompts))
        assert [o.status_code for o in outs] == [200] * 6, [o.text for o in outs]
        assert [o.json()["choices"][0]["text"] for o in outs] == expected
        assert {o.headers["x-pagedkv-replica"] for o in outs} == {str(1 - victim)}
        assert ing.retries >= 1 and ing.router.replicas[victim].failures >= 1
        assert not ing.router.replicas[victim].healthy
    finally:
        ing.refresh_paused = False
    _wait_rejoined(srv, victim, restarts=1)
    assert svc.pids()[1 - victim] == pids[1 - victim] and svc.pids()[victim] != pids[victim]


def test_stream_on_a_killed_replica_ends_with_an_error_event(service):
    svc, ing, srv = service
    pids = svc.pids()
    body = {"model": "tiny-random", "prompt": list(range(800, 830)), "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as resp:
        rank = int(resp.headers["x-pagedkv-replica"])
        restarts = ing.router.replicas[rank].restarts
        lines = _stream_lines(resp)
        assert json.loads(next(lines))["object"] == "text_completion"  # streaming
        os.kill(pids[rank], 9)
        rest = list(lines)
    assert rest and rest[-1] != "[DONE]"
    err = json.loads(rest[-1])["error"]
    assert (err["code"], err["type"]) == ("replica_failed", "server_error") and f"replica {rank}" in err["message"]
    _wait_rejoined(srv, rank, restarts=restarts + 1)
    r = _complete(srv.url, [42] * 20)
    assert r.status_code == 200


def test_everything_stops(service):
    svc, ing, srv = service
    pids = svc.pids()
    srv.stop()
    svc.stop()
    assert not ray.is_initialized()
    for pid in pids:  # the replica processes are gone
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
            assert time.monotonic() < deadline, f"replica process {pid} still runs"
            time.sleep(0.1)
