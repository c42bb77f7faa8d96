"""The speculative-decoding proposer interface and its registry (vLLM v1's shape).

A proposer runs on the worker side, *after* a step's target forward and sampling: the engine
core hands the executor one :class:`DraftRequest` per running request (its whole context and
the most drafts it may take next step, 0 for a request that does not speculate now) and gets
back ``{request id: draft token ids}``. The drafts ride on the request to the next step, where
the scheduler only reserves their lookahead slots and the target verifies them
(``pagedkv.engine.spec_decode``). The scheduler never calls a proposer and never runs a model.

Lifecycle: :meth:`Proposer.propose` forgets the per-request state of every request missing
from its rows (finished or preempted since the last step); :meth:`Proposer.release` forgets
one request at once (an abort). A proposer with device state (the draft model's own paged KV)
owns it; nothing else changes it.

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
    (0: it does not speculate now; its state is kept)."""

    request_id: str
    token_ids: Sequence[int]
    max_drafts: int


class Proposer:
    """A source of draft tokens (see the module doc). ``k``: the most drafts per request."""

    k: int = 0

    @classmethod
    def from_config(cls, config: Any, argument: Optional[str], target: Any, num_blocks: int,
                    target_name: str) -> "Proposer":
        """Build it for ``config`` (an ``EngineConfig``), ``argument`` the text after
        ``"<name>:"`` (``None`` without one), ``target`` the target's ``LoadedModel`` named
        ``target_name``, ``num_blocks`` the target's KV pool size. Raises ``ConfigError``."""
        raise NotImplementedError

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


def build_proposer(config: Any, target: Any, num_blocks: int, target_name: str) -> Optional[Proposer]:
    """The proposer ``config.speculative`` names (``None`` when off), built by its class's
    ``from_config`` (a draft model is loaded and checked against ``target``). Raises
    ``ConfigError``."""
    if config.speculative is None:
        return None
    cls, arg = parse_speculative(config.speculative)
    cls.check_config(config, arg)
    return cls.from_config(config, arg, target, num_blocks, target_name)
