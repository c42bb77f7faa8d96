"""EngineStats: one typed snapshot of the engine's counters, read by metrics, /ui and benchmarks.

Units: requests and sequences are counts; blocks are KV blocks of ``block_size`` tokens;
tokens are tokens. Counters (``num_*`` without "running"/"waiting"/"free"/"used"/"shared")
grow from engine start; ``peak_*`` are maxima since start.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # sequences running now
    num_waiting: int  # sequences waiting (new or preempted)
    num_blocks: int  # KV blocks in the pool
    num_used_blocks: int  # blocks referenced now (tables and step-fence holds)
    num_free_blocks: int  # blocks in the free queue (incl. cached-but-free)
    kv_usage: float  # num_used_blocks / num_blocks
    num_preemptions: int
    num_steps: int
    num_batched_tokens: int  # tokens run through the model (prefill chunks + decodes, recomputes too)
    peak_running: int
    num_generated_tokens: int
    num_prompt_tokens: int
    num_finished_requests: int
    num_shared_blocks: int  # blocks with ref_cnt > 1 now
    peak_shared_blocks: int
    peak_used_blocks: int  # max blocks in use right after a step's allocation
    kv_prefix_queries: int  # prompt tokens looked up in the prefix cache
    kv_prefix_hits: int  # prompt tokens served from it
    kv_prefix_hit_rate: float
    kv_cow_copies: int
    kv_evictions: int
    kv_allocated_blocks: int
    kv_deferred_frees: int
    # tiers behind the pool (kv_offload; {} when off): {"tiers": {name: {blocks,
    # capacity_blocks, stored_blocks, removed_blocks, hit_blocks, hit_tokens, failed_blocks}},
    # "transfer": {"blocks"/"bytes": {direction: n}, "seconds": {export, import, disk_read,
    # disk_write, recompute}}}; prompt tokens served by the pool itself: kv_pool_hit_tokens
    kv_tiers: dict = field(default_factory=dict)
    kv_pool_hit_tokens: int = 0
    # speculative decoding (pagedkv.engine.spec_decode): decode rows verified with drafts, the
    # drafts proposed and accepted; acceptance rate = accepted / drafts, mean accepted length =
    # tokens a verified row kept (accepted drafts + its sampled token) / rows
    num_spec_rows: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # structured-output sequences ended by a run-time grammar failure: {reason: count}
    # (reasons: pagedkv.engine.structured.FAILURE_REASONS)
    grammar_failures: dict = field(default_factory=dict)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        return (self.num_accepted_tokens + self.num_spec_rows) / self.num_spec_rows if self.num_spec_rows else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready), keys = field names."""
        return asdict(self)


def collect_stats(kv: Any, st: Any, num_running: int, num_waiting: int) -> EngineStats:
    """The engine's :class:`EngineStats` from the KV manager ``kv``, the step counters ``st``
    (``SchedulerStats``) and the sequences running and waiting now."""
    kvs = kv.stats
    tiers = kv.tier_stats()
    return EngineStats(
        num_running=num_running,
        num_waiting=num_waiting,
        num_blocks=kv.num_blocks,
        num_used_blocks=kv.num_used_blocks,
        num_free_blocks=kv.num_free_blocks,
        kv_usage=kv.usage,
        num_preemptions=st.num_preemptions,
        num_steps=st.num_steps,
        num_batched_tokens=st.num_batched_tokens_total,
        peak_running=st.peak_running,
        num_generated_tokens=st.num_generated_tokens,
        num_prompt_tokens=st.num_prompt_tokens,
        num_finished_requests=st.num_finished_requests,
        num_shared_blocks=kv.pool.num_shared,
        peak_shared_blocks=st.peak_shared_blocks,
        peak_used_blocks=st.peak_used_blocks,
        kv_prefix_queries=kvs.prefix_queries,
        kv_prefix_hits=kvs.prefix_hits,
        kv_prefix_hit_rate=kvs.prefix_hit_rate,
        kv_cow_copies=kvs.cow_copies,
        kv_evictions=kvs.evictions,
        kv_allocated_blocks=kvs.allocated_blocks,
        kv_deferred_frees=kvs.deferred_frees,
        kv_tiers=tiers,
        kv_pool_hit_tokens=kvs.prefix_hits - sum(t["hit_tokens"] for t in tiers.get("tiers", {}).values()),
        num_spec_rows=st.num_spec_rows,
        num_draft_tokens=st.num_draft_tokens,
        num_accepted_tokens=st.num_accepted_tokens,
        grammar_failures=dict(st.grammar_failures),
    )
