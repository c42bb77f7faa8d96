"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice of
strings or a grammar, through llguidance (a CPU grammar engine; ``pagedkv bench structured``
measures its mask cost on the bundled model).

* :class:`StructuredSpec` is what a request asks for (``SamplingParams.structured``).
* :class:`GrammarCompiler` (one per engine) turns a spec into a :class:`CompiledGrammar` at
  ``add_request``: a bad schema, regex or grammar raises ``InvalidRequestError`` naming the
  problem; compiled grammars are cached by the spec's hash (LRU, ``CACHE_SIZE`` entries); spec
  text is bounded (``MAX_SPEC_CHARS``) and llguidance's parser limits bound the work.
* :class:`GrammarState` is a request's matcher (``Request.grammar``). It depends only on the
  request's output tokens: the sampler makes it on first use by replaying them, and again
  whenever its count of consumed tokens differs from the request's (a sequence forked for
  ``n > 1``, a preempted one that recomputes, a prefix-cache hit: none needs anything else).
  ``Request.append_output_token`` advances it, the one place sampled tokens are appended.
* :func:`apply_grammar_masks` is the sampler's one call: for the rows with a grammar, fill
  one token bitmask ``[rows, ceil(vocab / 32)]`` int32 and add -inf to those rows' forbidden logits
  in one batched operation; rows without one are untouched (and keep the C sampling path).

A grammar that can end allows EOS; once nothing may follow (``GrammarState.done``) the
scheduler's stop check finishes the request with ``"stop"`` without waiting for an EOS token.
``max_tokens`` and stop strings still cut the output where they fall (``"length"`` / ``"stop"``).

Grammars fail closed. A spec with an empty language (``root ::= root``; a first mask that
errs or allows no token) or a regex llguidance would misread (a lone trailing backslash) is
``InvalidRequestError`` at compile time, before the request takes a block. At run time a
matcher that errs (a parser limit such as ``root ::= "ab" root``'s endless forced tokens, a
parser error, a refused token, a mask with no token, an exception) never lets the sequence go
on unconstrained: the token it failed on is dropped and the scheduler finishes the sequence
with finish reason ``"error"`` and ``stop_reason`` ``"grammar <reason>: <message>"``; its text
is what the grammar accepted so far. The scheduler counts these by reason
(``SchedulerStats.grammar_failures``, Prometheus ``pagedkv_grammar_failures_total``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from pagedkv.errors import InvalidRequestError

logger = logging.getLogger("pagedkv")

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # characters of a schema (as JSON), regex, grammar or choice list
MAX_CHOICES = 1024
CACHE_SIZE = 256  # compiled grammars kept per engine
# JSON layout of generated objects: one space after ',' and ':', no other whitespace (a
# schema may override it with its own "x-guidance" options)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(eq=False)
class StructuredSpec:
    """A constraint on a request's output text.

    ``kind``: ``json_object`` (any JSON object; ``value`` unused), ``json_schema``
    (``value``: the schema, a dict), ``regex`` (``value``: a Rust-syntax regex the whole
    output matches), ``choice`` (``value``: a list of strings, the output is one of them) or
    ``grammar`` (``value``: a Lark grammar, or a GBNF/EBNF one with ``root ::= ...``).
    ``compiled`` is set by the engine at ``add_request``. Raises ``InvalidRequestError`` from
    :meth:`validate`."""

    kind: str
    value: Any = None
    compiled: Optional["CompiledGrammar"] = field(default=None, repr=False)

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` for an unknown kind or a value of the wrong type or
        size (the grammar itself is checked when compiled)."""
        def bad(why: str) -> None:
            raise InvalidRequestError(f"SamplingParams.structured: {why}")

        if self.kind not in KINDS:
            bad(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        v = self.value
        if self.kind == "json_schema" and not isinstance(v, (dict, bool)):
            bad(f"json_schema needs a JSON schema object, got {type(v).__name__}")
        if self.kind in ("regex", "grammar") and not (isinstance(v, str) and v):
            bad(f"{self.kind} needs a non-empty string")
        if self.kind == "choice":
            if not (isinstance(v, (list, tuple)) and v and all(isinstance(c, str) for c in v)):
                bad("choice needs a non-empty list of strings")
            if len(v) > MAX_CHOICES:
                bad(f"choice: at most {MAX_CHOICES} strings, got {len(v)}")
        try:
            size = len(self.text())
        except (TypeError, ValueError) as e:  # a schema json.dumps cannot write
            bad(f"{self.kind} is not JSON: {e}")
        if size > MAX_SPEC_CHARS:
            bad(f"{self.kind}: at most {MAX_SPEC_CHARS} characters, got {size}")

    def text(self) -> str:
        """The spec as the grammar engine reads it (a schema as JSON text)."""
        if self.kind == "json_object":
            return '{"type": "object"}'
        if self.kind in ("json_schema", "choice"):
            return json.dumps(self.value)  # key order kept: properties come out in schema order
        return str(self.value)

    def key(self) -> str:
        """A hash of kind and value: the compile cache's key."""
        return hashlib.sha256(f"{self.kind}\0{self.text()}".encode()).hexdigest()


class CompiledGrammar:
    """A validated grammar (llguidance's serialised form) bound to the engine's tokenizer.
    ``template``: a matcher at the start of the grammar; every sequence's matcher is a copy
    of it (cheaper than parsing the grammar again). ``eos_token_id``: the token a failed
    matcher's mask still allows (None: none known)."""

    def __init__(self, grammar: str, template: Any, eos_token_id: Optional[int] = None) -> None:
        self.grammar = grammar
        self.template = template
        self.eos_token_id = eos_token_id
        self._lock = threading.Lock()

    def new_state(self) -> "GrammarState":
        """A fresh matcher for one sequence (thread-safe)."""
        with self._lock:
            return GrammarState(self.template.deep_copy(), self.eos_token_id)


# GrammarState.failure reasons (the ``reason`` label of pagedkv_grammar_failures_total)
FAILURE_REASONS = ("parser_limit", "parser_error", "no_token", "exception")


class GrammarState:
    """One sequence's matcher. ``consumed``: output tokens fed (and accepted) so far.

    Fails closed: once the matcher errs (a parser limit, a parser error, a token it refuses,
    a mask that allows no token, an exception from llguidance), ``failure`` is set to
    ``(reason, message)`` (reason one of ``FAILURE_REASONS``), :meth:`accept` refuses every
    further token (the caller drops it and finishes the sequence with ``"error"``) and
    :meth:`fill` allows only EOS. The output never continues unconstrained."""

    __slots__ = ("matcher", "consumed", "failure", "eos_token_id")

    def __init__(self, matcher: Any, eos_token_id: Optional[int] = None) -> None:
        self.matcher = matcher
        self.consumed = 0
        self.failure: Optional[tuple[str, str]] = None
        self.eos_token_id = eos_token_id
        self._check("start")

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def _fail(self, reason: str, message: str) -> None:
        if self.failure is None:
            self.failure = (reason, _first_line([message])[:300])
            logger.warning("structured output: grammar failed after %d tokens (%s: %s); the sequence "
                           "ends here", self.consumed, reason, self.failure[1])

    def _check(self, where: str) -> bool:
        """Record the matcher's error state, if any; True when it is fine."""
        try:
            msg = self.matcher.get_error()  # set by a failed consume even when is_error() is not
            if not msg and not self.matcher.is_error():
                return True
            msg = msg or where
        except Exception as e:  # noqa: BLE001 - a broken matcher fails the sequence, never the engine
            self._fail("exception", f"{where}: {type(e).__name__}: {e}")
            return False
        self._fail("parser_limit" if "limit" in msg.lower() else "parser_error", msg)
        return False

    def accept(self, token_id: int) -> bool:
        """Advance by one output token; True when the token may be emitted. A token after
        the grammar stopped (EOS ignored) is counted but not fed. False (the token is not
        counted; the caller drops it and ends the sequence) once the grammar has failed or
        when this token makes it fail (refused, a parser limit, an exception)."""
        if self.failure is not None:
            return False
        try:
            if self.matcher.is_stopped():
                self.consumed += 1
                return True
            ok = self.matcher.consume_token(token_id)
        except Exception as e:  # noqa: BLE001 - see _check
            self._fail("exception", f"token {token_id}: {type(e).__name__}: {e}")
            return False
        if not self._check(f"token {token_id} refused") or not ok:
            self._fail("parser_error", f"token {token_id} refused")  # no-op if _check recorded one
            return False
        self.consumed += 1
        return True

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and nothing may follow (the request stops)."""
        if self.failure is not None:
            return False
        try:
            return bool(self.matcher.is_stopped())
        except Exception as e:  # noqa: BLE001 - see _check
            self._fail("exception", f"is_stopped: {type(e).__name__}: {e}")
            return False

    def copy(self) -> "GrammarState":
        """An independent matcher at the same point (a forked sequence)."""
        st = GrammarState(self.matcher.deep_copy(), self.eos_token_id)
        st.consumed, st.failure = self.consumed, self.failure
        return st

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, bit ``t % 32`` of word
        ``t // 32`` = token ``t``). A failed matcher, or one that fails now or allows no
        token, allows only EOS (all tokens if no EOS id is known: the caller drops what is
        sampled, see :meth:`accept`)."""
        v = bitmask[row]
        if self.failure is None:
            try:
                self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
            except Exception as e:  # noqa: BLE001 - see _check
                self._fail("exception", f"mask: {type(e).__name__}: {e}")
            if self._check("mask") and self.failure is None and not bool(v.any()):
                self._fail("no_token", "the grammar allows no token here")
        if self.failure is not None:
            eos = self.eos_token_id
            if eos is None or eos >= v.numel() * 32:
                v.fill_(-1)
            else:
                v.zero_()
                v[eos // 32] = _bit(eos % 32)


def _bit(j: int) -> int:
    """Bit ``j`` (0-31) of an int32 word, as a Python int in int32 range."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j


class GrammarCompiler:
    """Compiles :class:`StructuredSpec` for one tokenizer (thread-safe; the llguidance
    tokenizer is built on first use, about 0.7 s for a 49k vocabulary).

    ``tokenizer``: a transformers tokenizer; ``vocab_size``: the logits' width;
    ``eos_token_ids``: the model's EOS ids (the first one ends a complete grammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = list(eos_token_ids)
        self._lltok: Any = None
        self._limits: Any = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance
            import llguidance.hf

            eos = self.eos_token_ids[0] if self.eos_token_ids else None
            hf = getattr(self.hf_tokenizer, "hf", self.hf_tokenizer)  # a FastTokenizer's transformers one
            self._lltok = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
            self._limits = llguidance.LLParserLimits(verbose_errors=False)
        return self._lltok

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (also stored in ``spec.compiled``). Raises
        ``InvalidRequestError`` naming the problem (bad type, schema, regex or grammar)."""
        if not isinstance(spec, StructuredSpec):
            raise InvalidRequestError(f"SamplingParams.structured must be a StructuredSpec, got {type(spec).__name__}")
        spec.validate()
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                spec.compiled = hit
                return hit
            self.misses += 1
            tok = self._tokenizer()
        grammar = _grammar_of(spec)
        import llguidance

        template = llguidance.LLMatcher(tok, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise InvalidRequestError(f"structured output ({spec.kind}): {_first_line([template.get_error()])}")
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        _check_nonempty(spec, template, self.vocab_size)
        compiled = CompiledGrammar(grammar, template, eos)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        spec.compiled = compiled
        return compiled

    def __len__(self) -> int:
        return len(self._cache)


def _check_nonempty(spec: StructuredSpec, template: Any, vocab_size: int) -> None:
    """Raise ``InvalidRequestError`` when the grammar accepts no output at all: its first
    mask errs (``root ::= root``: no rule can start) or allows no token. One mask on a copy
    of ``template`` (the compile cache keeps the result)."""
    probe = template.deep_copy()
    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    probe.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
    if probe.is_error() or not bool(bitmask.any()):
        why = probe.get_error() if probe.is_error() else "no token allowed"
        raise InvalidRequestError(f"structured output ({spec.kind}): the {spec.kind} accepts no output "
                                  f"(empty language: {_first_line([why])[:200]})")


def _grammar_of(spec: StructuredSpec) -> str:
    """llguidance's grammar for ``spec``; ``InvalidRequestError`` when it cannot be read."""
    import llguidance
    from llguidance import LLMatcher

    try:
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec.text(), defaults=JSON_OPTIONS)
        if spec.kind == "grammar":
            return llguidance.grammar_from("grammar", spec.value)
        if spec.kind == "regex" and (len(spec.value) - len(spec.value.rstrip("\\"))) % 2:
            # llguidance would drop the lone trailing backslash and accept another language
            raise ValueError("regex ends with a lone backslash (an incomplete escape)")
        return llguidance.grammar_from(spec.kind, spec.text())
    except (ValueError, TypeError, RuntimeError) as e:  # the engine's answer to bad input
        raise InvalidRequestError(f"structured output ({spec.kind}): {_first_line([str(e)])}") from None


def _first_line(messages: Sequence[str]) -> str:
    """The messages on one line (whitespace runs collapsed), at most 500 characters."""
    text = " ".join(" ".join(str(m) for m in messages).split()) or "invalid"
    return text[:500]


def state_of(req: Any) -> GrammarState:
    """``req``'s matcher, made (or remade) by replaying its output tokens when it has none or
    its count differs from the request's. Raises ``InvalidRequestError`` if the spec was
    never compiled (a request that bypassed ``add_request``)."""
    st = req.grammar
    if st is not None and st.consumed == req.num_output_tokens:
        return st
    compiled = req.sampling_params.structured.compiled
    if compiled is None:
        raise InvalidRequestError(f"{req.request_id}: structured output spec was not compiled (add_request does it)")
    st = compiled.new_state()
    for t in req.output_token_ids:
        st.accept(t)
    req.grammar = st
    return st


def constrained_rows(requests: Sequence[Any]) -> list[int]:
    """Indices of the requests that have a structured-output spec."""
    return [i for i, r in enumerate(requests) if r.sampling_params.structured is not None]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 ``[rows, vocab]``: 0 where token ``t`` is allowed (bit ``t % 32`` of int32 word
    ``t // 32`` set; ``bitmask`` int32 ``[rows, words]``, little-endian bytes), -inf where
    not: one table lookup per byte (8 tokens), about half the time of unpacking bits."""
    rows = bitmask.shape[0]
    b = bitmask.contiguous().view(torch.uint8)  # byte k of word w = tokens 32w+8k .. 32w+8k+7
    return _BYTE_PENALTY[b.int()].view(rows, -1)[:, :vocab]


# row i: the additive mask of the 8 tokens that byte value i encodes (bit j set: token j allowed)
_BYTE_PENALTY = torch.tensor([[0.0 if (i >> j) & 1 else float("-inf") for j in range(8)] for i in range(256)])


def apply_grammar_masks(logits: torch.Tensor, requests: Sequence[Any], rows: Sequence[int]) -> torch.Tensor:
    """Set to -inf the logits of tokens the grammar of ``requests[i]`` forbids, for each
    ``i`` in ``rows`` (``logits`` fp32 ``[len(requests), vocab]``, changed in place and
    returned): one bitmask fill per row, one masked fill for all of them."""
    vocab = logits.shape[1]
    bitmask = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)
    for j, i in enumerate(rows):
        state_of(requests[i]).fill(bitmask, j)
    penalty = unpack_bitmask(bitmask, vocab)  # 0 allowed, -inf forbidden
    if len(rows) == logits.shape[0]:
        logits.add_(penalty)
    else:
        idx = torch.tensor(list(rows), dtype=torch.long)
        logits.index_add_(0, idx, penalty)
    return logits
