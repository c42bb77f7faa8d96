"""The one OpenAI-compatible ingress in front of the replicas: ``build_ingress(...)`` -> FastAPI.

Every replica runs today's server (:func:`pagedkv.serving.app.build_app`), so the endpoints,
streaming and errors are the same: the ingress routes ``POST /v1/completions`` and
``/v1/chat/completions`` with the :class:`pagedkv.serving.replicas.router.Router` and relays the bytes
(JSON or Server-Sent Events) unchanged; every other route (``/v1/models``, ``/tokenize``,
``/detokenize``, ``/version``, ``/openapi.json``) goes to any healthy replica. The ingress adds
``X-Pagedkv-Replica`` (the rank that answered) to each relayed response.

Faults: a replica that cannot be reached or drops the connection before the first byte of its
answer (a non-streamed request's whole answer) is taken out of routing and the request is
sent to another replica (nothing reached the client yet); a stream that already sent bytes
ends with an OpenAI error event (code ``replica_failed``), as a failed stream of one server
does. Any exception of the client stack counts as such a failure, not only
``httpx.TransportError``: a peer that resets a just-accepted connection can surface as a raw
``AttributeError`` from httpcore/anyio (the socket is gone before httpcore reads its extra
info), and a dying replica must never turn into a 500 of the ingress. The control's
``refresh`` puts a replica back when it answers again (Ray restarts it).

Own routes: ``GET /health`` (200 with at least one healthy replica, else 503; the replicas'
state in the body), ``GET /metrics`` (:mod:`pagedkv.serving.replicas.ingress_metrics`), ``GET /ui`` (every
replica's live block map, one frame each) and ``GET /replicas/{rank}/{path}`` (a replica's
own ``/ui``, ``/ui/state``, ``/v1/models``, ``/metrics``). With API keys, ``/metrics`` and
``/ui`` need a key unless ``open_routes`` names them (as for one server).
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional, Protocol, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from pagedkv.model.tokenizer import apply_chat, encode_prompt
from pagedkv.serving.api_keys import ApiKeys
from pagedkv.serving.protocol import chat_messages
from pagedkv.serving.replicas.index import prompt_hashes
from pagedkv.serving.replicas.ingress_metrics import merge_metrics, router_metrics
from pagedkv.serving.replicas.router import NoReplicaError, ReplicaView, Router
from pagedkv.serving.schemas import ChatCompletionRequest

logger = logging.getLogger("pagedkv.serving.replicas")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
_PASS_HEADERS = ("authorization", "x-api-key", "content-type", "accept", "x-request-id")
_KEEP_HEADERS = ("content-type", "x-request-id", "www-authenticate", "cache-control")
# failures a replica causes as such; any other exception is logged with its traceback too
_EXPECTED = (httpx.HTTPError, OSError, StopAsyncIteration)


async def _close(resp: httpx.Response) -> None:
    """Close a replica's response; a connection that is already broken may fail to close."""
    try:
        await resp.aclose()
    except Exception as e:
        logger.debug("closing a replica's response failed (%s: %s)", type(e).__name__, e)


class ReplicaControl(Protocol):
    """What the ingress needs from the layer that runs the replicas (Ray:
    :class:`pagedkv.serving.replicas.launch.RayReplicas`)."""

    async def refresh(self, router: Router) -> None:
        """Mark replicas up (with their URL) or down; update their KV usage."""

    async def metrics_text(self, replica: ReplicaView) -> Optional[str]:
        """The replica's Prometheus text, or None if it does not answer."""


def _error(status: int, message: str, code: str, type_: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}},
                        status_code=status)


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Ingress:
    """The state behind the ingress app. ``model``: ``{"model_id", "revision", "kv_format",
    "block_size"}`` of the replicas' engine (the prefix hashes must match theirs). ``tokenizer``: the
    replicas' HF tokenizer (prompt text and chat template -> token ids). ``poll_s``: seconds
    between two ``control.refresh`` calls. ``transport``: the HTTP client's transport to the
    replicas (None: httpx's default; tests pass a mock)."""

    def __init__(self, router: Router, control: ReplicaControl, tokenizer: Any, model: dict[str, Any], *,
                 api_keys: Optional[dict[str, str]] = None, max_body_bytes: int = 1 << 20,
                 open_routes: Sequence[str] = (), poll_s: float = 0.5,
                 transport: Optional[httpx.AsyncBaseTransport] = None) -> None:
        self.router = router
        self.control = control
        self.tokenizer = tokenizer
        self.model = model
        self.keys = ApiKeys(api_keys) if api_keys is not None else None
        self.max_body_bytes = max_body_bytes
        self.open_routes = frozenset(open_routes)
        self.poll_s = poll_s
        self.retries = 0
        self.refresh_paused = False
        self.refresh_idle = False
        self.transport = transport
        self.client: Optional[httpx.AsyncClient] = None

    # ---- requests ------------------------------------------------------------------------
    def tenant(self, request: Request) -> Optional[str]:
        """The caller's tenant (None without keys or for a bad key: the replica answers 401)."""
        if self.keys is None:
            return None
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        return self.keys.tenant(key) if key else None

    def key_ok(self, request: Request) -> bool:
        if self.keys is None or request.url.path in self.open_routes:
            return True
        key = request.query_params.get("key")
        return (key is not None and self.keys.tenant(key) is not None) or self.tenant(request) is not None

    def prompt_ids(self, path: str, body: Any) -> list[int]:
        """Token ids of the (first) prompt of a generation call; [] when they cannot be known
        (the replica then answers the request's error)."""
        if path == "/v1/chat/completions":  # the replica's own mapping: roles, content parts
            req = ChatCompletionRequest.model_validate(body)  # its template flags, as the replica uses them
            return apply_chat(self.tokenizer, chat_messages(req), req.add_generation_prompt,
                              continue_final_message=req.continue_final_message)
        p = body["prompt"]
        if isinstance(p, list) and p and not isinstance(p[0], int):
            p = p[0]
        if isinstance(p, str):
            return encode_prompt(self.tokenizer, p)
        return [int(t) for t in p]

    def hashes(self, path: str, raw: bytes, tenant: Optional[str]) -> list[bytes]:
        if self.router.policy != "prefix-aware":
            return []
        try:
            body = json.loads(raw)
            salt = body.get("cache_salt")
            ids = self.prompt_ids(path, body)
            return prompt_hashes(ids, self.model["block_size"], model_id=self.model["model_id"],
                                 revision=self.model["revision"], tenant=tenant,
                                 cache_salt=salt if isinstance(salt, str) else None,
                                 kv_format=self.model.get("kv_format"))
        except Exception:  # malformed: no prefix to route by; the replica answers the 4xx
            return []

    async def read_body(self, request: Request) -> Optional[bytes]:
        """The body, or None past ``max_body_bytes``."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def forward(self, request: Request, path: str, raw: bytes, hashes: Sequence[bytes],
                      pinned: Optional[ReplicaView] = None) -> Response:
        """Send the call to the router's choice (or ``pinned``), retrying on another replica
        while nothing has reached the client; relay the answer."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASS_HEADERS}
        url_tail = path + (f"?{request.url.query}" if request.url.query else "")
        tried: list[int] = []
        while True:
            if pinned is not None:
                if not pinned.healthy or pinned.url is None or tried:
                    return _error(503, f"replica {pinned.rank} is not available", "replica_unavailable")
                replica = pinned  # a replica's own page: not a routed request
            else:
                try:
                    replica = self.router.choose(hashes, exclude=tried).replica
                    self.retries += bool(tried)
                except NoReplicaError:
                    return _error(503, "no replica is available" + (" (the replicas tried failed)" if tried else ""),
                                  "replica_unavailable")
            tried.append(replica.rank)
            assert self.client is not None
            req = self.client.build_request(request.method, replica.url + url_tail, content=raw, headers=headers)
            resp: Optional[httpx.Response] = None
            try:
                resp = await self.client.send(req, stream=True)
                out_headers = {k: v for k, v in resp.headers.items() if k.lower() in _KEEP_HEADERS}
                out_headers["X-Pagedkv-Replica"] = str(replica.rank)
                if resp.headers.get("content-type", "").startswith("text/event-stream"):
                    chunks = resp.aiter_raw()
                    first = await chunks.__anext__()
                    return StreamingResponse(self.relay(replica, resp, chunks, first, pinned is None),
                                             status_code=resp.status_code, headers=out_headers)
                body = await resp.aread()
            except Exception as e:  # nothing reached the client: any failure of the replica or the
                if resp is not None:  # client stack (module docstring) sends the request elsewhere
                    await _close(resp)
                logger.warning("replica %d failed a request before answering (%s: %s); retrying elsewhere",
                               replica.rank, type(e).__name__, e, exc_info=not isinstance(e, _EXPECTED))
                if pinned is None:
                    self.router.release(replica, failed=True)
                    self.router.mark_down(replica)
                continue
            except BaseException:
                if pinned is None:
                    self.router.release(replica)
                raise
            if pinned is None:
                self.router.release(replica)
            return Response(body, status_code=resp.status_code, headers=out_headers)

    async def relay(self, replica: ReplicaView, resp: httpx.Response, chunks: AsyncIterator[bytes],
                    first: bytes, routed: bool) -> AsyncIterator[bytes]:
        """A stream's bytes; a replica lost mid-stream ends it with an error event."""
        failed = False
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except Exception as e:  # as in forward: any failure of the replica or the client stack
            failed = True
            logger.warning("replica %d failed mid-stream (%s: %s)", replica.rank, type(e).__name__, e,
                           exc_info=not isinstance(e, _EXPECTED))
            if routed:
                self.router.mark_down(replica)
            yield _sse_error(f"replica {replica.rank} failed while streaming this response "
                             f"({type(e).__name__}); the response is incomplete")
        finally:  # also on a client disconnect: closing the upstream aborts the request there
            await _close(resp)
            if routed:
                self.router.release(replica, failed=failed)

    # ---- background ----------------------------------------------------------------------
    async def poll(self) -> None:
        """Refresh the replicas every ``poll_s`` seconds; while ``refresh_paused`` is set (tests:
        a replica's death found by a request, not by a poll) it skips, and sets
        ``refresh_idle`` once no refresh is under way."""
        while True:
            if self.refresh_paused:
                self.refresh_idle = True
                await asyncio.sleep(0.05)
                continue
            self.refresh_idle = False
            try:
                await self.control.refresh(self.router)
            except Exception:
                logger.exception("replica refresh failed")
            await asyncio.sleep(self.poll_s)


_UI = """<!doctype html><html><head><meta charset="utf-8"><title>pagedkv replicas</title>
<style>body{font-family:sans-serif;margin:8px}iframe{width:100%;height:640px;border:1px solid #ccc}</style>
</head><body><h2>pagedkv: one KV block map per replica</h2><div id="r"></div><script>
const q = new URLSearchParams(location.search).get("key");
fetch("health").then(r => r.json()).then(h => { for (const r of h.replicas) {
  const d = document.createElement("div");
  d.innerHTML = "<h3>replica " + r.rank + (r.healthy ? "" : " (down)") + "</h3>";
  const f = document.createElement("iframe");
  f.src = "replicas/" + r.rank + "/ui" + (q ? "?key=" + encodeURIComponent(q) : "");
  d.appendChild(f); document.getElementById("r").appendChild(d); } });
</script></body></html>"""


def build_ingress(ing: Ingress) -> FastAPI:
    """The FastAPI app of an :class:`Ingress` (routes: the module docstring). Its lifespan
    opens the HTTP client to the replicas and runs the refresh loop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ing.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), transport=ing.transport,
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        await ing.control.refresh(ing.router)
        task = asyncio.ensure_future(ing.poll())
        try:
            yield
        finally:
            task.cancel()
            await ing.client.aclose()

    app = FastAPI(title="pagedkv ingress", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ingress = ing
    unauthorized = lambda: _error(401, "missing or invalid API key", "invalid_api_key", "authentication_error")  # noqa: E731

    @app.get("/health")
    async def health() -> Response:
        reps = [{"rank": r.rank, "healthy": r.healthy, "url": r.url, "in_flight": r.in_flight,
                 "routed": r.routed, "restarts": r.restarts} for r in ing.router.replicas]
        ok = any(r["healthy"] for r in reps)
        return JSONResponse({"status": "ok" if ok else "no replica", "policy": ing.router.policy,
                             "replicas": reps}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not ing.key_ok(request):
            return unauthorized()
        reps = ing.router.replicas
        texts = await asyncio.gather(*(ing.control.metrics_text(r) for r in reps))
        body = merge_metrics({r.rank: t for r, t in zip(reps, texts) if t is not None})
        body += router_metrics(reps, ing.router.policy, ing.retries)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/ui")
    async def ui(request: Request) -> Response:
        if not ing.key_ok(request):
            return unauthorized()
        return HTMLResponse(_UI, headers={"Cache-Control": "no-store"})

    @app.get("/replicas/{rank}/{path:path}")
    async def one_replica(rank: int, path: str, request: Request) -> Response:
        reps = [r for r in ing.router.replicas if r.rank == rank]
        if not reps or path not in ("ui", "ui/state", "v1/models", "metrics"):
            return _error(404, f"no route /replicas/{rank}/{path}", "not_found", "not_found_error")
        return await ing.forward(request, "/" + path, b"", (), pinned=reps[0])

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    async def relay(path: str, request: Request) -> Response:
        path = "/" + path
        raw = await ing.read_body(request)
        if raw is None:
            return _error(413, f"request body exceeds the limit of {ing.max_body_bytes} bytes",
                          "request_too_large", "invalid_request_error")
        if request.method == "POST" and path in GENERATE_PATHS:
            hashes = await asyncio.to_thread(ing.hashes, path, raw, ing.tenant(request))
            return await ing.forward(request, path, raw, hashes)
        healthy = ing.router.healthy()  # models, tokenizer, version: any replica answers the same
        if not healthy:
            return _error(503, "no replica is available", "replica_unavailable")
        return await ing.forward(request, path, raw, (), pinned=min(healthy, key=ReplicaView.load))

    return app
