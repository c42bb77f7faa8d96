"""Wires the engine's optional features to the engine core's seams.

The engine core (``pagedkv.engine.engine``) imports no feature module: the features it can
run with are built here, from an ``EngineConfig``, and handed to it as plain collaborators:

* speculative decoding: the proposer (``pagedkv.worker.proposer``: n-gram prompt lookup or a
  draft model whose K/V lives in the target's blocks), which the engine hands to its
  executor; the worker runs it after each step's forward and sampling, and the scheduler
  only reserves lookahead slots (``pagedkv.engine.spec_decode``);
* structured outputs (``pagedkv.engine.structured``): the grammar compiler the input
  processor compiles a request's spec with (a bad schema is refused at ``add_request``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pagedkv.engine.structured import GrammarCompiler
from pagedkv.worker.proposer import Proposer, build_proposer


def make_proposer(config: Any, target: Any, target_name: str) -> Optional[Proposer]:
    """The speculative proposer of ``config`` (an ``EngineConfig``: ``speculative`` None, a
    name registered in ``pagedkv.worker.proposer.PROPOSERS`` such as ``"ngram"`` or
    ``"draft:<model>"``), ``None`` when off; a draft model is loaded (its own worker; its
    caches come once the pool is sized, ``Proposer.init_cache``) and checked against
    ``target`` (the target's ``LoadedModel``, named ``target_name``). Raises ``ConfigError``
    (``build_proposer``)."""
    return build_proposer(config, target, target_name)


def make_grammar_compiler(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler:
    """The structured-output grammar compiler of a model (its ``tokenizer``, ``vocab_size``
    logits and EOS ids)."""
    return GrammarCompiler(tokenizer, vocab_size, tuple(eos_token_ids))
