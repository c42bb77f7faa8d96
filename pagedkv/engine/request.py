"""Requests, sampling parameters and outputs.

A request's token sequence is ``prompt_token_ids + output_token_ids``; the engine tracks how
many of those have their K/V in the paged cache (``num_computed_tokens``). Prefill, chunked
prefill, decode and recompute after preemption are all the same operation: compute the
tokens in ``[num_computed_tokens, num_tokens)``, a budgeted chunk at a time.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from pagedkv.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to pick output tokens (OpenAI / vLLM semantics).

    temperature: 0 = greedy; must be >= 0. top_p in (0, 1]. top_k: <= 0 or -1 = off.
    min_p in [0, 1]. repetition_penalty in [0.01, 100] (1 = off; applies to prompt and output
    tokens; bounded so that a penalised logit stays finite). presence_penalty /
    frequency_penalty in [-2, 2] (output tokens). logit_bias: token id -> bias added to that
    token's logit before sampling (OpenAI semantics; biases in [-100, 100], at most 300
    tokens, ids in the vocabulary; None = off). seed: per-request RNG,
    so a request samples the same tokens alone or in any batch. max_tokens >= 1 (tokens).
    stop: strings that end generation; the text is cut before the first one found (its
    tokens stay in ``token_ids``). stop_token_ids: token ids that end generation (like EOS);
    the token that ended a request (an EOS or one of ``stop_token_ids``) stays in
    ``token_ids`` but its text is not in ``text`` (vLLM's semantics, also with
    ``skip_special_tokens=False``). include_stop_str_in_output: keep the matched stop string,
    or the stop token's text, at the end of ``text``. ignore_eos: keep going past EOS
    (benchmarks). min_tokens: generated tokens before EOS / stop_token_ids may be sampled
    (their logits are -inf until then, speculative drafts included) and before a stop
    string may end the request (a stop string must end after the first ``min_tokens``
    tokens' text); ``0 <= min_tokens <= max_tokens``; not with beam search or ``structured``.
    logprobs: return the top-N log-probabilities per generated token (None = off).
    prompt_logprobs: return, per prompt token, its log-probability given the tokens before
    it plus the top-N alternatives (None = off; the first prompt token has none). Computed
    during prefill from the prompt positions' logits; such a request *bypasses the prefix
    cache lookup* (every prompt position is computed, so no cached position's logprob is
    lost; its full blocks are still published for other requests).
    n: number of parallel samples of one prompt (they share the prompt's blocks).
    beam_width: > 1 = beam search (deterministic; the beams share blocks by copy-on-write).
    It returns ``beam_width`` finished hypotheses, best first, scored as cumulative logprob
    / generated_len ** length_penalty (transformers' semantics); temperature, top-p/k/min-p
    and seed are ignored; n, penalties, stop strings and logprobs are not supported with it.
    length_penalty: exponent of the generated length in the beam score (> 0 favours longer).
    early_stopping: beam search stop rule: False (heuristic), True (as soon as beam_width
    hypotheses are finished) or "never" (only when no running beam can do better).
    structured: a ``pagedkv.engine.structured.StructuredSpec`` (JSON object, JSON schema,
    regex, choice or grammar) the output must match; None = off. With beam search every beam's
    next-token scores are masked by its own grammar state.

    Raises ``InvalidRequestError`` from :meth:`validate` on out-of-range values.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: Any = False
    logit_bias: Optional[dict[int, float]] = None
    prompt_logprobs: Optional[int] = None
    structured: Any = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False

    # The accepted ranges: validate() checks them, the server's request schemas reuse them.
    MAX_N: ClassVar[int] = 64  # default cap of n and beam_width (the engine passes its own)
    MAX_LOGPROBS: ClassVar[int] = 20  # cap of logprobs (top-N per token)
    MIN_TEMPERATURE: ClassVar[float] = 0.0  # temperature >= this (0 = greedy)
    TOP_P_RANGE: ClassVar[tuple[float, float]] = (0.0, 1.0)  # low < top_p <= high
    MIN_P_RANGE: ClassVar[tuple[float, float]] = (0.0, 1.0)  # low <= min_p <= high
    PENALTY_RANGE: ClassVar[tuple[float, float]] = (-2.0, 2.0)  # presence / frequency, inclusive
    REPETITION_PENALTY_RANGE: ClassVar[tuple[float, float]] = (0.01, 100.0)  # inclusive
    LOGIT_BIAS_RANGE: ClassVar[tuple[float, float]] = (-100.0, 100.0)  # inclusive (OpenAI's)
    MAX_LOGIT_BIAS: ClassVar[int] = 300  # tokens one request may bias

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy: dividing logits by them overflows fp32."""
        return self.temperature < _GREEDY_EPS

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def uses_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, max_n: int = MAX_N, max_logprobs: int = MAX_LOGPROBS,
                 vocab_size: Optional[int] = None) -> None:
        """Raise ``InvalidRequestError`` naming the first out-of-range field. ``vocab_size``
        (when given) bounds the token ids of ``logit_bias``."""

        def bad(field_name: str, why: str) -> None:
            raise InvalidRequestError(f"SamplingParams.{field_name}: {why}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.n > max_n:
            bad("n", f"must be <= {max_n}, got {self.n}")
        if not _is_finite(self.temperature) or self.temperature < self.MIN_TEMPERATURE:
            bad("temperature", f"must be >= {self.MIN_TEMPERATURE:g}, got {self.temperature!r}")
        lo, hi = self.TOP_P_RANGE
        if not _is_finite(self.top_p) or not (lo < self.top_p <= hi):
            bad("top_p", f"must be in ({lo:g}, {hi:g}], got {self.top_p!r}")
        if not _is_int(self.top_k):
            bad("top_k", f"must be an integer, got {self.top_k!r}")
        lo, hi = self.MIN_P_RANGE
        if not _is_finite(self.min_p) or not (lo <= self.min_p <= hi):
            bad("min_p", f"must be in [{lo:g}, {hi:g}], got {self.min_p!r}")
        lo, hi = self.REPETITION_PENALTY_RANGE
        if not _is_finite(self.repetition_penalty) or not (lo <= self.repetition_penalty <= hi):
            bad("repetition_penalty", f"must be in [{lo:g}, {hi:g}], got {self.repetition_penalty!r}")
        self._validate_logit_bias(bad, vocab_size)
        lo, hi = self.PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_finite(v) or not (lo <= v <= hi):
                bad(name, f"must be in [{lo:g}, {hi:g}], got {v!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            bad("min_tokens", f"must be an integer in [0, max_tokens] = [0, {self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output", f"must be a bool, got {self.include_stop_str_in_output!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not (0 <= self.logprobs <= max_logprobs)
        ):
            bad("logprobs", f"must be an integer in [0, {max_logprobs}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not (0 <= self.prompt_logprobs <= max_logprobs)
        ):
            bad("prompt_logprobs", f"must be an integer in [0, {max_logprobs}], got {self.prompt_logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (-(2**63) <= self.seed < 2**63)):
            bad("seed", f"must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.stop is not None and (
            not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop)
        ):
            bad("stop", "must be a list of non-empty strings")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, (list, tuple))
            or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)
        ):
            bad("stop_token_ids", "must be a list of token ids >= 0")
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            bad("beam_width", f"must be an integer >= 1, got {self.beam_width!r}")
        if self.beam_width > max_n:
            bad("beam_width", f"must be <= {max_n}, got {self.beam_width}")
        if not _is_finite(self.length_penalty) or abs(self.length_penalty) > 100:
            bad("length_penalty", f"must be a number in [-100, 100], got {self.length_penalty!r}")
        for name in ("skip_special_tokens", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be a bool, got {getattr(self, name)!r}")
        if not (self.early_stopping is False or self.early_stopping is True or self.early_stopping == "never"):
            bad("early_stopping", f"must be False, True or 'never', got {self.early_stopping!r}")
        if self.structured is not None:
            from pagedkv.engine.structured import StructuredSpec

            if not isinstance(self.structured, StructuredSpec):
                bad("structured", f"must be a StructuredSpec or None, got {type(self.structured).__name__}")
            self.structured.validate()
            if self.min_tokens:
                bad("min_tokens", "not supported with structured outputs (a complete match must end)")
        if self.beam_width > 1:
            if self.n != 1:
                bad("n", "must be 1 with beam search (beam_width hypotheses are returned)")
            if self.uses_penalties:
                bad("repetition_penalty", "penalties are not supported with beam search")
            if self.stop:
                bad("stop", "stop strings are not supported with beam search (use stop_token_ids)")
            if self.logprobs is not None:
                bad("logprobs", "not supported with beam search")
            if self.prompt_logprobs is not None:
                bad("prompt_logprobs", "not supported with beam search")
            if self.logit_bias:
                bad("logit_bias", "not supported with beam search")
            if self.min_tokens:
                bad("min_tokens", "not supported with beam search")

    def _validate_logit_bias(self, bad: Any, vocab_size: Optional[int]) -> None:
        lb = self.logit_bias
        if lb is None:
            return
        if not isinstance(lb, dict):
            bad("logit_bias", f"must be a dict of token id -> bias, got {type(lb).__name__}")
        if len(lb) > self.MAX_LOGIT_BIAS:
            bad("logit_bias", f"at most {self.MAX_LOGIT_BIAS} tokens, got {len(lb)}")
        lo, hi = self.LOGIT_BIAS_RANGE
        top = vocab_size if vocab_size is not None else 2**63
        for t, b in lb.items():
            if not _is_int(t) or not 0 <= t < top:
                bad("logit_bias", f"token ids must be integers in [0, {top}), got {t!r}")
            if not _is_finite(b) or not lo <= b <= hi:
                bad("logit_bias", f"biases must be numbers in [{lo:g}, {hi:g}], got {b!r} for token {t}")


_GREEDY_EPS = 1e-5


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a structured-output grammar failed at run time (stop_reason says why)

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass
class Request:
    """One sequence being generated (a parallel-sampling child is its own Request): the
    scheduler's state only. Its text (detokeniser state) is the output processor's
    (``pagedkv.engine.output.TextState``)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    cache_keys: Any = None  # pagedkv.kv.CacheKeys: the prefix-cache identity
    priority: int = 0  # lower value = served first (vLLM convention)
    prompt: Optional[str] = None
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 0  # prompt + output cap (max_model_len and max_tokens)
    parent_id: Optional[str] = None  # the user-visible request this sequence belongs to
    index: int = 0  # which of the parent's n samples

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (tokens); -1 = not yet
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # of those, per tier (pool/host/disk)
    num_preemptions: int = 0
    num_prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache at first admission
    num_cow_copies: int = 0  # copy-on-write block copies made for this sequence's writes
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Any = None
    stopped_by_token: bool = False  # ended by an EOS or a stop_token_ids token (its text is left out)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    scheduled_time: Optional[float] = None
    generator: Optional[torch.Generator] = None
    grammar: Any = None  # structured output: the matcher (pagedkv.engine.structured.GrammarState)
    # speculative decoding back-off: decode steps to skip proposing, consecutive fruitless verifies
    spec_wait: int = 0
    spec_misses: int = 0
    # the proposer's drafts (pagedkv.worker.proposer) and the num_tokens they follow
    draft_token_ids: list[int] = field(default_factory=list)
    draft_after: int = -1
    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    # ---- token bookkeeping -------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        """prompt + output token ids (a live list: do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int, logprobs: Optional[dict[int, float]] = None) -> bool:
        """Append a sampled token; True when appended. False (nothing appended) when the
        structured-output grammar has failed or fails on this token: the caller finishes
        the sequence (``Scheduler.grammar_failed``), it never continues unconstrained."""
        if self.grammar is not None and not self.grammar.accept(token_id):
            return False
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        return True

    def stop_status(self, token_id: int) -> Optional[RequestStatus]:
        """The status this sequence ends with after appending ``token_id``, or None. EOS and
        ``stop_token_ids`` count only once ``min_tokens`` tokens were generated (the sampler
        masks them before; this keeps the rule for any other path) and set
        ``stopped_by_token`` (the token's text is left out of the output text)."""
        p = self.sampling_params
        if self.num_output_tokens > p.min_tokens:  # the token just appended is not within min_tokens
            if not p.ignore_eos and token_id in self.eos_token_ids:
                self.stop_reason = None
                self.stopped_by_token = True
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and token_id in p.stop_token_ids:
                self.stop_reason = token_id
                self.stopped_by_token = True
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.done:  # structured output complete
            self.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def grammar_failure(self, counts: dict[str, int]) -> RequestStatus:
        """Count this sequence's failed grammar in ``counts[reason]`` (the scheduler's
        ``stats.grammar_failures``), set ``stop_reason`` to ``"grammar <reason>: <message>"``;
        returns the status to finish it with (``FINISHED_ERROR``)."""
        reason, msg = self.grammar.failure if self.grammar is not None and self.grammar.failure else ("parser_error", "")
        counts[reason] = counts.get(reason, 0) + 1
        self.stop_reason = f"grammar {reason}: {msg}" if msg else f"grammar {reason}"
        return RequestStatus.FINISHED_ERROR

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None


@dataclass
class CompletionOutput:
    """One of a request's n samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error" (grammar failure) | None while running
    logprobs: Optional[list[dict[int, float]]] = None
    stop_reason: Any = None
    cumulative_logprob: Optional[float] = None  # beam search: sum of the tokens' logprobs
    score: Optional[float] = None  # beam search: cumulative_logprob / len ** length_penalty


@dataclass
class RequestMetrics:
    """Timing of one request (seconds since the epoch, ``time.time()``)."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_preemptions: int = 0
    # sharing, summed over the request's sequences (tokens unless named)
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, served from cached blocks (prefill skipped)
    num_cow_copies: int = 0  # copy-on-write block copies

    @property
    def prefix_hit_rate(self) -> float:
        """prefix_hit_tokens / prefix_query_tokens (0 when nothing was looked up)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """What the engine returns for a request: ``outputs`` holds its n samples; ``text``,
    ``token_ids`` and ``finish_reason`` are those of the first sample (the common n=1 case)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prefix-cache hit, tokens
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # of those, per tier: pool, host, disk
    # SamplingParams.prompt_logprobs: per prompt token, {token: logprob, then the top-N}
    # (None for the first token); None when not asked for
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason


def now() -> float:
    return time.time()
