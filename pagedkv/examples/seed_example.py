"""The seed's worked example (§03, §07), as data + text: ``pagedkv example``.

``worked_example`` runs real ``KVCacheManager``s (paged, and contiguous max reservation) on
the given request lengths and returns a JSON-able dict; ``format_example`` renders it for the
terminal (``pagedkv.examples.cli``). The capacity plan (``pagedkv plan``) is
``pagedkv.examples.capacity_plan``.
"""

from __future__ import annotations

import string
from typing import Any, Sequence

from pagedkv.errors import ConfigError
from pagedkv.kv.block_table import blocks_needed
from pagedkv.kv.manager import KVCacheManager

#: Shuffle seed of the example's free queue: with lengths 17,33,8, max_len 64 and
#: block_size 16 (a 12-block pool) it reproduces the seed §03 mapping exactly:
#: A 0->7, 1->2 · B 0->4, 1->9, 2->1 · C 0->5.
EXAMPLE_SHUFFLE_SEED = 449983

#: Bytes of one device block-table entry (int32, see pagedkv.attention.base).
TABLE_ENTRY_BYTES = 4


def _names(n: int) -> list[str]:
    letters = string.ascii_uppercase
    return [letters[i] if i < 26 else f"R{i}" for i in range(n)]


def _check_lengths(lengths: Sequence[int], max_len: int) -> None:
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ConfigError(f"max_len must be a positive integer, got {max_len!r}")
    if not lengths:
        raise ConfigError("lengths: give at least one request length")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"lengths: each length must be an integer >= 0, got {n!r}")
        if n > max_len:
            raise ConfigError(f"lengths: {n} exceeds max_len {max_len}")


def worked_example(
    lengths: Sequence[int] = (17, 33, 8),
    max_len: int = 64,
    block_size: int = 16,
    shuffle_seed: int | None = EXAMPLE_SHUFFLE_SEED,
) -> dict[str, Any]:
    """Seed §03 for one block size. The pool holds ``len(lengths) * ceil(max_len/bs)``
    blocks (what contiguous max reservation needs). Returns
    ``{"block_size", "num_blocks", "requests": [{"name", "length", "block_ids"}],
    "paged": {"blocks", "slots", "valid_tokens", "free_slots", "table_entries",
    "metadata_bytes"}, "contiguous": {"blocks", "slots", "free_slots"}, "growth": [...],
    "free_last": {...}, "seed07": {...}}``. ``metadata_bytes`` is the int32 device block
    table ``[num_requests, ceil(max_len/bs)]``. Raises ``ConfigError`` on bad input."""
    _check_lengths(lengths, max_len)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
    names = _names(len(lengths))
    per_req = blocks_needed(max_len, block_size)
    num_blocks = len(lengths) * per_req
    valid = int(sum(lengths))

    # Paged: each request grows to its length; record whether its last token took a block.
    mgr = KVCacheManager(num_blocks, block_size, shuffle_seed=shuffle_seed)
    growth = []
    for name, n in zip(names, lengths):
        if n == 0:
            continue
        mgr.allocate_slots(name, n - 1, 0)
        before = len(mgr.get_block_ids(name))
        mgr.allocate_slots(name, 1, n - 1)
        ids = mgr.get_block_ids(name)
        growth.append({"request": name, "from": n - 1, "to": n, "new_blocks": len(ids) - before,
                       "new_block_ids": ids[before:]})
    requests = [{"name": nm, "length": n, "block_ids": mgr.get_block_ids(nm)}
                for nm, n in zip(names, lengths)]
    blocks = mgr.num_used_blocks
    paged = {
        "blocks": blocks,
        "slots": blocks * block_size,
        "valid_tokens": valid,
        "free_slots": blocks * block_size - valid,
        "table_entries": blocks,
        "metadata_bytes": len(lengths) * per_req * TABLE_ENTRY_BYTES,
    }

    # Contiguous max reservation: the same requests through a non-paging manager.
    cont = KVCacheManager(num_blocks, block_size, enable_paging=False, max_model_len=max_len,
                          shuffle_seed=shuffle_seed)
    for name, n in zip(names, lengths):
        cont.allocate_slots(name, n, 0)
    contiguous = {"blocks": cont.num_used_blocks, "slots": cont.num_used_blocks * block_size,
                  "free_slots": cont.num_used_blocks * block_size - valid}

    # The first request grows by one more token (seed: A 17 -> 18).
    first, n0 = names[0], lengths[0]
    extra_growth = None
    if n0 < max_len:
        before = len(mgr.get_block_ids(first))
        mgr.allocate_slots(first, 1, n0)
        extra_growth = {"request": first, "from": n0, "to": n0 + 1,
                        "new_blocks": len(mgr.get_block_ids(first)) - before}

    # The last request finishes: its blocks return to the free queue.
    last = names[-1]
    last_ids = mgr.get_block_ids(last)
    mgr.free(last)
    queue = mgr.pool.free_queue.ids()
    free_last = {"request": last, "block_ids": last_ids,
                 "returned": all(i in queue for i in last_ids), "num_free_blocks": mgr.num_free_blocks}

    # Seed §07: free all of the second request's blocks, allocate a new request, and check
    # that nothing the first request still references is handed out.
    seed07 = None
    if len(names) >= 2:
        victim = names[1]
        a_ids = mgr.get_block_ids(first)
        a_refs = [mgr.pool.blocks[i].ref_cnt for i in a_ids]
        freed = mgr.get_block_ids(victim)
        mgr.free(victim)
        new_len = max(1, min(max_len, mgr.num_free_blocks * block_size))
        mgr.allocate_slots("new", new_len, 0)
        new_ids = mgr.get_block_ids("new")
        seed07 = {
            "freed_request": victim, "freed_block_ids": freed,
            "new_request_tokens": new_len, "new_block_ids": new_ids,
            "kept_request": first, "kept_block_ids": a_ids,
            "overlap": sorted(set(new_ids) & set(a_ids)),
            "kept_table_unchanged": mgr.get_block_ids(first) == a_ids,
            "kept_ref_cnts_unchanged": [mgr.pool.blocks[i].ref_cnt for i in a_ids] == a_refs,
        }
    mgr.check_invariants()
    return {
        "block_size": block_size, "num_blocks": num_blocks, "max_len": max_len,
        "lengths": list(lengths), "shuffle_seed": shuffle_seed,
        "requests": requests, "paged": paged, "contiguous": contiguous,
        "growth": growth, "extra_growth": extra_growth, "free_last": free_last, "seed07": seed07,
    }


def format_example(results: list[dict[str, Any]]) -> str:
    """Text for ``pagedkv example``: per block size the tables, then a comparison."""
    out: list[str] = []
    r0 = results[0]
    lens = " ".join(f"{q['name']}={q['length']}" for q in r0["requests"])
    out.append(f"Seed §03 worked example: {lens}, max reservation {r0['max_len']} tokens per request")
    for r in results:
        bs = r["block_size"]
        out.append("")
        out.append(f"block_size {bs}: pool of {r['num_blocks']} blocks, physical ids shuffled "
                   f"(seed {r['shuffle_seed']})")
        for q in r["requests"]:
            used = [min(bs, q["length"] - i * bs) for i in range(len(q["block_ids"]))]
            cells = "  ".join(f"{i}->{b} ({u})" for i, (b, u) in enumerate(zip(q["block_ids"], used)))
            out.append(f"  {q['name']}/{q['length']:<4} {cells}")
        p, c = r["paged"], r["contiguous"]
        out.append(f"  {'':16}{'paged':>8}{'contiguous':>12}")
        out.append(f"  {'blocks':16}{p['blocks']:>8}{c['blocks']:>12}")
        out.append(f"  {'slots':16}{p['slots']:>8}{c['slots']:>12}")
        out.append(f"  {'valid tokens':16}{p['valid_tokens']:>8}{p['valid_tokens']:>12}")
        out.append(f"  {'free slots':16}{p['free_slots']:>8}{c['free_slots']:>12}")
        out.append(f"  {'metadata bytes':16}{p['metadata_bytes']:>8}{'-':>12}")
        grown = [f"{g['request']} {g['from']}->{g['to']}: +{g['new_blocks']} block"
                 + (f" ({g['new_block_ids'][0]})" if g["new_blocks"] else "") for g in r["growth"]]
        eg = r["extra_growth"]
        if eg:
            grown.append(f"{eg['request']} {eg['from']}->{eg['to']}: +{eg['new_blocks']} block")
        out.append("  growth: " + "; ".join(grown))
        fl = r["free_last"]
        out.append(f"  {fl['request']} finishes: blocks {fl['block_ids']} return to the pool "
                   f"({'yes' if fl['returned'] else 'NO'}; {fl['num_free_blocks']} free)")
        s7 = r["seed07"]
        if s7:
            out.append(
                f"  §07: free all of {s7['freed_request']}'s blocks {s7['freed_block_ids']}; a new "
                f"request ({s7['new_request_tokens']} tokens) gets {s7['new_block_ids']}; "
                f"{s7['kept_request']}'s blocks {s7['kept_block_ids']} handed out: "
                f"{s7['overlap'] or 'none'}; its table and ref counts unchanged: "
                f"{'yes' if s7['kept_table_unchanged'] and s7['kept_ref_cnts_unchanged'] else 'NO'}"
            )
    if len(results) > 1:
        out.append("")
        out.append("Seed §07 comparison (internal free space vs block-table metadata):")
        out.append(f"  {'block_size':>10} {'blocks':>7} {'slots':>6} {'valid':>6} {'free paged':>11} "
                   f"{'free contig':>12} {'table entries':>14} {'metadata B':>11}")
        for r in results:
            p, c = r["paged"], r["contiguous"]
            out.append(f"  {r['block_size']:>10} {p['blocks']:>7} {p['slots']:>6} {p['valid_tokens']:>6} "
                       f"{p['free_slots']:>11} {c['free_slots']:>12} {p['table_entries']:>14} "
                       f"{p['metadata_bytes']:>11}")
        out.append("  Smaller blocks waste fewer slots but need more table entries, more "
                   "lookups per token and more scattered reads.")
    out.append("  (metadata bytes: int32 device block table [requests, ceil(max_len/block_size)])")
    return "\n".join(out)


def example_json(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``--json`` shape: per block size ``{"block_size", "paged": {...},
    "contiguous": {"slots", "free_slots"}}`` plus the block tables."""
    return [
        {
            "block_size": r["block_size"],
            "paged": {k: r["paged"][k] for k in ("blocks", "slots", "valid_tokens", "free_slots", "metadata_bytes")},
            "contiguous": {k: r["contiguous"][k] for k in ("slots", "free_slots")},
            "tables": {q["name"]: q["block_ids"] for q in r["requests"]},
        }
        for r in results
    ]
