"""Wires the engine's optional features to the engine core's seams.

The engine core (``pagedkv.engine.engine``) imports no feature module: the features it can
run with are built here, from an ``EngineConfig``, and handed to it as plain collaborators:

* speculative decoding (``pagedkv.engine.spec_decode`` / ``spec_draft``): the scheduler's
  proposer (n-gram or a draft model) and, for a draft model, a :class:`StepHook` that
  batches its proposals before ``schedule()`` and frees the draft blocks of requests that
  left the running list;
* structured outputs (``pagedkv.engine.structured``): the grammar compiler the input
  processor compiles a request's spec with (a bad schema is refused at ``add_request``).

A :class:`StepHook` is the core's one kind of step participant: the core calls every hook's
:meth:`StepHook.before_schedule` before each ``schedule()`` and :meth:`StepHook.retain`
after each step's decisions and after an abort, whatever the hook does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pagedkv.engine.request import Request
from pagedkv.engine.spec_decode import draft_model_name, make_proposer
from pagedkv.engine.spec_draft import DraftProposer
from pagedkv.engine.structured import GrammarCompiler
from pagedkv.utils import profile_scope


class StepHook:
    """A step participant (no-op by default): ``running`` is the scheduler's running list
    (read only)."""

    def before_schedule(self, running: Sequence[Request]) -> None:
        """Called under the engine lock before every ``Scheduler.schedule()``."""

    def retain(self, running: Sequence[Request]) -> None:
        """Called after a step's decisions are applied and after an abort: forget the state
        of requests no longer in ``running``."""


class DraftModelHook(StepHook):
    """A draft model's seam: batched proposals for the running rows before ``schedule()``
    (``DraftProposer.prefetch``: ``max_model_len`` tokens, at most ``budget`` tokens per
    forward), and the draft blocks of requests that stopped running freed."""

    def __init__(self, draft: DraftProposer, max_model_len: int, budget: Optional[int]) -> None:
        self.draft = draft
        self.max_model_len = max_model_len
        self.budget = budget

    def before_schedule(self, running: Sequence[Request]) -> None:
        with profile_scope("pagedkv.draft"):
            self.draft.prefetch(running, self.max_model_len, self.budget)

    def retain(self, running: Sequence[Request]) -> None:
        self.draft.retain(r.request_id for r in running)


@dataclass
class Speculation:
    """Speculative decoding as configured: ``proposer`` for ``SchedulerConfig.speculative``
    (an ``NgramProposer``, the ``DraftProposer`` or ``None``), ``draft`` (the draft model's
    proposer, or ``None``) and the step ``hooks`` it needs."""

    proposer: Any = None
    draft: Optional[DraftProposer] = None
    hooks: list[StepHook] = field(default_factory=list)


def load_speculation(config: Any, target: Any, num_blocks: int, target_name: str, max_model_len: int) -> Speculation:
    """Speculation for ``config`` (an ``EngineConfig``: ``speculative`` None, ``"ngram"`` or
    ``"draft:<model>"``); a draft model is loaded (its own worker and pool of ``num_blocks``
    blocks) and checked against ``target`` (the target's ``LoadedModel``, named
    ``target_name``). Raises ``ConfigError`` (see ``make_proposer`` and
    ``DraftProposer.load``)."""
    name = draft_model_name(config.speculative)
    if name is None:
        return Speculation(proposer=make_proposer(config))
    draft = DraftProposer.load(name, config, target, num_blocks, target_name)
    return Speculation(proposer=draft, draft=draft,
                       hooks=[DraftModelHook(draft, max_model_len, config.max_num_batched_tokens)])


def make_grammar_compiler(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler:
    """The structured-output grammar compiler of a model (its ``tokenizer``, ``vocab_size``
    logits and EOS ids)."""
    return GrammarCompiler(tokenizer, vocab_size, tuple(eos_token_ids))
