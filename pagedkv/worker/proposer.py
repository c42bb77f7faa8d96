"""The speculative-decoding proposer interface and its registry (vLLM v1's shape).

A proposer runs on the worker side, *after* a step's target forward and sampling: the engine
core hands the executor one :class:`DraftRequest` per running request (its whole context and
the most drafts it may take next step, 0 for a request that does not speculate now) and gets
back ``{request id: draft token ids}``. The drafts ride on the request to the next step, where
the scheduler only reserves their lookahead slots and the target verifies them
(``pagedkv.engine.spec_decode``). The scheduler never calls a proposer and never runs a model.

Lifecycle: :meth:`Proposer.propose` forgets the per-request state of every request missing
from its rows (finished or preempted since the last step); :meth:`Proposer.release` forgets
one request at once (an abort).

**A proposer with its own K/V** (``writes_kv``: the draft model) keeps it in per-layer caches
of the target's ``num_blocks`` blocks, indexed by the *target's* block ids: a row carries the
request's block table (``block_ids``, the target's full-attention group), and the scheduler
reserves the row's lookahead slots in it before the proposer runs (``spec_decode.
reserve_draft_slots``), so the draft needs no block pool, no block table and no allocator of
its own. The engine sizes the pool with the proposer's bytes per block
(:meth:`Proposer.kv_bytes_per_block`) counted beside the target's, builds its caches
(:meth:`Proposer.init_cache`), and applies every copy-on-write copy to them as to the target's
(:meth:`Proposer.copy_blocks`).

**Registering a proposer** is one file and one line: a module in ``pagedkv/worker/`` with a
:class:`Proposer` subclass whose ``from_config`` builds it, and its ``"name":
"module:Class"`` entry in :data:`PROPOSERS` (``speculative="<name>"`` or
``"<name>:<argument>"`` then selects it).
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Optional, Sequence

from pagedkv.errors import ConfigError


class DraftRequest(NamedTuple):
    """One running request as a proposer sees it: ``token_ids`` its whole context (prompt
    and output token ids, ints), ``max_drafts`` the most draft tokens it may take next step
    (0: it does not speculate now; its state is kept), ``block_ids`` its block table in the
    target's pool (full-attention group; ``()`` for a proposer without K/V): slots exist for
    positions ``0 .. len(block_ids) * block_size - 1``, those past its context reserved for
    the drafts."""

    request_id: str
    token_ids: Sequence[int]
    max_drafts: int
    block_ids: Sequence[int] = ()


class Proposer:
    """A source of draft tokens (see the module doc). ``k``: the most drafts per request."""

    k: int = 0
    #: whether it writes K/V into its own caches at the target's slots (then the scheduler
    #: reserves each drafting row's lookahead slots before :meth:`propose`)
    writes_kv: bool = False

    @classmethod
    def from_config(cls, config: Any, argument: Optional[str], target: Any, target_name: str) -> "Proposer":
        """Build it for ``config`` (an ``EngineConfig``), ``argument`` the text after
        ``"<name>:"`` (``None`` without one), ``target`` the target's ``LoadedModel`` named
        ``target_name``. Its caches (if any) come later (:meth:`init_cache`). Raises
        ``ConfigError``."""
        raise NotImplementedError

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes its caches take per block id of the target's pool (0: no K/V)."""
        return 0

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        """Build its caches of ``num_blocks`` blocks of ``block_size`` tokens (the target's)."""

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Apply the target's copy-on-write copies (``src -> dst`` block ids) to its caches."""

    def close(self) -> None:
        """Stop what runs beside its caches (a draft model's cache prefault); idempotent."""

    @classmethod
    def check_config(cls, config: Any, argument: Optional[str]) -> None:
        """Validate ``config``'s options for this proposer without loading anything
        (``EngineConfig`` calls it); raises ``ConfigError``."""
        check_k(config.num_speculative_tokens)

    def propose(self, rows: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """``{request id: up to max_drafts draft token ids}`` for every row (``[]`` when it
        has none); the state of requests not in ``rows`` is forgotten."""
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        """Forget ``request_id``'s state now (unknown ids: no-op)."""


#: the proposers by name: "module:Class" (imported when chosen). A new proposer: one line here.
PROPOSERS = {
    "ngram": "pagedkv.worker.ngram_proposer:NgramProposer",
    "draft": "pagedkv.worker.draft_proposer:DraftModelProposer",
}


def check_k(k: Any) -> None:
    """Raise ``ConfigError`` unless ``k`` (``num_speculative_tokens``) is a positive int."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"num_speculative_tokens must be a positive integer, got {k!r}")


def parse_speculative(method: Any) -> tuple[type, Optional[str]]:
    """``(proposer class, argument)`` of ``speculative="<name>"`` / ``"<name>:<argument>"``.
    Raises ``ConfigError`` for an unknown name or a missing draft model."""
    name, sep, arg = method.partition(":") if isinstance(method, str) else ("", "", "")
    if name not in PROPOSERS:
        raise ConfigError(f"speculative: 'ngram' (prompt lookup) or 'draft:<model>' (a draft model), got {method!r}")
    if name == "draft" and not arg.strip():
        raise ConfigError("speculative: 'draft:<model>' needs a model path or a bundled name after 'draft:'")
    module, cls = PROPOSERS[name].split(":")
    return getattr(importlib.import_module(module), cls), (arg.strip() if sep else None)


def draft_model_name(method: Any) -> Optional[str]:
    """The ``<model>`` of ``speculative="draft:<model>"`` (a path or a bundled name), else
    ``None``; raises ``ConfigError`` for ``"draft:"`` without a model."""
    if not isinstance(method, str) or not method.startswith("draft:"):
        return None
    return parse_speculative(method)[1]


def check_speculative(config: Any) -> None:
    """Validate an ``EngineConfig``'s speculative options (``speculative`` None, a registered
    name, ``num_speculative_tokens``, the proposer's own) without loading a model; raises
    ``ConfigError``."""
    if config.speculative is not None:
        cls, arg = parse_speculative(config.speculative)
        cls.check_config(config, arg)


def build_proposer(config: Any, target: Any, target_name: str) -> Optional[Proposer]:
    """The proposer ``config.speculative`` names (``None`` when off), built by its class's
    ``from_config`` (a draft model is loaded and checked against ``target``; its caches are
    built later, ``Proposer.init_cache``). Raises ``ConfigError``."""
    if config.speculative is None:
        return None
    cls, arg = parse_speculative(config.speculative)
    cls.check_config(config, arg)
    return cls.from_config(config, arg, target, target_name)
