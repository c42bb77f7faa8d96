"""The JSON the ``/ui`` page polls: every physical block and every live request.

Shape (``GET /ui/state``)::

    {"time": epoch seconds, "step": engine-loop steps so far, "paused": bool,
     "num_blocks", "block_size", "num_used_blocks", "num_free_blocks", "usage" (0-1),
     "kv_cache_dtype" (e.g. "float32", "int8"), "kv_quant_group_size" (int8/fp8, else null),
     "kv_bytes_per_token" (all layers, scales included),
     "blocks": {"ref_cnt": [per block id], "cached": [0/1 per block id],
                "owners": {block_id: [sequence ids holding it in their block table]}},
     "requests": [{"request_id", "parent_id", "index", "status", "prompt_tokens",
                   "output_tokens", "num_tokens", "num_computed_tokens", "block_table"}],
     "stats": engine.get_stats()}

A block is *in use* when ``ref_cnt > 0`` (a block table or a step fence holds it), *shared*
when ``ref_cnt > 1``, *cached-but-free* when ``ref_cnt == 0`` and it carries a prefix hash.
The snapshot is ``LLMEngine.snapshot()``, taken under the engine's lock, so it is consistent
with one point between (or inside the unlocked forward of) a step.
"""

from __future__ import annotations

import time
from typing import Any, Optional


OTHER = "other"  # an owner that belongs to another tenant


def kv_view(engine: Any, loop: Optional[Any] = None, viewer: Optional[str] = None) -> dict[str, Any]:
    """Snapshot of the engine's KV cache and requests (see the module docstring).
    ``viewer``: the calling tenant; when given, requests of other tenants are left out of
    ``requests`` and appear as ``"other"`` among block owners (the occupancy stays visible,
    the ids do not)."""
    view = engine.snapshot()
    snap, stats = view["kv"], view["stats"]
    kv = engine.kv_summary()
    requests = []
    for r in view["requests"]:
        if viewer is not None and not _mine(loop, r["request_id"], viewer):
            continue
        table = snap["tables"].get(r["request_id"])
        requests.append({**r, "block_table": list(table["block_ids"]) if table else []})
    blocks = snap["blocks"]
    owners = {str(b["block_id"]): list(b["owners"]) for b in blocks if b["owners"]}
    if viewer is not None:
        owners = {k: [o if _mine(loop, o, viewer) else OTHER for o in v] for k, v in owners.items()}
    return {
        "time": time.time(),
        "step": getattr(loop, "num_steps", 0) if loop is not None else 0,
        "paused": bool(getattr(loop, "paused", False)),
        "num_blocks": snap["num_blocks"],
        "block_size": snap["block_size"],
        "num_used_blocks": snap["num_blocks"] - snap["num_free_blocks"],
        "num_free_blocks": snap["num_free_blocks"],
        "usage": snap["usage"],
        "kv_cache_dtype": kv["kv_cache_dtype"],
        "kv_quant_group_size": kv["kv_quant_group_size"],
        "kv_bytes_per_token": kv["bytes_per_token"],
        "blocks": {
            "ref_cnt": [b["ref_cnt"] for b in blocks],
            "cached": [1 if b["is_cached"] else 0 for b in blocks],
            "owners": owners,
        },
        "requests": requests,
        "stats": stats.as_dict(),
    }


def _mine(loop: Optional[Any], request_id: str, viewer: str) -> bool:
    return loop is not None and loop.tenant_of(request_id) == viewer
