"""The ingress's fault handling without Ray: replicas behind an httpx mock transport that fails
the way a killed replica's connection does. CI once saw the raw ``AttributeError`` httpcore/anyio
raise when a peer resets a just-accepted connection (the socket is gone before httpcore reads its
extra info); the ingress answered 500 instead of retrying. Any exception of the client stack
before an answer must send the request to another replica; after the first streamed byte it
must end the stream with an error event."""

from __future__ import annotations

import json
from typing import AsyncIterator, Optional

import httpx
from starlette.testclient import TestClient

from pagedkv.serving.replicas.ingress import Ingress, build_ingress
from pagedkv.serving.replicas.router import ReplicaView, Router

RESET = AttributeError("'NoneType' object has no attribute 'getpeername'")  # what CI saw, raw


class _Control:
    async def refresh(self, router: Router) -> None:
        pass

    async def metrics_text(self, replica: ReplicaView) -> Optional[str]:
        return None


class _Broken(httpx.AsyncByteStream):
    """A body that yields ``chunks`` and then fails with ``exc``."""

    def __init__(self, chunks: list[bytes], exc: BaseException) -> None:
        self.chunks, self.exc = chunks, exc

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c
        raise self.exc


def _ingress(handler) -> tuple[Ingress, TestClient]:
    views = [ReplicaView(rank=i, url=f"http://r{i}", healthy=True, pid=100 + i) for i in range(2)]
    ing = Ingress(Router(views, policy="round-robin"), _Control(), None,
                  {"model_id": "m", "revision": "r", "kv_format": "float32", "block_size": 4},
                  poll_s=3600, transport=httpx.MockTransport(handler))
    return ing, TestClient(build_ingress(ing))


def _ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"object": "text_completion", "host": request.url.host})


BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}


def test_a_raw_exception_before_the_answer_retries_on_the_other_replica():
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        if request.url.host == "r0":
            raise RESET
        return _ok(request)

    ing, client = _ingress(handler)
    with client:
        r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    assert (r.json()["host"], r.headers["x-pagedkv-replica"]) == ("r1", "1")
    assert calls == ["r0", "r1"]
    r0, r1 = ing.router.replicas
    assert (r0.healthy, r0.failures, r0.in_flight, r0.routed) == (False, 1, 0, 1)
    assert (r1.healthy, r1.failures, r1.in_flight, r1.routed) == (True, 0, 0, 1)
    assert ing.retries == 1


def test_a_body_that_breaks_before_reaching_the_client_is_retried():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "r0":
            return httpx.Response(200, headers={"content-type": "application/json"},
                                  stream=_Broken([b'{"obj'], ConnectionResetError(104, "reset by peer")))
        return _ok(request)

    ing, client = _ingress(handler)
    with client:
        r = client.post("/v1/completions", json=BODY)
    assert (r.status_code, r.json()["host"]) == (200, "r1")
    assert [(v.healthy, v.failures, v.in_flight) for v in ing.router.replicas] == [(False, 1, 0), (True, 0, 0)]


def test_every_replica_failing_is_a_503_not_a_500():
    def handler(request: httpx.Request) -> httpx.Response:
        raise RESET if request.url.host == "r0" else OSError(107, "Transport endpoint is not connected")

    ing, client = _ingress(handler)
    with client:
        r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 503
    err = r.json()["error"]
    assert (err["code"], err["message"]) == ("replica_unavailable", "no replica is available (the replicas tried failed)")
    assert [(v.healthy, v.failures, v.in_flight) for v in ing.router.replicas] == [(False, 1, 0), (False, 1, 0)]
    assert ing.retries == 1


def test_a_stream_that_breaks_after_its_first_bytes_ends_with_an_error_event():
    first = b'data: {"object": "text_completion", "choices": [{"text": "a"}]}\n\n'

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Broken([first], RESET))

    ing, client = _ingress(handler)
    with client:
        r = client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == "0"
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == first and len(events) == 2
    err = json.loads(events[1][len(b"data: "):])["error"]
    assert err["code"] == "replica_failed" and "replica 0" in err["message"] and "AttributeError" in err["message"]
    assert [(v.healthy, v.failures, v.in_flight) for v in ing.router.replicas] == [(False, 1, 0), (True, 0, 0)]
    assert ing.retries == 0
