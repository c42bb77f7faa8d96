"""Decode attention per KV cache format (``pagedkv bench attention --kv-cache-dtypes``).

For each context length: the same float32 queries over paged caches holding the same K/V in
each format (float32, bfloat16, int8, fp8_e4m3, ...), one variant per format, timed
round-robin in one loop (so the machine's load hits every format alike). A quantised cache
is dequantised inside the kernel; its bytes read per call are the codes plus the bf16 scales
(``2 * B * L * Hkv * (d + 2 d / G)``), counted from the allocated tensors. Reported per
format: median time, KV bytes read, GB/s, and time and bytes relative to float32.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.utils import cdiv


def _caches(args: argparse.Namespace, kv_dtype: str, ctx: int, working_set: int, seed: int) -> dict[str, Any]:
    """Layer caches of ``kv_dtype`` (cycled so the working set exceeds the last-level cache),
    each holding ``args.batch`` shuffled sequences of ``ctx`` tokens."""
    import torch

    from pagedkv.attention import AttentionMetadata, get_backend

    g = torch.Generator().manual_seed(seed)  # the same K/V in every format
    be = get_backend(args.backend)
    hkv, d, bs, b = args.kv_heads, args.head_dim, args.block_size, args.batch
    nblk = cdiv(ctx, bs)
    dtype = getattr(torch, kv_dtype) if kv_dtype in ("float32", "bfloat16", "float16") else kv_dtype
    caches, mds, nbytes = [], [], 0
    while not caches or nbytes * len(caches) < working_set:
        perm = torch.randperm(b * nblk + 1, generator=g)[: b * nblk].view(b, nblk).tolist()
        cache = be.allocate_kv_cache(b * nblk + 1, bs, hkv, d, dtype)
        full = AttentionMetadata.build([ctx] * b, [ctx] * b, perm, bs)
        be.write_kv(cache, torch.randn(b * ctx, hkv, d, generator=g), torch.randn(b * ctx, hkv, d, generator=g),
                    full.slot_mapping)
        caches.append(cache)
        mds.append(AttentionMetadata.build([ctx] * b, [1] * b, perm, bs))
        nbytes = cache.nbytes * (b * ctx) // ((b * nblk + 1) * bs)  # the bytes of the ctx tokens read
    return {"backend": be, "caches": caches, "mds": mds, "bytes": nbytes, "i": 0}


def bench_kv_formats(args: argparse.Namespace, ctx: int, working_set: int, timer) -> list[dict[str, Any]]:
    """One row per format at context ``ctx`` (``timer``: the attention benchmark's
    round-robin timer ``fns, repeats -> {name: (median, best, cpu)}``)."""
    import torch

    names = [n.strip() for n in str(args.kv_cache_dtypes).split(",") if n.strip()]
    if "float32" not in names:
        names.insert(0, "float32")
    sets = {n: _caches(args, n, ctx, working_set, seed=ctx) for n in names}
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=torch.Generator().manual_seed(1))
    scale = args.head_dim ** -0.5

    def call(s: dict[str, Any]):
        def fn():
            s["i"] = (s["i"] + 1) % len(s["caches"])
            return s["backend"].forward(q, s["caches"][s["i"]], s["mds"][s["i"]], scale)
        return fn

    first = {n: s["backend"].forward(q, s["caches"][0], s["mds"][0], scale) for n, s in sets.items()}
    errs = {n: float((o - first["float32"]).abs().max()) for n, o in first.items()}  # the same K/V in each
    t = timer({n: call(s) for n, s in sets.items()}, args.repeats)
    base_ms, base_bytes = t["float32"][0] * 1e3, sets["float32"]["bytes"]
    rows = []
    for n, s in sets.items():
        ms = t[n][0] * 1e3
        rows.append({"kv_cache_dtype": n, "context": ctx, "batch": args.batch, "ms": ms, "best_ms": t[n][1] * 1e3,
                     "kv_bytes": s["bytes"], "GBps": s["bytes"] / (ms / 1e3) / 1e9, "time_vs_float32": ms / base_ms,
                     "bytes_vs_float32": s["bytes"] / base_bytes, "max_abs_diff_vs_float32": errs[n],
                     "layers_cycled": len(s["caches"])})
    return rows
