"""Capacity planning, as data + text: ``pagedkv plan``.

``plan`` sizes a KV budget for a model (blocks, bytes per token, concurrency at the longest
request) and optionally a request-length trace; it returns a JSON-able dict and
``format_plan`` renders it for the terminal (``pagedkv.examples.cli``). ``grouped_blocks`` /
``group_plan`` count the blocks of a model with sliding-window layer groups.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import is_gguf_file, read_gguf_metadata
from pagedkv.kv.block_table import blocks_needed
from pagedkv.kv.spec import SCALED_DTYPES, KVCacheSpec, check_group_size, load_hf_config, parse_size
from pagedkv.utils import canonical_dtype
from pagedkv.utils import kv_cache_dtype as kv_cache_dtype_name

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
