"""The endpoints (see :mod:`pagedkv.serving.app` for the list).

Each ``/v1`` handler receives its tenant and its parsed body from the dependencies
(:mod:`pagedkv.serving.dependencies`), checks what needs the model or the server (model
name 404, ``n`` 400, shutting down 503, prompt and context lengths 400), submits one
engine request per prompt to the engine loop and answers with one JSON object or a stream
(:mod:`pagedkv.serving.streaming`). A request rejected here never reaches the engine, or is
aborted before it runs, so no block leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from importlib import metadata, resources
from typing import Annotated, Any, Optional, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from pagedkv.engine.request import RequestOutput
from pagedkv.errors import InvalidRequestError
from pagedkv.serving.dependencies import KeyRequired, ServerState, State, Tenant, json_body
from pagedkv.serving.engine_loop import EngineStepError, EngineStoppedError, PromptSpec, Submission
from pagedkv.serving.errors import APIError, aborted_error, engine_error
from pagedkv.serving.kvview import kv_view
from pagedkv.serving.metrics import CONTENT_TYPE
from pagedkv.serving.openapi import request_body
from pagedkv.serving.protocol import (
    MAX_SEQS_PER_CALL,
    ResponseContext,
    chat_messages,
    check_lengths,
    completion_response,
    sampling_params,
    structured_spec,
)
from pagedkv.serving.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagedkv.serving.streaming import SSEResponse, stream_events
from pagedkv.serving.tools import ToolCalls

router = APIRouter()

CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]
TokenizeBody = Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))]
DetokenizeBody = Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))]


# ---- checks and delivery ------------------------------------------------------------
def _served_model(st: ServerState, name: str) -> str:
    """The reported model name. Raises 404 if ``name`` is not served."""
    if name not in st.model_names:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {st.model_names[0]!r}",
                       "not_found_error", param="model", code="model_not_found")
    return st.model_names[0]


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _admit(st: ServerState, body: Union[CompletionRequest, ChatCompletionRequest]) -> str:
    """Checks every generation call passes first: the model (404), ``n`` and ``best_of``
    (400), ``logit_bias`` token ids in the vocabulary (400) and that the server still
    accepts work (503). Returns the reported model name."""
    model = _served_model(st, body.model)
    if body.n > st.max_n:
        raise _bad(f"n must be <= {st.max_n}, got {body.n}", "n")
    if body.best_of is not None:
        if not body.n <= body.best_of <= st.max_n:
            raise _bad(f"best_of must be in [n, {st.max_n}] = [{body.n}, {st.max_n}], got {body.best_of}", "best_of")
        if body.stream and body.best_of > body.n:
            raise _bad("best_of > n cannot be streamed (the best samples are known only at the end)", "best_of")
    vocab = st.engine.model_config.vocab_size
    if any(t >= vocab for t in (body.token_biases() or ())):
        raise _bad(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
    if not st.loop.accepting:
        raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
    return model


def _check_chat_flags(body: Union[ChatCompletionRequest, TokenizeRequest]) -> None:
    """vLLM's rules for the chat template flags (400): ``continue_final_message`` needs
    ``add_generation_prompt`` false and a last message from the assistant."""
    if body.continue_final_message and body.add_generation_prompt:
        raise _bad("continue_final_message and add_generation_prompt cannot both be true "
                   "(send add_generation_prompt: false to continue the final message)", "continue_final_message")
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise _bad("continue_final_message needs the last message to be the assistant's", "continue_final_message")


async def _structured(st: ServerState, body: Union[CompletionRequest, ChatCompletionRequest],
                      tool_spec: Optional[Any] = None) -> Optional[Any]:
    """The body's structured-output spec (or ``tool_spec``, the schema of ``required`` /
    named tool calls), compiled (in a worker thread: a new schema takes up to about a
    second; then it is cached), or None. Raises 400 naming the parameter and the problem
    for a bad schema, regex, choice list or grammar, or for both kinds of constraint."""
    found = structured_spec(body)
    if tool_spec is not None:
        if found is not None:
            raise _bad(f"{found[1]} cannot be combined with tool_choice required or a named function", found[1])
        found = (tool_spec, "tools")
    if found is None:
        return None
    spec, param = found
    try:
        await asyncio.to_thread(st.engine.grammars.compile, spec)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None
    return spec


async def _submit(st: ServerState, ids: list[str], specs: list[PromptSpec], stream: bool,
                  tenant: Optional[str]) -> Submission:
    try:
        return await st.loop.submit(ids, specs, stream=stream, tenant=tenant)
    except InvalidRequestError as e:
        raise APIError(400, str(e), code="invalid_value") from None
    except EngineStoppedError as e:
        raise engine_error(e) from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _respond_when_done(ctx: ResponseContext, sub: Submission, request: Request, st: ServerState) -> Response:
    """Wait for every prompt's final output and answer with one object; a client that goes
    away meanwhile has its requests aborted (499)."""
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
        st.metrics.disconnects.labels(ctx.model).inc()
        return Response(status_code=499)
    try:
        task.result()
    except (EngineStepError, EngineStoppedError) as e:
        raise engine_error(e, ctx.rid) from None
    if any(c.finish_reason == "abort" for o in finals.values() for c in o.outputs):
        raise aborted_error()
    return JSONResponse(completion_response(ctx, st.engine.tokenizer, finals))


async def _respond(ctx: ResponseContext, sub: Submission, request: Request, st: ServerState) -> Response:
    if ctx.body.stream:
        return SSEResponse(stream_events(ctx, sub, st.metrics, st.engine.tokenizer))
    return await _respond_when_done(ctx, sub, request, st)


# ---- endpoints ----------------------------------------------------------------------
@router.get("/openapi.json", include_in_schema=False, dependencies=[KeyRequired])
async def openapi_document(request: Request) -> Response:
    return JSONResponse(request.app.openapi())


@router.get("/health")
async def health(st: State) -> Response:
    if st.loop.running:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "stopped"}, status_code=503)


@router.get("/metrics", response_class=PlainTextResponse, dependencies=[KeyRequired])
async def prometheus_metrics(st: State) -> Response:
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


def _model_card(st: ServerState) -> dict[str, Any]:
    return {"id": st.model_names[0], "object": "model", "created": st.created, "owned_by": "pagedkv",
            "root": st.engine.model_id, "max_model_len": st.engine.max_model_len}


@router.get("/v1/models")
async def list_models(st: State, tenant: Tenant) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(st)]})


@router.get("/v1/models/{name:path}")
async def get_model(name: str, st: State, tenant: Tenant) -> Response:
    _served_model(st, name)
    return JSONResponse(_model_card(st))


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
async def completions(request: Request, st: State, tenant: Tenant, body: CompletionBody) -> Response:
    model = _admit(st, body)
    engine = st.engine
    prompts = body.prompts()
    seqs = len(prompts) * (body.best_of or body.n)
    if seqs > MAX_SEQS_PER_CALL:
        raise _bad(f"prompts x n (or best_of) must be <= {MAX_SEQS_PER_CALL}, got {seqs}", "n")
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
    plp = body.logprobs if body.echo else None  # echo + logprobs: the prompt's logprobs too
    structured = await _structured(st, body)
    for ids in token_lists:
        mt = check_lengths(engine.max_model_len, len(ids), body.max_tokens, "prompt")
        specs.append(PromptSpec(ids, sampling_params(body, mt, body.logprobs, plp, structured), body.cache_salt))
    rid = f"cmpl-{uuid.uuid4().hex}"
    eids = [f"{rid}-{i}" for i in range(len(specs))]
    echo = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts] if body.echo else None
    sub = await _submit(st, eids, specs, body.stream, tenant)
    ctx = ResponseContext(rid, model, int(time.time()), "completion", token_lists, body, echo=echo)
    return await _respond(ctx, sub, request, st)


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def chat_completions(request: Request, st: State, tenant: Tenant, body: ChatBody) -> Response:
    model = _admit(st, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    engine = st.engine
    tools = ToolCalls.of(body)  # None: no tools, or tool_choice "none"
    _check_chat_flags(body)
    messages = chat_messages(body) if tools is None else tools.messages(chat_messages(body))
    try:
        ids = await asyncio.to_thread(engine.apply_chat_template, messages, body.add_generation_prompt,
                                      body.continue_final_message)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    except Exception as e:  # a template that rejects this conversation (roles, order)
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages",
                       code="invalid_value") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    mt = check_lengths(engine.max_model_len, len(ids), max_tokens, "messages")
    lp = (body.top_logprobs or 0) if body.logprobs else None
    structured = await _structured(st, body, tools.constraint() if tools is not None else None)
    spec = PromptSpec(ids, sampling_params(body, mt, lp, structured=structured), body.cache_salt)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    sub = await _submit(st, [f"{rid}-0"], [spec], body.stream, tenant)
    ctx = ResponseContext(rid, model, int(time.time()), "chat", [ids], body, tools=tools)
    return await _respond(ctx, sub, request, st)


# ---- tokenizer and version (vLLM's shapes) ----------------------------------------------
@router.get("/version")
async def version(tenant: Tenant) -> Response:
    return JSONResponse({"version": metadata.version("pagedkv")})  # the installed distribution's


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
async def tokenize(st: State, tenant: Tenant, body: TokenizeBody) -> Response:
    """Token ids of a prompt (special tokens by default) or of a conversation (the chat
    template). 404 for another model name, 400 when the template rejects the messages."""
    if body.model is not None:
        _served_model(st, body.model)
    engine = st.engine
    if body.messages is not None:
        _check_chat_flags(body)
        try:
            ids = await asyncio.to_thread(engine.apply_chat_template, chat_messages(body), body.add_generation_prompt,
                                          body.continue_final_message)
        except Exception as e:  # a template that rejects this conversation (roles, order)
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages",
                           code="invalid_value") from None
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        if special:  # the completions rule: a prompt starting with BOS gets no second one
            ids = await asyncio.to_thread(engine.tokenize, body.prompt)
        else:
            enc = await asyncio.to_thread(engine.tokenizer, body.prompt, add_special_tokens=False)
            ids = list(enc["input_ids"])
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                           "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(out)


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(st: State, tenant: Tenant, body: DetokenizeBody) -> Response:
    """The text of token ids. 400 for an id outside the vocabulary, 404 for another model."""
    if body.model is not None:
        _served_model(st, body.model)
    vocab = st.engine.model_config.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise _bad(f"token ids must be in [0, {vocab})", "tokens")
    return JSONResponse({"prompt": await asyncio.to_thread(st.engine.tokenizer.decode, body.tokens)})


# ---- the KV page --------------------------------------------------------------------
@router.get("/ui", response_class=HTMLResponse, dependencies=[KeyRequired])
async def ui_page() -> Response:
    html = resources.files("pagedkv.serving").joinpath("static/ui.html").read_text(encoding="utf-8")
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


@router.get("/ui/state")
async def ui_state(st: State, tenant: Tenant) -> Response:
    # with tenants, a caller sees its own requests; others' blocks show as "other"
    view = await asyncio.to_thread(kv_view, st.engine, st.loop, tenant)
    return JSONResponse(view, headers={"Cache-Control": "no-store"})
