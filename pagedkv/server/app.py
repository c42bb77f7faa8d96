"""The OpenAI-compatible HTTP server: ``build_app(engine, ...)`` returns a FastAPI app.

Endpoints
    GET  /v1/models               the served model
    POST /v1/completions          text completion (``stream``, ``n``, ``logprobs``, ...)
    POST /v1/chat/completions     chat completion over the model's chat template
    GET  /health                  200 while the engine loop runs, else 503
    GET  /metrics                 Prometheus exposition (see ``pagedkv.server.metrics``)
    GET  /ui                      live page of the KV cache (+ the seed §03 calculator)
    GET  /ui/state                JSON snapshot the page polls (blocks, tables, stats; with
                                  tenants, other tenants' requests are shown as "other")

One :class:`pagedkv.server.engine_loop.EngineLoop` runs the engine for every request.
Streaming responses are Server-Sent Events (``data: {json}`` ... ``data: [DONE]``); a
client that disconnects has its requests aborted (blocks are freed at the next step fence).

Errors are OpenAI error objects ``{"error": {"message", "type", "param", "code"}}``:
400 malformed JSON or a request the model cannot serve (prompt too long, ``max_tokens``
beyond the context, ``n`` above the server limit), 401 missing or unknown API key (when
keys are configured), 404 unknown model, 413 body over ``max_body_bytes``, 422 a field of
the wrong type or out of range, 503 while shutting down. A rejected request never reaches
the engine, or is aborted before it runs, so no block leaks.

Tenants: with ``api_keys`` (key -> tenant) every ``/v1`` call needs
``Authorization: Bearer <key>``; the tenant is a typed key of the prefix-cache identity so
two tenants never share a cached block (a request's ``cache_salt`` adds to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pagedkv.engine.request import RequestOutput, SamplingParams
from pagedkv.errors import InvalidRequestError
from pagedkv.server.engine_loop import EngineLoop, EngineStepError, EngineStoppedError, PromptSpec
from pagedkv.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.server.schemas import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("pagedkv.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
DEFAULT_MAX_N = 16
MAX_SEQS_PER_CALL = 64  # sequences (prompts x n) one /v1/completions call may start


# ---- errors -------------------------------------------------------------------------
class APIError(Exception):
    """An error returned to the client as an OpenAI error object with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[Union[str, int]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _validation_error(exc: ValidationError) -> APIError:
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(p) for p in first.get("loc", ()))
    msg = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errs[:5]
    )
    return APIError(422, msg or "invalid request", param=loc or None, code="invalid_value")


# ---- tenants ------------------------------------------------------------------------
def load_api_keys(path: str) -> dict[str, str]:
    """Read an API-key file: a JSON object ``{"key": "tenant", ...}``, or text lines
    ``KEY TENANT`` (``#`` comments and blank lines ignored). Raises ``ValueError`` on a
    malformed file, an empty key, or a tenant name with a NUL character."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    keys: dict[str, str] = {}
    stripped = text.strip()
    if stripped.startswith("{"):
        data = json.loads(stripped)
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"{path}: expected a JSON object of key -> tenant strings")
        keys = dict(data)
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected 'KEY TENANT'")
            keys[parts[0]] = parts[1]
    for k, t in keys.items():
        if not k or not t or "\x00" in t:
            raise ValueError(f"{path}: empty key/tenant or NUL in tenant {t!r}")
    return keys



def _key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


# ---- the app ------------------------------------------------------------------------
class _State:
    def __init__(self, engine: Any, loop: EngineLoop, metrics: ServerMetrics, model_names: list[str],
                 api_keys: Optional[dict[str, str]], max_body_bytes: int, max_n: int,
                 shutdown_timeout_s: float) -> None:
        self.engine = engine
        self.loop = loop
        self.metrics = metrics
        self.model_names = model_names
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.max_n = max_n
        self.shutdown_timeout_s = shutdown_timeout_s
        self.created = int(time.time())


def build_app(
    engine: Any,
    *,
    served_model_name: Optional[Union[str, list[str]]] = None,
    api_keys: Optional[dict[str, str]] = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_n: int = DEFAULT_MAX_N,
    shutdown_timeout_s: float = 10.0,
) -> FastAPI:
    """The server app over an ``LLMEngine``. ``served_model_name``: the name(s) clients
    pass as ``model`` (default: the engine's ``model_id``; the first is reported).
    ``api_keys``: key -> tenant (``None``: no auth, no tenants). ``max_body_bytes``: request
    body limit (bytes). ``max_n``: largest ``n`` (capped by the engine's own limit).
    ``shutdown_timeout_s``: how long shutdown lets in-flight requests finish (seconds).
    The engine loop starts with the app (lifespan) and is reachable as
    ``app.state.pagedkv.loop``."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if not names:
        names = [engine.model_id]
    metrics = ServerMetrics(engine, names[0])
    loop = EngineLoop(engine, on_output=metrics.observe_output)
    max_n = min(max_n, getattr(getattr(engine, "config", None), "max_n", max_n))
    # keys are kept as digests, so a lookup does not compare secrets byte by byte
    digests = {_key_digest(k): t for k, t in api_keys.items()} if api_keys is not None else None
    st = _State(engine, loop, metrics, names, digests, max_body_bytes, max_n, shutdown_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            res = await asyncio.to_thread(loop.shutdown, st.shutdown_timeout_s)
            logger.info("engine loop stopped: %s", res)

    app = FastAPI(title="pagedkv", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pagedkv = st

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.http_errors.labels(names[0], str(exc.status)).inc()
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        metrics.http_errors.labels(names[0], "500").inc()
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(404, f"no route {request.url.path}", "not_found_error"))

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(405, f"method {request.method} not allowed on {request.url.path}"))

    # ---- helpers ----------------------------------------------------------------------
    def authenticate(request: Request) -> Optional[str]:
        """The caller's tenant (None without api keys). Raises 401."""
        if st.api_keys is None:
            return None
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not key:
            key = request.headers.get("x-api-key", "")
        if not key:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")
        tenant = st.api_keys.get(_key_digest(key))
        if tenant is None:
            raise APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")
        return tenant

    async def read_json(request: Request, model: type) -> Any:
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > st.max_body_bytes:
            raise APIError(413, f"request body is {cl} bytes; the limit is {st.max_body_bytes}",
                           "invalid_request_error", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > st.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {st.max_body_bytes} bytes",
                               "invalid_request_error", code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the JSON body must be an object", code="invalid_json")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None

    def check_model(name: str) -> str:
        if name not in st.model_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {st.model_names[0]!r}",
                           "not_found_error", param="model", code="model_not_found")
        return st.model_names[0]

    def check_common(body: Any) -> None:
        if body.n > st.max_n:
            raise APIError(400, f"n must be <= {st.max_n}, got {body.n}", param="n", code="invalid_value")
        if not loop.accepting:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")

    def check_lengths(prompt_len: int, max_tokens: Optional[int], prompt_param: str) -> int:
        """Raise 400 if the prompt or prompt + max_tokens exceed the context; return the
        effective max_tokens (None = the rest of the context)."""
        ctx = engine.max_model_len
        if prompt_len >= ctx:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {ctx} tokens "
                           "(prompt plus at least one output token)", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is None:
            return ctx - prompt_len
        if prompt_len + max_tokens > ctx:
            raise APIError(400, f"this model's context is {ctx} tokens; you asked for {prompt_len + max_tokens} "
                           f"({prompt_len} in the prompt, {max_tokens} max_tokens)", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def sampling(body: Any, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=-1 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else float(body.min_p),
            repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
            presence_penalty=float(body.presence_penalty or 0.0),
            frequency_penalty=float(body.frequency_penalty or 0.0),
            seed=body.seed, max_tokens=max_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
        )

    async def submit(ids: list[str], specs: list[PromptSpec], stream: bool, tenant: Optional[str]):
        try:
            return await loop.submit(ids, specs, stream=stream, tenant=tenant)
        except InvalidRequestError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        except EngineStoppedError as e:
            raise APIError(503, str(e), "server_error", code="shutting_down") from None

    # ---- endpoints --------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if loop.running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "stopped"}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": st.created, "owned_by": "pagedkv",
                "root": engine.model_id, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        authenticate(request)
        return JSONResponse({"object": "list", "data": [model_card(st.model_names[0])]})

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> Response:
        authenticate(request)
        check_model(name)
        return JSONResponse(model_card(st.model_names[0]))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = authenticate(request)
        body: CompletionRequest = await read_json(request, CompletionRequest)
        model = check_model(body.model)
        check_common(body)
        prompts = body.prompts()
        if len(prompts) * body.n > MAX_SEQS_PER_CALL:
            raise APIError(400, f"prompts x n must be <= {MAX_SEQS_PER_CALL}, got {len(prompts) * body.n}",
                           param="n", code="invalid_value")
        token_lists: list[list[int]] = []
        for p in prompts:
            ids = await asyncio.to_thread(engine.tokenize, p) if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "prompt is empty after tokenisation", param="prompt", code="invalid_value")
            vocab = engine.model_config.vocab_size
            if not all(0 <= t < vocab for t in ids):  # before echo decodes them
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt",
                               code="invalid_value")
            token_lists.append(ids)
        specs = []
        salt = body.cache_salt
        for ids in token_lists:
            mt = check_lengths(len(ids), body.max_tokens, "prompt")
            specs.append(PromptSpec(ids, sampling(body, mt, body.logprobs), salt))
        rid = f"cmpl-{uuid.uuid4().hex}"
        eids = [f"{rid}-{i}" for i in range(len(specs))]
        echo = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts] if body.echo else None
        sub = await submit(eids, specs, body.stream, tenant)
        ctx = _Ctx(rid, model, int(time.time()), "completion", token_lists, body, echo=echo)
        if body.stream:
            return _SSEResponse(_stream(ctx, sub, metrics, engine.tokenizer))
        return await _finish_nonstream(ctx, sub, request, metrics, engine.tokenizer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant = authenticate(request)
        body: ChatCompletionRequest = await read_json(request, ChatCompletionRequest)
        model = check_model(body.model)
        check_common(body)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in body.messages]
        try:
            ids = await asyncio.to_thread(engine.apply_chat_template, messages)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        except Exception as e:  # a template that rejects this conversation (roles, order)
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages",
                           code="invalid_value") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        mt = check_lengths(len(ids), max_tokens, "messages")
        lp = (body.top_logprobs or 0) if body.logprobs else None
        spec = PromptSpec(ids, sampling(body, mt, lp), body.cache_salt)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sub = await submit([f"{rid}-0"], [spec], body.stream, tenant)
        ctx = _Ctx(rid, model, int(time.time()), "chat", [ids], body)
        if body.stream:
            return _SSEResponse(_stream(ctx, sub, metrics, engine.tokenizer))
        return await _finish_nonstream(ctx, sub, request, metrics, engine.tokenizer)

    # ---- the KV page ------------------------------------------------------------------
    @app.get("/ui")
    async def ui_page() -> Response:
        html = resources.files("pagedkv.server").joinpath("static/ui.html").read_text(encoding="utf-8")
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @app.get("/ui/state")
    async def ui_state(request: Request) -> Response:
        tenant = authenticate(request)
        from pagedkv.server.kvview import kv_view

        # with tenants, a caller sees its own requests; others' blocks show as "other"
        view = await asyncio.to_thread(kv_view, engine, loop, tenant if st.api_keys is not None else None)
        return JSONResponse(view, headers={"Cache-Control": "no-store"})

    return app


# ---- response building ----------------------------------------------------------------
class _Ctx:
    """What one HTTP call needs to turn engine outputs into OpenAI responses."""

    def __init__(self, rid: str, model: str, created: int, kind: str, prompts: list[list[int]],
                 body: Any, echo: Optional[list[str]] = None) -> None:
        self.rid = rid
        self.model = model
        self.created = created
        self.kind = kind  # "completion" | "chat"
        self.prompts = prompts
        self.body = body
        self.n = body.n
        self.echo = echo
        stops = body.stop or []
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def choice_index(self, prompt_idx: int, sample_idx: int) -> int:
        return prompt_idx * self.n + sample_idx

    def want_logprobs(self) -> bool:
        if self.kind == "chat":
            return bool(self.body.logprobs)
        return self.body.logprobs is not None

    def top_k(self) -> int:
        return (self.body.top_logprobs or 0) if self.kind == "chat" else (self.body.logprobs or 0)

    def usage(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in finals.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _tok_str(tokenizer: Any, tid: int) -> str:
    return tokenizer.decode([tid])


def _logprobs(ctx: _Ctx, tokenizer: Any, token_ids: list[int], lps: Optional[list[dict[int, float]]],
              text_offset0: int = 0) -> Optional[dict[str, Any]]:
    """OpenAI logprobs for ``token_ids`` (engine dicts: sampled token first, then the top-k)."""
    if not ctx.want_logprobs() or lps is None:
        return None
    k = ctx.top_k()
    rows = []
    for tid, d in zip(token_ids, lps):
        lp = d.get(tid, float("-inf"))
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []
        rows.append((tid, lp, top))
    if ctx.kind == "chat":
        content = []
        for tid, lp, top in rows:
            s = _tok_str(tokenizer, tid)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": (ts := _tok_str(tokenizer, t)), "logprob": v,
                                              "bytes": list(ts.encode("utf-8"))} for t, v in top]})
        return {"content": content}
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset0
    for tid, lp, top in rows:
        s = _tok_str(tokenizer, tid)
        tokens.append(s)
        token_lps.append(lp)
        tops.append({_tok_str(tokenizer, t): v for t, v in top})
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _response_choice(ctx: _Ctx, tokenizer: Any, prompt_idx: int, c: Any) -> dict[str, Any]:
    idx = ctx.choice_index(prompt_idx, c.index)
    text = c.text
    if ctx.kind == "chat":
        return {"index": idx, "message": {"role": "assistant", "content": text},
                "logprobs": _logprobs(ctx, tokenizer, c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason}
    prefix = ctx.echo[prompt_idx] if ctx.echo else ""
    return {"index": idx, "text": prefix + text,
            "logprobs": _logprobs(ctx, tokenizer, c.token_ids, c.logprobs, len(prefix)),
            "finish_reason": c.finish_reason}


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _finish_nonstream(ctx: _Ctx, sub: Any, request: Request, metrics: ServerMetrics,
                            tokenizer: Any) -> Response:
    finals: dict[int, RequestOutput] = {}

    async def consume() -> None:
        async for i, out in sub.outputs():
            if out.finished:
                finals[i] = out

    task = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not gone.done():
            gone.cancel()
    if task not in done:  # the client went away: abort (Submission.close runs on cancel)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        sub.close()
        metrics.disconnects.labels(ctx.model).inc()
        return Response(status_code=499)
    try:
        task.result()
    except EngineStepError as e:
        raise APIError(500, str(e), "server_error", code="engine_error") from None
    except EngineStoppedError as e:
        raise APIError(503, str(e), "server_error", code="shutting_down") from None
    if any(c.finish_reason == "abort" for o in finals.values() for c in o.outputs):
        raise APIError(503, "the request was aborted (server shutting down)", "server_error", code="aborted")
    choices = [_response_choice(ctx, tokenizer, i, c) for i in sorted(finals) for c in finals[i].outputs]
    choices.sort(key=lambda ch: ch["index"])
    return JSONResponse({
        "id": ctx.rid, "object": "chat.completion" if ctx.kind == "chat" else "text_completion",
        "created": ctx.created, "model": ctx.model, "choices": choices, "usage": ctx.usage(finals),
    })


class _ChoiceState:
    __slots__ = ("sent_chars", "sent_tokens", "done", "started")

    def __init__(self) -> None:
        self.sent_chars = 0
        self.sent_tokens = 0
        self.done = False
        self.started = False


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _stream(ctx: _Ctx, sub: Any, metrics: ServerMetrics, tokenizer: Any) -> AsyncIterator[bytes]:
    """SSE chunks for one call. Text is sent as it is generated, except a tail that could
    still turn out to be (the start of) a stop string, or an incomplete UTF-8 character."""
    obj = "chat.completion.chunk" if ctx.kind == "chat" else "text_completion"
    states: dict[int, _ChoiceState] = {}
    finals: dict[int, RequestOutput] = {}
    completed = False  # ended normally or with an error event (not a disconnect)

    def chunk(choices: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None) -> bytes:
        d: dict[str, Any] = {"id": ctx.rid, "object": obj, "created": ctx.created, "model": ctx.model,
                             "choices": choices}
        if ctx.include_usage:
            d["usage"] = usage
        return _sse(d)

    try:
        if ctx.kind == "chat":  # the role comes first, as OpenAI does
            yield chunk([{"index": ctx.choice_index(p, s), "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}
                         for p in range(len(ctx.prompts)) for s in range(ctx.n)])
        elif ctx.echo:
            yield chunk([{"index": ctx.choice_index(p, s), "text": ctx.echo[p], "logprobs": None,
                          "finish_reason": None}
                         for p in range(len(ctx.prompts)) for s in range(ctx.n)])
        async for pidx, out in sub.outputs():
            if out.finished:
                finals[pidx] = out
            choices = []
            for c in out.outputs:
                idx = ctx.choice_index(pidx, c.index)
                stt = states.setdefault(idx, _ChoiceState())
                if stt.done:
                    continue
                if c.finish_reason == "abort":
                    completed = True
                    yield _sse({"error": {"message": "the request was aborted (server shutting down)",
                                          "type": "server_error", "param": None, "code": "aborted"}})
                    return
                text = c.text
                finished = c.finish_reason is not None
                if finished:
                    safe = len(text)
                else:
                    safe = len(text) - ctx.holdback
                    stripped = text.rstrip("\ufffd")
                    safe = min(safe, len(stripped))
                safe = max(safe, stt.sent_chars)
                delta = text[stt.sent_chars:safe]
                new_tokens = c.token_ids[stt.sent_tokens:]
                new_lps = c.logprobs[stt.sent_tokens:] if c.logprobs is not None else None
                if not delta and not finished and not (new_tokens and ctx.want_logprobs()):
                    continue
                lp = _logprobs(ctx, tokenizer, new_tokens, new_lps, stt.sent_chars) if new_tokens else None
                stt.sent_chars = safe
                stt.sent_tokens = len(c.token_ids)
                stt.done = finished
                if ctx.kind == "chat":
                    choices.append({"index": idx, "delta": {"content": delta} if delta or not finished else {},
                                    "logprobs": lp, "finish_reason": c.finish_reason})
                else:
                    choices.append({"index": idx, "text": delta, "logprobs": lp,
                                    "finish_reason": c.finish_reason})
            if choices:
                yield chunk(choices)
        if ctx.include_usage:
            d = {"id": ctx.rid, "object": obj, "created": ctx.created, "model": ctx.model,
                 "choices": [], "usage": ctx.usage(finals)}
            yield _sse(d)
        yield b"data: [DONE]\n\n"
        completed = True
    except EngineStepError as e:
        completed = True
        yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": "engine_error"}})
    except EngineStoppedError as e:
        completed = True
        yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": "shutting_down"}})
    finally:
        if not completed and len(finals) < len(ctx.prompts):
            metrics.disconnects.labels(ctx.model).inc()
        sub.close()


class _SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its generator (so the engine
    requests are aborted) however the response ends: finished, client gone, or error."""

    def __init__(self, gen: AsyncIterator[bytes]) -> None:
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self._gen.aclose()  # type: ignore[attr-defined]
