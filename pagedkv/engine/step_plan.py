"""The scheduler's data: its limits (:class:`SchedulerConfig`), its counters
(:class:`SchedulerStats`) and one step's plan (:class:`SchedulerOutput`, as
``Scheduler.schedule`` returns it: which sequences compute how many new tokens, with which
block tables, block copies and speculative drafts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedkv.engine.request import Request
from pagedkv.errors import PagedKVError


class SchedulerStallError(PagedKVError, RuntimeError):
    """A step could schedule nothing while requests are unfinished and no block is held
    behind a step fence: the engine would spin forever (a scheduler bug)."""


@dataclass
class SchedulerConfig:
    """Limits of one step and the KV pool the scheduler owns. Units: tokens, sequences,
    blocks, fraction of blocks (validated by ``EngineConfig``)."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    policy: str = "fcfs"  # "fcfs" | "priority"
    watermark: float = 0.01  # admit new requests only while this fraction of blocks stays free
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    enable_paging: bool = True
    shuffle_seed: Optional[int] = None  # randomise the physical block order (tests)
    kv_tiers: Any = None  # pagedkv.kv.tiers.KVTiers: host/disk tiers and KV events (None: off)
    # per layer: None (full attention) or its sliding window in tokens; None: all full
    layer_windows: Optional[list] = None
    # speculative decoding: the most draft tokens a decode row verifies (0: off); the drafts
    # come from the worker's proposer (pagedkv.worker.proposer) on the requests
    num_speculative_tokens: int = 0
    # the proposer writes K/V into the target's blocks (a draft model): reserve its lookahead
    # slots after each step (spec_decode.reserve_draft_slots)
    draft_kv: bool = False


@dataclass
class SchedulerStats:
    """Counters since start (tokens, steps, sequences, blocks)."""

    num_preemptions: int = 0
    num_steps: int = 0
    num_batched_tokens_total: int = 0
    peak_running: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_finished_requests: int = 0
    peak_used_blocks: int = 0  # max blocks in use right after a step's allocation
    peak_shared_blocks: int = 0  # max blocks held by more than one table (end of a step)
    num_spec_rows: int = 0  # decode rows verified with draft tokens
    num_draft_tokens: int = 0  # draft tokens proposed in them
    num_accepted_tokens: int = 0  # of those, accepted (each row also keeps one sampled token)
    # structured-output sequences ended by a run-time grammar failure, by reason
    # (pagedkv.engine.structured.FAILURE_REASONS)
    grammar_failures: dict = field(default_factory=dict)


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
    # speculative decode rows: request id -> its draft tokens (the row computes its last
    # token and these; see pagedkv.engine.spec_decode)
    drafts: dict = field(default_factory=dict)

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
            d = self.drafts.get(r.request_id)
            toks.append(r.all_token_ids[start : start + n] if d is None else r.all_token_ids[start:start + 1] + d)
            starts.append(start)
            sample.append(start + n == r.num_tokens or d is not None)
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

    def extra_rows(self, prompt_rows: list[int]) -> list[int]:
        """The runner's extra logits rows per scheduled sequence: ``prompt_rows``, and for a
        speculative row the logits of its first ``len(drafts)`` positions."""
        return [len(self.drafts[r.request_id]) if r.request_id in self.drafts else p
                for (r, _), p in zip(self.scheduled, prompt_rows)]

    def sampling_requests(self) -> list[Request]:
        """The sequences whose logits rows the step returns, in row order."""
        return [r for r, n in self.scheduled if r.num_computed_tokens + n == r.num_tokens or r.request_id in self.drafts]


def unschedule(req: Request, scheduled: list[tuple[Request, int]], copies: list[tuple[int, int]],
              drafts: dict[str, list[int]], step_copies: dict[str, list[tuple[int, int]]]) -> int:
    """Take ``req`` out of this step before it runs (it is being preempted): its entry,
    its copy-on-write copies (their destination blocks are freed with its table) and its
    drafts. Returns the tokens it had taken from the budget."""
    k = next(k for k, (r, _) in enumerate(scheduled) if r is req)
    _, n = scheduled.pop(k)
    mine = step_copies.pop(req.request_id, [])
    if mine:
        drop = set(mine)
        copies[:] = [c for c in copies if c not in drop]
        req.num_cow_copies -= len(mine)
    drafts.pop(req.request_id, None)
    return n
