"""Capacity: replay a trace against a KV budget; paged vs contiguous slot utilisation and concurrency.

Seed §05 "cache capacity": fix the model (bytes per token), the dtype, the KV budget and the
context-length distribution of a real trace, then record effective KV tokens against the slots
actually allocated, over time, for

* contiguous max reservation: every admitted request reserves ``max_model_len`` slots, and
* paging at several block sizes: a request holds ``ceil(len / block_size)`` blocks, so only
  the free tail of its last block is wasted (internal fragmentation), plus its block-table
  entries (metadata, ``--table-entry-bytes`` each, counted as slot-equivalents of the model's
  bytes per token and taken out of the same budget).

The replay model (stated in every result file):

* Time advances in decode steps of ``--step-ms`` milliseconds (continuous batching: every
  running request advances one token per step; the step time does not depend on the batch).
* A request arriving at ``TIMESTAMP`` (relative to the first row, times ``--time-scale``)
  becomes schedulable at the next step boundary. Its prefill takes one step and writes
  ``ContextTokens`` KV entries; each of the following ``GeneratedTokens - 1`` decode steps
  writes one more. So in its j-th step (j = 0 .. GeneratedTokens-1) it holds
  ``ContextTokens + j`` tokens, and it frees everything when it finishes.
* Admission is strict FCFS: the head of the queue is admitted when the memory it needs right
  now fits (paged: the blocks of its prompt; contiguous: one ``max_model_len`` region); nobody
  overtakes a blocked head.
* Paging can run out of blocks while requests grow: then the most recently admitted request
  is preempted (its blocks freed, it goes back to the front of the queue and later re-prefills
  its prompt plus what it generated, in one step), and nobody is admitted in that step
  (as vLLM does). Contiguous reservation never needs to preempt.
* Requests longer than ``max_model_len`` (prompt + output) are clipped (the prompt keeps its
  last tokens, the output length is kept) or skipped (``--overlong``); both are counted.

Everything is computed per event (arrival, finish, out-of-blocks), analytically between
events; there is no per-token loop.

A model with sliding-window layers (``--model gemma-2-9b``) runs the hybrid-vs-all-full
comparison of :mod:`pagedkv.bench.capacity.hybrid` instead. Both are variants of one result set,
``capacity.{json,md,png}``: ``paged_vs_contiguous`` (this replay) and ``hybrid``
(:mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.bench.capacity.hybrid import HYBRID_MODELS
from pagedkv.bench.capacity.report import GOAL_CONCURRENCY_RATIO, GOAL_UTILIZATION, make_plots, render_markdown
from pagedkv.bench.capacity.sim import SimResult, series_bins, simulate
from pagedkv.bench.common import default_workload, machine_info, pin_threads
from pagedkv.bench.report import publish
from pagedkv.bench.variants import add_variant_option
from pagedkv.bench.workload import load_trace
from pagedkv.errors import ConfigError
from pagedkv.utils import cdiv

MODEL_CHOICES = ("bundled", "llama-3-8b", "qwen2.5-7b", "deepseek-v3")
DEFAULT_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_STEP_MS = 50.0
DEFAULT_KV_BUDGET = "2GiB"
HEADLINE_BLOCK_SIZE = 16
VARIANT = "paged_vs_contiguous"  #: the variant of capacity.* this replay writes by default


# --------------------------------------------------------------------------------------------
# Models and budgets
# --------------------------------------------------------------------------------------------


def load_spec(model: str, dtype: str):
    """The ``KVCacheSpec`` of ``model`` (one of ``MODEL_CHOICES``) with KV cache ``dtype``.

    ``bundled`` reads the bundled SmolLM2-135M GGUF header; the others are the HF configs
    shipped in ``pagedkv/kv/configs/``.
    """
    from pagedkv.kv.spec import KVCacheSpec

    if model == "bundled":
        from pagedkv._bundled import bundled_model_path

        return KVCacheSpec.from_gguf(bundled_model_path(), dtype=dtype)
    if model not in MODEL_CHOICES:
        raise ConfigError(f"--model: unknown model {model!r} (one of {', '.join(MODEL_CHOICES)}, all)")
    return KVCacheSpec.from_hf_config(model, dtype=dtype)


def parse_budget(text: str) -> int:
    """Bytes in a size like ``2GiB`` / ``512MiB`` / ``2GB`` (see ``pagedkv.kv.spec.parse_size``)."""
    from pagedkv.kv.spec import parse_size

    return int(parse_size(text))


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if a.size else float("nan")


def _row(model: str, layout: str, res: SimResult, *, step_s: float, arrival_step: np.ndarray,
         bytes_per_token: int, budget: int) -> dict[str, Any]:
    admitted = res.admit_step >= 0
    fit_arr = arrival_step  # already filtered to the requests that fit
    wait_s = (res.admit_step[admitted] - fit_arr[admitted]) * step_s
    busy = max(res.busy_steps, 1)
    return {
        "model": model,
        "layout": layout,
        "block_size": res.block_size,
        "utilization": res.utilization,
        "utilization_no_metadata": res.utilization_no_metadata,
        "internal_waste": 1.0 - res.utilization_no_metadata,
        "metadata_waste": res.utilization_no_metadata - res.utilization,
        "peak_concurrency": res.peak_concurrency,
        "mean_concurrency": res.request_steps / busy,
        "num_blocks": res.num_blocks,
        "capacity_tokens": res.num_blocks * res.block_size,
        "mean_effective_tokens": res.eff_token_steps / busy,
        "mean_allocated_slots": res.slot_steps / busy,
        "peak_effective_tokens": res.peak_effective_tokens,
        "peak_allocated_slots": res.peak_blocks * (res.block_size + res.entry_slots),
        "mean_budget_occupancy": res.block_steps * res.block_size * bytes_per_token / busy / budget,
        "requests": res.requests,
        "never_fit": res.never_fit,
        "preemptions": res.preemptions,
        "peak_queue": res.peak_queue,
        "mean_queue": res.queue_steps / busy,
        "queue_delay_mean_s": float(wait_s.mean()) if wait_s.size else float("nan"),
        "queue_delay_p50_s": _pct(wait_s, 50),
        "queue_delay_p99_s": _pct(wait_s, 99),
        "queue_delay_max_s": float(wait_s.max()) if wait_s.size else float("nan"),
        "makespan_s": res.last_step * step_s,
        "busy_s": res.busy_steps * step_s,
        "events": res.events,
    }


def _parse_block_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--block-sizes must be comma-separated integers, not {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"--block-sizes must be >= 1: {text!r}")
    return sizes


def run_capacity(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (model, layout) replay; returns the result document (JSON-ready)."""
    if getattr(args, "kv_cache_dtype", None) and args.kv_cache_dtype != "auto":
        from pagedkv.utils import canonical_dtype, kv_cache_dtype

        args.dtype = canonical_dtype(kv_cache_dtype(args.kv_cache_dtype))  # ConfigError naming the valid ones
    from tqdm import tqdm

    t0 = time.perf_counter()
    models = list(MODEL_CHOICES) if args.model == "all" else [args.model]
    sizes = _parse_block_sizes(args.block_sizes)
    budget = parse_budget(args.kv_budget)
    if budget <= 0:
        raise ConfigError(f"--kv-budget must be positive: {args.kv_budget!r}")
    if not (args.step_ms > 0):
        raise ConfigError(f"--step-ms must be positive, not {args.step_ms}")
    step_s = args.step_ms / 1000.0
    L = int(args.max_model_len)
    trace = load_trace(args.workload, limit=args.limit, time_scale=args.time_scale,
                       max_model_len=L, overlong=args.overlong)
    arrival_step = np.ceil(trace.arrival_s / step_s - 1e-9).astype(np.int64)
    entry_bytes = int(args.table_entry_bytes)

    results: list[dict[str, Any]] = []
    per_model: list[dict[str, Any]] = []
    bar = tqdm(total=len(models) * (1 + len(sizes)), desc="capacity", unit="replay",
               file=sys.stderr, mininterval=1.0)
    for model in models:
        spec = load_spec(model, args.dtype)
        bpt = int(spec.bytes_per_token)
        entry_slots = entry_bytes / bpt
        layouts = [("contiguous", L, 0)] + [("paged", s, entry_bytes) for s in sizes]
        rows: list[dict[str, Any]] = []
        series: dict[str, Any] = {}
        for layout, bsz, eb in layouts:
            n_blocks = budget // (int(spec.block_bytes(bsz)) + eb)
            if n_blocks < 1:
                raise ConfigError(
                    f"--kv-budget {args.kv_budget} holds no {layout} block of {bsz} tokens for "
                    f"{model} ({spec.block_bytes(bsz)} bytes)"
                )
            bar.set_postfix_str(f"{model} {layout} {bsz}")
            res = simulate(arrival_step, trace.context, trace.generated, block_size=bsz,
                           num_blocks=int(n_blocks), entry_slots=eb / bpt)
            fit = cdiv(trace.context + trace.generated - 1, bsz) <= n_blocks
            row = _row(model, layout, res, step_s=step_s, arrival_step=arrival_step[fit],
                       bytes_per_token=bpt, budget=budget)
            rows.append(row)
            if layout == "contiguous" or bsz == HEADLINE_BLOCK_SIZE or (
                    HEADLINE_BLOCK_SIZE not in sizes and bsz == sizes[0]):
                series[f"{layout}_{bsz}"] = series_bins(res, step_s, args.series_points)
            bar.update(1)
        contig = rows[0]
        for r in rows:
            r["concurrency_vs_contiguous"] = r["peak_concurrency"] / max(contig["peak_concurrency"], 1)
            r["mean_concurrency_vs_contiguous"] = r["mean_concurrency"] / max(contig["mean_concurrency"], 1e-12)
        results.extend(rows)
        per_model.append({"model": model, "spec": spec.describe(), "table_entry_slots": entry_slots,
                          "series": series})
    bar.close()

    headline = []
    for model in models:
        c = next(r for r in results if r["model"] == model and r["layout"] == "contiguous")
        p = next((r for r in results if r["model"] == model and r["layout"] == "paged"
                  and r["block_size"] == HEADLINE_BLOCK_SIZE), None)
        if p is None:
            continue
        headline.append({
            "model": model,
            "block_size": HEADLINE_BLOCK_SIZE,
            "paged_utilization": p["utilization"],
            "contiguous_utilization": c["utilization"],
            "paged_peak_concurrency": p["peak_concurrency"],
            "contiguous_peak_concurrency": c["peak_concurrency"],
            "concurrency_ratio": p["concurrency_vs_contiguous"],
            "mean_concurrency_ratio": p["mean_concurrency_vs_contiguous"],
            "meets_utilization_goal": bool(p["utilization"] >= GOAL_UTILIZATION),
            "meets_concurrency_goal": bool(p["concurrency_vs_contiguous"] >= GOAL_CONCURRENCY_RATIO),
        })

    wl = Path(args.workload)
    return {
        "benchmark": "capacity",
        "config": {
            "workload": wl.name,
            "workload_path": str(wl),
            "limit": args.limit,
            "time_scale": args.time_scale,
            "step_ms": args.step_ms,
            "max_model_len": L,
            "overlong": args.overlong,
            "kv_budget": args.kv_budget,
            "kv_budget_bytes": budget,
            "dtype": args.dtype,
            "block_sizes": sizes,
            "table_entry_bytes": entry_bytes,
            "models": models,
            "policy": ("decode steps of step_ms; prefill = 1 step writing ContextTokens, then one KV "
                       "token per step for GeneratedTokens-1 steps; strict FCFS admission when the "
                       "request's current blocks fit; paged: preempt newest when growth runs out of "
                       "blocks (resume by re-prefill, no admission that step); contiguous = one "
                       "max_model_len block per request; block-table metadata inside the budget"),
        },
        "trace": {
            "rows_read": trace.rows_read,
            "requests": int(trace.context.size),
            "clipped": trace.clipped,
            "clipped_tokens": trace.clipped_tokens,
            "skipped_overlong": trace.skipped_overlong,
            "skipped_invalid": trace.skipped_invalid,
            "duration_s": float(trace.arrival_s[-1]) if trace.arrival_s.size else 0.0,
            "context_mean": float(trace.context.mean()),
            "context_p50": _pct(trace.context, 50),
            "context_p99": _pct(trace.context, 99),
            "context_max": int(trace.context.max()),
            "generated_mean": float(trace.generated.mean()),
            "generated_p50": _pct(trace.generated, 50),
            "generated_max": int(trace.generated.max()),
        },
        "headline": headline,
        "results": results,
        "models": per_model,
        "runtime_s": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=(*MODEL_CHOICES, *HYBRID_MODELS, "all"), default="all",
                   help="KV config to size (default all: the bundled SmolLM2-135M, Llama-3-8B (GQA), "
                        "Qwen2.5-7B (GQA), DeepSeek-V3 (MLA)); gemma-2-9b: hybrid (sliding-window "
                        "groups) vs all-full at the headline block size, the variant `hybrid` of capacity.*")
    p.add_argument("--windows", default="",
                   help="hybrid models: extra windows (tokens, comma-separated) to replay with the window "
                        "layers' window replaced, e.g. 1024")
    p.add_argument("--dtype", default="bf16",
                   help="KV cache dtype: bf16, fp16, fp32, fp8, int8, int4 (default bf16)")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="the engine's name for it instead (float32 bfloat16 int8 fp8_e4m3 ...; int8/fp8 with "
                        "one bf16 scale per head vector, as the engine allocates)")
    p.add_argument("--kv-budget", default=DEFAULT_KV_BUDGET,
                   help=f"KV memory per model, e.g. 2GiB or 512MB (default {DEFAULT_KV_BUDGET})")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                   help=f"tokens (prompt + output) per request; contiguous reserves this much "
                        f"(default {DEFAULT_MAX_MODEL_LEN})")
    p.add_argument("--overlong", choices=("clip", "skip"), default="clip",
                   help="requests over max_model_len: clip the prompt (keep the output) or skip (default clip)")
    p.add_argument("--block-sizes", default=",".join(map(str, DEFAULT_BLOCK_SIZES)),
                   help="comma-separated paged block sizes in tokens (default 1,8,16,32,64,128)")
    p.add_argument("--workload", default=str(default_workload()),
                   help="CSV with TIMESTAMP,ContextTokens,GeneratedTokens (default the Azure conv trace)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N rows")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival offsets by this (0.5 = twice the arrival rate; default 1)")
    p.add_argument("--step-ms", type=float, default=DEFAULT_STEP_MS,
                   help=f"decode step time in ms: one token per running request per step "
                        f"(default {DEFAULT_STEP_MS:g})")
    p.add_argument("--table-entry-bytes", type=int, default=4,
                   help="bytes per block-table entry, counted against the budget (default 4)")
    p.add_argument("--series-points", type=int, default=400,
                   help="time samples of the over-time series kept in the JSON (default 400)")
    add_variant_option(p, "hybrid for a model with sliding windows, else paged_vs_contiguous")


def run(args: argparse.Namespace) -> int:
    if args.model in HYBRID_MODELS:
        from pagedkv.bench.capacity import hybrid as hybrid_replay

        sizes = _parse_block_sizes(args.block_sizes)
        args.block_size = HEADLINE_BLOCK_SIZE if HEADLINE_BLOCK_SIZE in sizes else sizes[0]
        return hybrid_replay.run(args)
    threads = pin_threads(args.threads)
    data = run_capacity(args)
    data["machine"] = machine_info(threads)

    publish("capacity", data, render_markdown, args.out_dir, variant=args.variant or VARIANT, plots=make_plots,
            as_json=args.json,
            json_keys=("config", "trace", "headline", "results", "runtime_s"), summary=_summary)
    return 0


def _summary(data: dict[str, Any], paths: dict[str, Path]) -> str:
    lines = [f"{h['model']}: block {h['block_size']} paged utilisation {100 * h['paged_utilization']:.2f}% vs "
             f"contiguous {100 * h['contiguous_utilization']:.2f}%; peak concurrency {h['paged_peak_concurrency']} "
             f"vs {h['contiguous_peak_concurrency']} ({h['concurrency_ratio']:.2f}x)" for h in data["headline"]]
    lines.append(f"wrote {paths['json']}, {paths['md']}{' and ' + str(paths['png']) if 'png' in paths else ''} "
                 f"in {data['runtime_s']:.1f} s")
    return "\n".join(lines)
