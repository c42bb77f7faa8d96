"""The input processor: a user's request in, a request ready for the scheduler out.

Everything that happens before a request enters the scheduler (vLLM v1's ``Processor``):
type and range checks of the request's options, tokenisation (plain text) or chat templates,
the sampling parameters' validation, the structured-output grammar's compilation (a bad
schema is refused here, not in a step), the prefix-cache identity (model, revision, KV
format, adapter, salt, tenant, multimodal hashes) and the KV blocks the request could ever
need. :meth:`InputProcessor.process` raises before anything is admitted or allocated;
:meth:`InputProcessor.make` builds the scheduler's :class:`Request` and its
:class:`SequenceGroup` once the engine (under its lock) has given the request its id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from pagedkv.engine.request import Request, SamplingParams, now
from pagedkv.engine.sequence_group import SequenceGroup, request_blocks
from pagedkv.errors import InvalidRequestError
from pagedkv.kv import CacheKeys
from pagedkv.model.tokenizer import apply_chat, encode_prompt, read_chat_template


@dataclass(frozen=True)
class ProcessedRequest:
    """A validated request, not yet queued: ``prompt`` (the text, ``None`` for token ids),
    ``token_ids`` (its prompt tokens), ``params``, ``arrival_time`` (seconds since the epoch;
    ``None``: the time it is queued), ``priority``, ``max_total_tokens`` (prompt + output
    cap, tokens), ``stream``, and the request's part of its prefix-cache identity
    (``adapter_id``, ``cache_salt``, ``mm_hashes``, ``tenant``; see ``CacheKeys``)."""

    prompt: Optional[str]
    token_ids: list[int]
    params: SamplingParams
    arrival_time: Optional[float]
    priority: int
    max_total_tokens: int
    stream: bool = False
    adapter_id: Optional[str] = None
    cache_salt: Optional[str] = None
    mm_hashes: tuple = ()
    tenant: Optional[str] = None


@dataclass
class InputLimits:
    """What a request is checked against: ``vocab_size`` (token ids), ``max_model_len``
    (tokens), ``max_n`` (n and beam_width), the KV pool (``num_blocks`` blocks of
    ``block_size`` tokens, ``windows``: per layer group its sliding window or ``None``),
    ``enable_paging`` and ``chunk`` (most tokens of one step; a window group's hold)."""

    vocab_size: int
    max_model_len: int
    max_n: int
    num_blocks: int
    block_size: int
    enable_paging: bool
    chunk: int
    windows: Sequence[Optional[int]] = (None,)


class InputProcessor:
    """Validates, tokenises and identifies requests (see the module doc). ``tokenizer``: the
    model's; ``chat_template``: a path or template text overriding the model's (``None``:
    the model's own); ``compile_grammar``: compiles a ``StructuredSpec`` (raising
    ``InvalidRequestError`` for a bad one; ``None``: structured outputs refused);
    ``model_id`` / ``revision`` / ``kv_format_id``: the engine's part of the prefix-cache
    identity; ``eos_token_ids``: the model's EOS tokens."""

    def __init__(self, tokenizer: Any, limits: InputLimits, *, model_id: str, revision: str, kv_format_id: str,
                 eos_token_ids: Sequence[int] = (), chat_template: Optional[str] = None,
                 compile_grammar: Optional[Callable[[Any], Any]] = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_id = model_id
        self.revision = revision
        self.kv_format_id = kv_format_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = None if chat_template is None else read_chat_template(chat_template)
        self.compile_grammar = compile_grammar

    # ---- prompts -------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a plain-text prompt, with the model's own BOS/EOS rule
        (``pagedkv.model.tokenizer.encode_prompt``)."""
        return encode_prompt(self.tokenizer, prompt)

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be served: the ``chat_template`` option or the model's
        own template (a base model such as Gemma-3-270M has none)."""
        return bool(self.chat_template or getattr(self.tokenizer, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        """Token ids of a conversation (``pagedkv.model.tokenizer.apply_chat``: flags as there);
        ``InvalidRequestError``: bad messages or flags, no template, or a conversation the
        template or tokenizer cannot render (a ``content`` that is no string, a lone surrogate)."""
        try:
            return apply_chat(self.tokenizer, messages, add_generation_prompt, self.chat_template, self.model_id,
                              continue_final_message=continue_final_message)
        except InvalidRequestError:
            raise
        except Exception as e:  # the template or tokenizer refused this conversation (content None, a list, ...)
            raise InvalidRequestError(f"cannot apply the chat template: {type(e).__name__}: {e}") from None

    # ---- requests ------------------------------------------------------------------------
    def process(
        self,
        prompt: Union[str, Sequence[int]],
        sampling_params: Optional[SamplingParams] = None,
        *,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        adapter_id: Optional[str] = None,
        mm_hashes: Sequence[tuple] = (),
        stream: bool = False,
        tenant: Optional[str] = None,
        tokenize: Optional[Callable[[str], list[int]]] = None,
    ) -> ProcessedRequest:
        """Check and tokenise one request (arguments: ``LLMEngine.add_request``'s; ``tokenize``
        replaces :meth:`tokenize` for text prompts). Raises ``InvalidRequestError`` for a bad
        option type, an empty prompt, a text prompt that is not valid Unicode (a lone
        surrogate), token ids outside the vocabulary, a prompt with no room for one output
        token within max_model_len, bad sampling params or grammar, or a request that could
        never fit the whole KV pool."""
        lim = self.limits
        if tenant is not None and not isinstance(tenant, str):
            raise InvalidRequestError(f"tenant must be a string or None, got {type(tenant).__name__}")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams")
        params.validate(max_n=lim.max_n, vocab_size=lim.vocab_size)
        if params.structured is not None:  # a bad schema/regex/grammar: InvalidRequestError
            if self.compile_grammar is None:
                raise InvalidRequestError("structured outputs are not available in this engine")
            self.compile_grammar(params.structured)
        _check_options(arrival_time, priority, cache_salt, adapter_id, mm_hashes)
        if isinstance(prompt, str):
            _check_unicode(prompt, "prompt")
            text: Optional[str] = prompt
            token_ids = (tokenize or self.tokenize)(prompt)
        else:
            if not isinstance(prompt, (list, tuple)):
                raise InvalidRequestError(
                    f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
                )
            text = None
            token_ids = list(prompt)
            if not all(type(t) is int and 0 <= t < lim.vocab_size for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {lim.vocab_size})")
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= lim.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {lim.max_model_len} "
                "(the prompt plus at least one output token must fit)"
            )
        total = min(len(token_ids) + params.max_tokens, lim.max_model_len)
        need = request_blocks(len(token_ids), total, params, lim.block_size, lim.enable_paging, lim.max_model_len,
                              lim.windows, chunk=lim.chunk)
        if need > lim.num_blocks:
            raise InvalidRequestError(
                f"request needs {need} KV blocks ({total} tokens) but the pool has only "
                f"{lim.num_blocks}: it could never fit"
            )
        return ProcessedRequest(text, token_ids, params, arrival_time, priority, total, stream,
                                adapter_id, cache_salt, tuple(mm_hashes), tenant)

    def make(self, request_id: Any, req: ProcessedRequest, in_use: Callable[[str], bool]) -> tuple[SequenceGroup, Request]:
        """The group and first sequence of ``req`` under the id ``request_id`` (made a
        string); ``in_use(id)``: whether a live request has that id. Raises
        ``InvalidRequestError`` for an id holding ``#`` (the engine's n > 1 / beam sequence
        ids) or one in use, or for a malformed ``mm_hashes`` entry (``CacheKeys``)."""
        request_id = str(request_id)
        if "#" in request_id:  # reserved for the engine's n > 1 / beam sequence ids
            raise InvalidRequestError(f"request id {request_id!r} must not contain '#'")
        if in_use(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        t = req.arrival_time if req.arrival_time is not None else now()
        keys = CacheKeys(
            model_id=self.model_id, revision=self.revision, adapter_id=req.adapter_id,
            cache_salt=req.cache_salt, mm_hashes=req.mm_hashes, tenant=req.tenant,
            kv_cache_dtype=self.kv_format_id,
        )
        p = req.params
        group = SequenceGroup(request_id, req.prompt, req.token_ids, p, t, pending_children=p.n - 1, stream=req.stream)
        seq = Request(
            request_id=request_id, prompt_token_ids=req.token_ids, sampling_params=p,
            arrival_time=t, cache_keys=keys, priority=req.priority, prompt=req.prompt,
            eos_token_ids=self.eos_token_ids, max_total_tokens=req.max_total_tokens, parent_id=request_id,
        )
        return group, seq


def _check_options(arrival_time: Any, priority: Any, cache_salt: Any, adapter_id: Any, mm_hashes: Any) -> None:
    """``InvalidRequestError`` for an ``arrival_time`` that is no finite number, a
    ``priority`` that is no integer, a ``cache_salt`` / ``adapter_id`` that is no string, or
    ``mm_hashes`` that are not ``(content_hash: str, offset >= 0, length >= 0)`` tuples."""
    if arrival_time is not None and (
        isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))
        or not math.isfinite(arrival_time)
    ):
        raise InvalidRequestError(f"arrival_time must be seconds (a finite number), got {arrival_time!r}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
    for name, v in (("cache_salt", cache_salt), ("adapter_id", adapter_id)):
        if v is not None and not isinstance(v, str):
            raise InvalidRequestError(f"{name} must be a string or None, got {type(v).__name__}")
    if not isinstance(mm_hashes, (list, tuple)) or not all(
        isinstance(m, tuple) and len(m) == 3 and isinstance(m[0], str)
        and all(type(x) is int and x >= 0 for x in m[1:]) for m in mm_hashes
    ):
        raise InvalidRequestError("mm_hashes must be a list of (content_hash: str, offset, length) tuples")


def _check_unicode(text: str, name: str) -> None:
    """``InvalidRequestError`` when ``text`` cannot be encoded as UTF-8 (a lone surrogate such
    as ``"\\ud800"``): the tokenizer would raise a bare ``TypeError`` deep inside."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{name} is not valid Unicode: {e.object[e.start:e.end]!a} at character {e.start} (a lone surrogate)"
        ) from None
