"""The OpenAI mapping: request bodies to engine requests, engine outputs to OpenAI objects.

In: a ``CompletionRequest`` / ``ChatCompletionRequest`` becomes one ``SamplingParams`` per
prompt (:func:`sampling_params`) after the context-length check (:func:`check_lengths`).
Out: the engine's ``RequestOutput`` (one per prompt, ``n`` samples each) becomes the
choices of a ``text_completion`` / ``chat.completion`` object, or of the chunks of a
stream. Choice ``index`` = prompt index * n + sample index. Every length is in tokens
except ``text_offset`` (characters).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

from pagedkv.engine.request import CompletionOutput, RequestOutput, SamplingParams
from pagedkv.engine.structured import StructuredSpec
from pagedkv.serving.choices import ChoiceBuilder, zero_tokens
from pagedkv.serving.errors import APIError
from pagedkv.serving.tools import ToolCalls, chat_message_text

MAX_SEQS_PER_CALL = 64  # sequences (prompts x n) one /v1/completions call may start


# ---- requests -----------------------------------------------------------------------
def structured_spec(body: Any) -> Optional[tuple[StructuredSpec, str]]:
    """The structured-output constraint a body asks for and the parameter that asked
    (``response_format`` json_object / json_schema, ``guided_json``, ``guided_regex``,
    ``guided_choice``, ``guided_grammar``), or None. Raises 400 ``invalid_value`` when more
    than one is set or ``guided_json`` is text that is not a JSON object."""
    found: list[tuple[StructuredSpec, str]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append((StructuredSpec("json_object"), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_
        spec = StructuredSpec("json_object") if schema is None else StructuredSpec("json_schema", schema)
        found.append((spec, "response_format"))
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise APIError(400, f"guided_json is not JSON: {e}", param="guided_json", code="invalid_value") from None
            if not isinstance(schema, dict):
                raise APIError(400, "guided_json must be a JSON schema object", param="guided_json", code="invalid_value")
        found.append((StructuredSpec("json_schema", schema), "guided_json"))
    for name, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            found.append((StructuredSpec(kind, getattr(body, name)), name))
    if len(found) > 1:
        raise APIError(400, "give at most one of " + ", ".join(p for _, p in found), param=found[1][1],
                       code="invalid_value")
    return found[0] if found else None


def sampling_params(body: Any, max_tokens: int, logprobs: Optional[int],
                    prompt_logprobs: Optional[int] = None,
                    structured: Optional[StructuredSpec] = None) -> SamplingParams:
    """The engine's parameters for a request body (unset fields: the OpenAI defaults). With
    ``best_of`` the engine draws ``best_of`` samples and keeps their logprobs, so that
    :func:`completion_response` can return the ``n`` best. ``max_tokens`` 0 (completions
    with echo) runs the engine for one token, which the response leaves out. ``structured``:
    the constraint of :func:`structured_spec` (compiled by the route). Raises 400 for
    ``min_tokens`` above ``max_tokens`` or with a structured-output constraint."""
    if body.best_of is not None and body.best_of > body.n:
        logprobs = logprobs or 0
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) must be <= max_tokens ({max_tokens})",
                       param="min_tokens", code="invalid_value")
    if body.min_tokens and structured is not None:
        raise APIError(400, "min_tokens is not supported with structured outputs", param="min_tokens",
                       code="invalid_value")
    return SamplingParams(
        n=body.best_of or body.n,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=-1 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else float(body.min_p),
        repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        seed=body.seed, max_tokens=max(max_tokens, 1), stop=body.stop, prompt_logprobs=prompt_logprobs,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
        logit_bias=body.token_biases(), structured=structured, min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


def chat_messages(body: Any) -> list[dict[str, str]]:
    """The conversation for the chat template (``developer`` is sent as ``system``; earlier
    tool calls as text, see :func:`pagedkv.serving.tools.chat_message_text`)."""
    return [{"role": m.role if m.role != "developer" else "system", "content": chat_message_text(m)}
            for m in body.messages]


def check_lengths(max_model_len: int, prompt_len: int, max_tokens: Optional[int], prompt_param: str) -> int:
    """The effective ``max_tokens`` (None = the rest of the context). Raises 400
    ``context_length_exceeded`` if the prompt, or prompt + max_tokens, exceeds the context."""
    ctx = max_model_len
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


# ---- responses ----------------------------------------------------------------------
@dataclass
class ResponseContext:
    """What one HTTP call needs to turn engine outputs into OpenAI responses. ``kind``:
    "completion" or "chat"; ``prompts``: token ids per prompt; ``echo``: the prompt texts
    to prefix (completions with ``echo``)."""

    rid: str
    model: str
    created: int  # epoch seconds
    kind: str
    prompts: list[list[int]]
    body: Any
    echo: Optional[list[str]] = None
    tools: Optional[ToolCalls] = None  # chat with tools (tool_choice not "none")

    def __post_init__(self) -> None:
        self.n: int = self.body.n
        stops = self.body.stop or []
        self.holdback = max((len(s) for s in stops), default=1) - 1  # chars a stream holds back
        self.include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)

    def view(self, c: CompletionOutput) -> CompletionOutput:
        """What a response shows of sample ``c`` (``max_tokens=0``: no generated token)."""
        return zero_tokens(c) if self.kind == "completion" and self.body.max_tokens == 0 else c

    def choice_index(self, prompt_idx: int, sample_idx: int) -> int:
        return prompt_idx * self.n + sample_idx

    def all_choice_indices(self) -> list[tuple[int, int]]:
        """``(prompt_idx, choice index)`` of every choice, in order."""
        return [(p, self.choice_index(p, s)) for p in range(len(self.prompts)) for s in range(self.n)]

    def want_logprobs(self) -> bool:
        if self.kind == "chat":
            return bool(self.body.logprobs)
        return self.body.logprobs is not None

    def top_k(self) -> int:
        return (self.body.top_logprobs or 0) if self.kind == "chat" else (self.body.logprobs or 0)

    def usage(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(self.view(c).token_ids) for o in finals.values() for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in finals.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def builder(ctx: ResponseContext, tokenizer: Any, prompt_idx: int) -> ChoiceBuilder:
    """The builder of one choice's fields (the one code path of streamed and non-streamed
    responses, see :mod:`pagedkv.serving.choices`)."""
    echo = ctx.echo[prompt_idx] if ctx.echo else None
    return ChoiceBuilder(ctx.kind, tokenizer, echo, ctx.want_logprobs(), ctx.top_k(), ctx.holdback)


def _response_choice(ctx: ResponseContext, tokenizer: Any, prompt_idx: int, out: RequestOutput,
                     c: CompletionOutput) -> dict[str, Any]:
    c = ctx.view(c)
    # a final output always yields its fields (its finish reason is set)
    text, lp, finish = builder(ctx, tokenizer, prompt_idx).advance(out, c) or ("", None, c.finish_reason)
    idx = ctx.choice_index(prompt_idx, c.index)
    if ctx.kind == "chat":
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if ctx.tools is not None:
            msg, finish = ctx.tools.message(text, finish)
        return {"index": idx, "message": msg, "logprobs": lp, "finish_reason": finish}
    return {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish}


def cumulative_logprob(c: CompletionOutput) -> float:
    """Sum of the sampled tokens' logprobs of one sample (needs its logprobs)."""
    return sum(d[t] for t, d in zip(c.token_ids, c.logprobs or ()))


def best_samples(ctx: ResponseContext, out: RequestOutput) -> list[CompletionOutput]:
    """The samples of one prompt to return: all of them, or with ``best_of`` the ``n`` with
    the highest cumulative logprob, best first, re-indexed 0..n-1."""
    if len(out.outputs) <= ctx.n:
        return out.outputs
    ranked = sorted(out.outputs, key=cumulative_logprob, reverse=True)[:ctx.n]
    return [dataclasses.replace(c, index=k) for k, c in enumerate(ranked)]


def completion_response(ctx: ResponseContext, tokenizer: Any, finals: dict[int, RequestOutput]) -> dict[str, Any]:
    """The non-streaming response object from the final output of every prompt (usage
    counts every generated token, ``best_of`` candidates included)."""
    choices = [_response_choice(ctx, tokenizer, i, finals[i], c) for i in sorted(finals)
               for c in best_samples(ctx, finals[i])]
    choices.sort(key=lambda ch: ch["index"])
    return {"id": ctx.rid, "object": "chat.completion" if ctx.kind == "chat" else "text_completion",
            "created": ctx.created, "model": ctx.model, "choices": choices, "usage": ctx.usage(finals)}


def stream_chunk(ctx: ResponseContext, choices: list[dict[str, Any]],
                 usage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One streamed object (``usage`` is present, null until the last, with include_usage)."""
    d: dict[str, Any] = {"id": ctx.rid, "object": "chat.completion.chunk" if ctx.kind == "chat" else "text_completion",
                         "created": ctx.created, "model": ctx.model, "choices": choices}
    if ctx.include_usage:
        d["usage"] = usage
    return d


def opening_choices(ctx: ResponseContext) -> Optional[list[dict[str, Any]]]:
    """The choices of a stream's first chunk: the assistant role (chat, as OpenAI does);
    None if the stream opens with text (completions: an echoed prompt comes with the first
    output, together with its logprobs)."""
    if ctx.kind == "chat":
        return [{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for _, idx in ctx.all_choice_indices()]
    return None


def delta_choice(ctx: ResponseContext, idx: int, delta: str, logprobs: Optional[dict[str, Any]],
                 finish_reason: Optional[str]) -> dict[str, Any]:
    """One choice of a streamed chunk carrying ``delta`` (new text) of choice ``idx``."""
    if ctx.kind == "chat":
        finished = finish_reason is not None
        return {"index": idx, "delta": {"content": delta} if delta or not finished else {},
                "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": idx, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
