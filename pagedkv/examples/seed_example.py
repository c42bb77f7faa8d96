"""The seed's worked example (§03, §07) and capacity planning, as data + text.

``worked_example`` runs real ``KVCacheManager``s (paged, and contiguous max reservation) on
the given request lengths; ``plan`` sizes a KV budget for a model and optionally a trace.
Both return JSON-able dicts; ``format_*`` render them for the terminal (``pagedkv example``,
``pagedkv plan`` in ``pagedkv.kv.cli``).
"""

from __future__ import annotations

import itertools

import string
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import is_gguf_file, read_gguf_metadata
from pagedkv.kv.block_table import blocks_needed
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.spec import SCALED_DTYPES, KVCacheSpec, check_group_size, load_hf_config, parse_size
from pagedkv.utils import canonical_dtype
from pagedkv.utils import kv_cache_dtype as kv_cache_dtype_name

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


# ---------------------------------------------------------------------- plan
def load_spec(model: str | Path | None, dtype: str | None = None, tp_size: int = 1) -> tuple[KVCacheSpec, int | None, str]:
    """``(spec, max_position_embeddings or None, label)`` for a config.json (file or
    folder), a GGUF file, a shipped config name, or ``None`` (the bundled model's GGUF).
    Raises ``ConfigError``."""
    if model is None:
        from pagedkv._bundled import bundled_model_path

        model = bundled_model_path()
    path = Path(model)
    if path.is_file() and (path.suffix == ".gguf" or is_gguf_file(path)):
        meta = read_gguf_metadata(path)
        arch = meta.get("general.architecture")
        spec = KVCacheSpec.from_gguf(path, dtype=dtype or "fp32", tp_size=tp_size)
        return spec, meta.get(f"{arch}.context_length"), path.name
    cfg = load_hf_config(model)
    spec = KVCacheSpec.from_hf_config(cfg, dtype=dtype, tp_size=tp_size)
    return spec, cfg.get("max_position_embeddings"), str(model)


def load_workload(path: str | Path) -> np.ndarray:
    """Final request lengths (ContextTokens + GeneratedTokens, int64) of a trace CSV with
    columns ``TIMESTAMP,ContextTokens,GeneratedTokens``. Raises ``ConfigError``."""
    path = Path(path)
    try:
        header = path.open().readline().strip().split(",")
        cols = [header.index("ContextTokens"), header.index("GeneratedTokens")]
        data = np.loadtxt(path, delimiter=",", skiprows=1, usecols=cols, dtype=np.int64, ndmin=2)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"workload: cannot read {path} as TIMESTAMP,ContextTokens,GeneratedTokens ({exc})") from exc
    if data.size == 0:
        raise ConfigError(f"workload: {path} has no rows")
    if (data < 0).any():
        raise ConfigError(f"workload: {path} has negative token counts")
    return data.sum(axis=1)


def plan(
    model: str | Path | None = None,
    kv_budget: str | int = "20GiB",
    dtype: str | None = None,
    block_size: int = 16,
    tp_size: int = 1,
    max_model_len: int | None = None,
    workload: str | Path | None = None,
    kv_cache_dtype: str | None = None,
    quant_group_size: int | None = None,
) -> dict[str, Any]:
    """Capacity plan for a per-rank KV budget. Returns bytes/token (per rank and over all
    ranks), page and block bytes, blocks, tokens held, max concurrency at max_model_len,
    and with a workload trace: mean/percentile lengths, concurrency (``num_blocks / mean
    blocks per request``) and slot utilisation (valid tokens / reserved slots) for paged vs
    contiguous max reservation. Requests longer than max_model_len are clipped (counted).

    ``kv_cache_dtype`` takes the engine's names (``auto`` = the config's dtype, ``int8``,
    ``fp8_e4m3``, ...) and ``quant_group_size`` its group size (must divide head_dim), so the
    plan's blocks are the blocks the engine allocates; ``dtype`` is the older spelling (any
    ``KVCacheSpec`` dtype, int4 included). Raises ``ConfigError``."""
    if kv_cache_dtype is not None:
        name = kv_cache_dtype_name(kv_cache_dtype, "fp32")  # validates; auto -> the config's
        if dtype is not None and canonical_dtype(dtype) != canonical_dtype(name):
            raise ConfigError(f"dtype {dtype!r} and kv_cache_dtype {kv_cache_dtype!r} disagree: give one")
        dtype = None if str(kv_cache_dtype).strip().lower() == "auto" else name
    spec, max_pos, label = load_spec(model, dtype, tp_size)
    if quant_group_size is not None:
        if spec.dtype not in SCALED_DTYPES:
            raise ConfigError(f"quant_group_size applies to int8 / fp8 / int4 caches, not {spec.dtype}")
        spec = replace(spec, quant_group_size=check_group_size(quant_group_size, spec.head_dim))
    max_model_len = max_model_len or max_pos or 4096
    if not isinstance(max_model_len, int) or max_model_len < 1:
        raise ConfigError(f"max_model_len must be a positive integer, got {max_model_len!r}")
    budget = parse_size(kv_budget)
    num_blocks = spec.num_blocks(budget, block_size)
    per_req_max = spec.blocks_per_request(max_model_len, block_size)
    out: dict[str, Any] = {
        "model": label, "spec": spec.describe(), "kv_budget_bytes": budget,
        "block_size": block_size, "max_model_len": max_model_len,
        "bytes_per_token": spec.bytes_per_token,
        "bytes_per_token_total": spec.bytes_per_token_total,
        "page_size_bytes": spec.page_size_bytes(block_size),
        "block_bytes": spec.block_bytes(block_size),
        "num_blocks": num_blocks,
        "tokens_held": num_blocks * block_size,
        "max_concurrency_at_max_model_len": num_blocks // per_req_max,
    }
    if spec.layer_windows is not None:
        out["layer_groups"] = group_plan(spec, budget, block_size, max_model_len)
    if workload is not None:
        lengths = load_workload(workload)
        clipped = int((lengths > max_model_len).sum())
        lengths = np.minimum(lengths, max_model_len)
        blocks, valid = grouped_blocks(spec, lengths, block_size)
        mean_len = float(lengths.mean())
        mean_valid = float(valid.mean())
        mean_blocks = float(blocks.mean())
        out["workload"] = {
            "path": str(workload), "requests": int(lengths.size), "clipped_to_max_model_len": clipped,
            "mean_tokens": mean_len, "p50_tokens": float(np.percentile(lengths, 50)),
            "p99_tokens": float(np.percentile(lengths, 99)), "max_tokens": int(lengths.max()),
            "paged": {"mean_blocks_per_request": mean_blocks,
                      "concurrency": int(num_blocks // mean_blocks) if mean_blocks else 0,
                      "slot_utilisation": mean_valid / (mean_blocks * block_size) if mean_blocks else 0.0},
            "contiguous": {"blocks_per_request": per_req_max,
                           "concurrency": num_blocks // per_req_max,
                           "slot_utilisation": mean_valid / (per_req_max * block_size)},
        }
    return out


def grouped_blocks(spec: KVCacheSpec, lengths: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request of ``lengths`` tokens (int64 array): block ids held after its last step
    over all layer groups, and the token slots those blocks must hold (a window group: the
    last ``min(length, W)`` tokens), summed over groups (without windows: the length)."""
    blocks = np.zeros_like(lengths)
    valid = np.zeros_like(lengths)
    for w in spec.groups.windows:
        blocks += blocks_needed(lengths, block_size, w)
        valid += lengths if w is None else np.minimum(lengths, w)
    return blocks, valid


def group_plan(spec: KVCacheSpec, budget: int, block_size: int, max_model_len: int) -> dict[str, Any]:
    """A hybrid spec's groups at ``max_model_len``, next to the same model sized all-full:
    per group its window, layers and blocks held by one request; block bytes, blocks in the
    budget, blocks / bytes per request and max concurrency of both; and
    ``bytes_per_request_ratio`` (hybrid / all-full)."""
    g = spec.groups
    full = replace(spec, layer_windows=None)

    def side(s: KVCacheSpec) -> dict[str, Any]:
        n = s.num_blocks(budget, block_size)
        per = s.blocks_per_request(max_model_len, block_size)
        return {"block_bytes": s.block_bytes(block_size), "num_blocks": n, "blocks_per_request": per,
                "bytes_per_request": per * s.block_bytes(block_size), "max_concurrency": n // per}

    hybrid, all_full = side(spec), side(full)
    return {
        "groups": [{"group": i, "window": w, "num_layers": len(g.layers_of(i)),
                    "blocks_per_request": g.blocks_held(i, max_model_len, block_size)}
                   for i, w in enumerate(g.windows)],
        "page_waste": g.page_waste, "hybrid": hybrid, "all_full": all_full,
        "bytes_per_request_ratio": hybrid["bytes_per_request"] / all_full["bytes_per_request"],
    }


def format_plan(p: dict[str, Any]) -> str:
    """Text for ``pagedkv plan``."""
    s = p["spec"]
    kind = (f"MLA latent {s['kv_lora_rank']}+{s['qk_rope_head_dim']}" if s["mla"]
            else f"{s['num_kv_heads']} KV heads x d {s['head_dim']}")
    lines = [
        f"model            {p['model']}: {s['num_layers']} layers, {kind}, {s['dtype']}"
        f"{'' if s['quant_group_size'] is None else ' (bf16 scale per ' + str(s['quant_group_size']) + ' elements)'}"
        f", tp {s['tp_size']}"
        f" ({s['kv_heads_per_rank']} KV heads/rank, replication {s['replication']})",
        f"bytes/token      {p['bytes_per_token']:,} per rank, {p['bytes_per_token_total']:,} over all ranks",
        f"block            {p['block_size']} tokens: page {p['page_size_bytes']:,} B/layer, "
        f"{p['block_bytes']:,} B per block id ({p['block_bytes'] // p['page_size_bytes']} layers)",
        f"KV budget        {p['kv_budget_bytes']:,} B per rank -> {p['num_blocks']:,} blocks, "
        f"{p['tokens_held']:,} tokens held",
        f"max concurrency  {p['max_concurrency_at_max_model_len']:,} requests at max_model_len "
        f"{p['max_model_len']:,}",
    ]
    lg = p.get("layer_groups")
    if lg:
        kinds = [(x["num_layers"], x["window"], x["blocks_per_request"]) for x in lg["groups"]]
        groups = ", ".join(f"{'' if n == 1 else f'{n} x '}{k[0]} layers "
                           f"{'full' if k[1] is None else 'window ' + str(k[1])} ({k[2]:,} blocks)"
                           for k, n in ((k, len(list(run))) for k, run in itertools.groupby(kinds)))
        h, f = lg["hybrid"], lg["all_full"]
        lines += [
            f"layer groups     {groups} per request at max_model_len",
            f"  hybrid         {h['blocks_per_request']:,} blocks x {h['block_bytes']:,} B = "
            f"{h['bytes_per_request']:,} B per request, concurrency {h['max_concurrency']:,}",
            f"  all-full       {f['blocks_per_request']:,} blocks x {f['block_bytes']:,} B = "
            f"{f['bytes_per_request']:,} B per request, concurrency {f['max_concurrency']:,}",
            f"  ratio          {lg['bytes_per_request_ratio']:.4f} of the all-full bytes per request",
        ]
    w = p.get("workload")
    if w:
        lines += [
            f"workload         {w['path']}: {w['requests']:,} requests, mean {w['mean_tokens']:.1f} tokens "
            f"(p50 {w['p50_tokens']:.0f}, p99 {w['p99_tokens']:.0f}, max {w['max_tokens']}; "
            f"{w['clipped_to_max_model_len']} clipped)",
            f"  paged          concurrency {w['paged']['concurrency']:,}, slot utilisation "
            f"{100 * w['paged']['slot_utilisation']:.1f}%",
            f"  contiguous     concurrency {w['contiguous']['concurrency']:,}, slot utilisation "
            f"{100 * w['contiguous']['slot_utilisation']:.1f}%",
        ]
    return "\n".join(lines)
