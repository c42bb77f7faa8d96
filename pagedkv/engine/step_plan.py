"""One step's plan (:class:`SchedulerOutput`), as ``Scheduler.schedule`` returns it: which
sequences compute how many new tokens, with which block tables and block copies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.request import Request


@dataclass
class SchedulerOutput:
    """One step's plan: which requests compute how many new tokens."""

    scheduled: list[tuple[Request, int]]  # (request, num_new_tokens), running first
    copies: list[tuple[int, int]]  # copy-on-write block copies (src, dst) to apply first
    preempted: list[Request]
    step_id: int
    num_batched_tokens: int = 0
    # per scheduled, its block table (with several layer groups: one table per group)
    block_ids: list = field(default_factory=list)
    kv_transfer: Any = None  # pagedkv.kv.tiers.KVTransfer: tier stores/loads to run first

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def model_inputs(self) -> tuple[list[list[int]], list[int], list[list[int]], list[bool]]:
        """The runner's arguments ``(token_ids, num_computed, block_ids, sample)``: each
        scheduled sequence's new tokens, its computed-token count, its block table, and
        whether this step completes its known tokens (its logits are sampled)."""
        toks, starts, sample = [], [], []
        for r, n in self.scheduled:
            start = r.num_computed_tokens
            toks.append(r.all_token_ids[start : start + n])
            starts.append(start)
            sample.append(start + n == r.num_tokens)
        return toks, starts, self.block_ids, sample

    def prompt_rows(self) -> list[int]:
        """Per scheduled sequence, how many of its first new tokens' logits give prompt
        logprobs (``SamplingParams.prompt_logprobs``): the prompt positions before the last
        (position j's logits score prompt token j + 1); 0 for the others."""
        rows = []
        for r, n in self.scheduled:
            start = r.num_computed_tokens
            want = r.sampling_params.prompt_logprobs is not None
            rows.append(max(0, min(start + n, r.num_prompt_tokens - 1) - start) if want else 0)
        return rows

    def sampling_requests(self) -> list[Request]:
        """The sequences whose logits rows the step returns, in row order."""
        return [r for r, n in self.scheduled if r.num_computed_tokens + n == r.num_tokens]
