"""EngineStats: one typed snapshot of the engine's counters, read by metrics, /ui and benchmarks.

Units: requests and sequences are counts; blocks are KV blocks of ``block_size`` tokens;
tokens are tokens. Counters (``num_*`` without "running"/"waiting"/"free"/"used"/"shared")
grow from engine start; ``peak_*`` are maxima since start.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
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

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready), keys = field names."""
        return asdict(self)
