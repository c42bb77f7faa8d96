"""Prompt-lookup (n-gram) proposals (``speculative="ngram"``).

A decoding request whose recent tokens occurred earlier in its own context (prompt +
output) gets up to ``k`` draft tokens: the tokens that followed the most recent earlier
occurrence of its last ``n`` tokens (``n`` from ``ngram_max`` down to ``ngram_min``). No
model runs and no state is kept; verification is ``pagedkv.engine.spec_decode``'s. Source:
prompt lookup decoding (Saxena 2023), vLLM's ``NgramProposer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.worker.proposer import DraftRequest, Proposer


@dataclass(frozen=True)
class NgramProposer(Proposer):
    """Prompt-lookup proposals: up to ``k`` draft tokens (``1 <= ngram_min <= ngram_max``).
    Raises ``ConfigError`` for a non-positive or non-int option, ``ngram_min > ngram_max``."""

    k: int = 4
    ngram_min: int = 2
    ngram_max: int = 3

    def __post_init__(self) -> None:
        for name in ("k", "ngram_min", "ngram_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{'num_speculative_tokens' if name == 'k' else name} must be a positive integer, got {v!r}")
        if self.ngram_min > self.ngram_max:
            raise ConfigError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")

    @classmethod
    def check_config(cls, config: Any, argument: Optional[str]) -> None:
        if argument is not None:
            raise ConfigError(f"speculative: 'ngram' takes no argument, got {config.speculative!r}")
        cls(config.num_speculative_tokens, config.ngram_min, config.ngram_max)

    @classmethod
    def from_config(cls, config: Any, argument: Optional[str], target: Any, target_name: str) -> "NgramProposer":
        return cls(config.num_speculative_tokens, config.ngram_min, config.ngram_max)

    def propose(self, rows: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """``{request id: lookup(token_ids, max_drafts)}`` per row (stateless)."""
        return {r[0]: self.lookup(r[1], r[2]) for r in rows}

    def lookup(self, token_ids: Sequence[int], max_tokens: Optional[int] = None) -> list[int]:
        """Draft tokens for a context ``token_ids``: for ``n`` from ``ngram_max`` down to
        ``ngram_min``, find the most recent earlier occurrence of the last ``n`` tokens and
        return up to ``min(k, max_tokens)`` tokens that followed it (``[]`` if none)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        size = len(token_ids)
        if k <= 0 or size < 2:
            return []
        toks = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            # windows starting at 0 .. size - n - 1 (not the suffix itself)
            win = np.lib.stride_tricks.sliding_window_view(toks[:-1], n)
            hits = np.flatnonzero((win == toks[size - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return toks[start:start + k].tolist()
        return []
