"""Streaming responses: Server-Sent Events (``data: {json}`` ... ``data: [DONE]``).

Text is sent as it is generated, except a tail that could still turn out to be (the start
of) a stop string, or an incomplete UTF-8 character. A stream that fails ends with an
OpenAI error object as its last event (no ``[DONE]``). However the response ends —
finished, client gone, or error — the submission is closed, so its engine requests are
aborted and their blocks freed at the next step fence.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from pagedkv.engine.request import RequestOutput
from pagedkv.serving.choices import ChoiceBuilder
from pagedkv.serving.engine_loop import EngineStepError, EngineStoppedError, Submission
from pagedkv.serving.errors import APIError, aborted_error, engine_error
from pagedkv.serving.metrics import ServerMetrics
from pagedkv.serving.protocol import (
    ResponseContext,
    builder,
    delta_choice,
    opening_choices,
    stream_chunk,
)

DONE = b"data: [DONE]\n\n"
logger = logging.getLogger("pagedkv.serving")


def sse(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as compact, strict JSON (a NaN or inf raises
    ``ValueError`` rather than reaching the client as a bare ``NaN``)."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


async def stream_events(ctx: ResponseContext, sub: Submission, metrics: ServerMetrics,
                        tokenizer: Any) -> AsyncIterator[bytes]:
    """The SSE events of one call (see the module docstring)."""
    states: dict[int, ChoiceBuilder] = {}
    finals: dict[int, RequestOutput] = {}
    completed = False  # ended normally or with an error event (not a disconnect)
    try:
        opening = opening_choices(ctx)
        if opening is not None:
            yield sse(stream_chunk(ctx, opening))
        async for pidx, out in sub.outputs():
            if out.finished:
                finals[pidx] = out
            choices = []
            for c in out.outputs:
                idx = ctx.choice_index(pidx, c.index)
                b = states.get(idx)
                if b is None:
                    b = states[idx] = builder(ctx, tokenizer, pidx)
                if b.done:
                    continue
                if c.finish_reason == "abort":
                    completed = True
                    yield sse(aborted_error().body())
                    return
                fields = b.advance(out, ctx.view(c))
                if fields is not None and ctx.tools is not None:  # text kept until the answer ends
                    tool_choice = ctx.tools.stream_choice(idx, fields[0], fields[2])
                    if tool_choice is not None:
                        choices.append(tool_choice)
                elif fields is not None:
                    choices.append(delta_choice(ctx, idx, *fields))
            if choices:
                yield sse(stream_chunk(ctx, choices))
        if ctx.include_usage:
            yield sse(stream_chunk(ctx, [], ctx.usage(finals)))
        yield DONE
        completed = True
    except (EngineStepError, EngineStoppedError) as e:
        completed = True
        yield sse(engine_error(e, ctx.rid).body())
    except Exception as e:  # a bug: end the stream with an error event, never a broken one
        completed = True
        logger.error("stream of request %s failed", ctx.rid, exc_info=e)
        yield sse(APIError(500, f"internal error: {type(e).__name__} (request id {ctx.rid})",
                           "server_error", code="internal_error").body())
    finally:
        if not completed and len(finals) < len(ctx.prompts):
            metrics.disconnects.labels(ctx.model).inc()
        sub.close()


class SSEResponse(StreamingResponse):
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
