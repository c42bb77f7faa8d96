"""Capacity of a hybrid KV cache (full + sliding-window layer groups) vs the same model sized
all-full: ``pagedkv bench capacity --model gemma-2-9b`` (a model with sliding windows), written
as the variant ``hybrid`` of the result set ``capacity.*``.

The replay is :func:`pagedkv.bench.capacity.sim.simulate` (same trace, policy and step model
as ``bench capacity``), run at one KV byte budget for

* ``all-full``: every layer keeps every position (one group; a block id costs ``L`` pages),
* ``hybrid``: full layers and window layers in their own groups (``pagedkv.kv.groups``); a
  block id costs ``max_layers`` pages, a window group holds the blocks of its last ``W``
  tokens,
* ``contiguous``: one ``max_model_len`` region per request, priced all-full.

Effective tokens and allocated slots are in token-slots of one block id summed over the
groups (for Gemma-2, 21 + 21 layers: a hybrid slot is half an all-full slot), so both are
also reported in bytes. ``--windows`` adds replays with the window layers' window replaced
(e.g. Gemma-3's 1024; hypothetical for Gemma-2's weights).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.bench.common import machine_info, pin_threads
from pagedkv.bench.report import markdown_table, plot_links, publish, pyplot, single_plot, save_figure
from pagedkv.bench.workload import load_trace
from pagedkv.errors import ConfigError
from pagedkv.kv.spec import KVCacheSpec, parse_size

HYBRID_MODELS = ("gemma-2-9b",)


def _replay(spec: KVCacheSpec, label: str, trace: Any, arrival: np.ndarray, budget: int, bs: int,
            step_s: float, points: int) -> dict[str, Any]:
    from pagedkv.bench.capacity.sim import series_bins, simulate

    windows = spec.groups.windows
    n_blocks = budget // spec.block_bytes(bs)
    if n_blocks < 1:
        raise ConfigError(f"--kv-budget holds no block of {bs} tokens ({spec.block_bytes(bs)} bytes)")
    res = simulate(arrival, trace.context, trace.generated, block_size=bs, num_blocks=int(n_blocks),
                   windows=windows)
    busy = max(res.busy_steps, 1)
    slot_bytes = spec.block_bytes(bs) // bs  # bytes of one token-slot of a block id
    return {
        "layout": label, "block_size": bs, "windows": [w for w in windows if w is not None],
        "block_bytes": spec.block_bytes(bs), "num_blocks": int(n_blocks),
        "utilization": res.utilization_no_metadata,
        "peak_concurrency": res.peak_concurrency, "mean_concurrency": res.request_steps / busy,
        "mean_effective_slots": res.eff_token_steps / busy,
        "mean_allocated_slots": res.block_steps * bs / busy,
        "mean_effective_bytes": res.eff_token_steps / busy * slot_bytes,
        "mean_allocated_bytes": res.block_steps * bs / busy * slot_bytes,
        "peak_allocated_bytes": res.peak_blocks * spec.block_bytes(bs),
        "preemptions": res.preemptions, "never_fit": res.never_fit, "peak_queue": res.peak_queue,
        "queue_delay_mean_s": float(np.mean(res.admit_step[res.admit_step >= 0]
                                            - arrival[: res.admit_step.size][res.admit_step >= 0]) * step_s)
        if res.never_fit == 0 else float("nan"),
        "makespan_s": res.last_step * step_s,
        "series": series_bins(res, step_s, points),
    }


def run_hybrid(args: argparse.Namespace) -> dict[str, Any]:
    """The replays (contiguous, all-full, hybrid at the model's window and each of
    ``--windows``) at one budget and block size; returns the result document."""
    spec = KVCacheSpec.from_hf_config(args.model, dtype=args.dtype)
    if spec.layer_windows is None:
        raise ConfigError(f"--model {args.model}: no sliding-window layers")
    budget = parse_size(args.kv_budget)
    bs = int(args.block_size)
    step_s = args.step_ms / 1000.0
    L = int(args.max_model_len)
    trace = load_trace(args.workload, limit=args.limit, time_scale=args.time_scale, max_model_len=L,
                       overlong=args.overlong)
    arrival = np.ceil(trace.arrival_s / step_s - 1e-9).astype(np.int64)
    full = replace(spec, layer_windows=None)
    pts = args.series_points
    rows = [_replay(full, "contiguous", trace, arrival, budget, L, step_s, pts),
            _replay(full, "all-full", trace, arrival, budget, bs, step_s, pts),
            _replay(spec, "hybrid", trace, arrival, budget, bs, step_s, pts)]
    w0 = next(w for w in spec.layer_windows if w is not None)
    for w in sorted({int(x) for x in str(args.windows or "").split(",") if x.strip()} - {w0}):
        alt = replace(spec, layer_windows=tuple(None if x is None else w for x in spec.layer_windows))
        rows.append(_replay(alt, f"hybrid, window {w}", trace, arrival, budget, bs, step_s, pts))
    base = rows[1]
    for r in rows:
        r["peak_concurrency_vs_all_full"] = r["peak_concurrency"] / max(base["peak_concurrency"], 1)
        r["mean_concurrency_vs_all_full"] = r["mean_concurrency"] / max(base["mean_concurrency"], 1e-12)
    lens = trace.context + trace.generated
    return {
        "benchmark": "capacity_hybrid",
        "config": {"model": args.model, "workload": Path(args.workload).name, "kv_budget": args.kv_budget,
                   "kv_budget_bytes": budget, "dtype": args.dtype, "block_size": bs, "max_model_len": L,
                   "step_ms": args.step_ms, "time_scale": args.time_scale, "limit": args.limit,
                   "overlong": args.overlong},
        "spec": spec.describe(),
        "trace": {"requests": int(lens.size), "mean_tokens": float(lens.mean()),
                  "over_window": int((lens > w0).sum()), "window": w0, "clipped": trace.clipped},
        "per_request_at_max_model_len": {
            "hybrid_blocks": spec.blocks_per_request(L, bs), "all_full_blocks": full.blocks_per_request(L, bs),
            "bytes_ratio": spec.bytes_per_request(L, bs) / full.bytes_per_request(L, bs)},
        "results": rows,
    }


def render(data: dict[str, Any], plots: dict[str, str]) -> str:
    c, t = data["config"], data["trace"]
    cols = ["layout", "block_bytes", "num_blocks", "utilization", "peak_concurrency", "mean_concurrency",
            "peak_concurrency_vs_all_full", "mean_effective_bytes", "mean_allocated_bytes", "preemptions",
            "peak_queue", "queue_delay_mean_s"]
    pr = data["per_request_at_max_model_len"]
    return "\n".join([
        f"# Capacity: hybrid KV (full + sliding-window groups) vs all-full, {c['model']}",
        "",
        f"Trace {c['workload']} ({t['requests']} requests, mean {t['mean_tokens']:.0f} tokens, "
        f"{t['over_window']} longer than the {t['window']}-token window; {t['clipped']} clipped to "
        f"max_model_len {c['max_model_len']}), KV budget {c['kv_budget']} ({c['dtype']}), block size "
        f"{c['block_size']}, step {c['step_ms']} ms, time scale {c['time_scale']}.",
        "",
        markdown_table(data["results"], cols),
        "",
        f"One request at max_model_len {c['max_model_len']}: {pr['hybrid_blocks']} hybrid block ids vs "
        f"{pr['all_full_blocks']} all-full ({pr['bytes_ratio']:.4f} of the bytes).",
        "",
        "Slots are token-slots of one block id summed over the groups; `utilization` = effective / "
        "allocated slots (internal fragmentation only). A request shorter than the window holds as many "
        "bytes hybrid as all-full (two half-size block ids per block of tokens); only the part of a "
        "request beyond the window is saved, so the gain on this trace is bounded by its long tail.",
        "",
        *plot_links(plots),
        "Reproduce: `pagedkv bench capacity --model gemma-2-9b --threads 1` (options in the JSON config).",
    ])


def _draw(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax, sax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in data["results"]:
        if r["layout"] == "contiguous":
            continue  # in the table; its queue drains ~7x later and would squash the time axis
        s = r["series"]
        line, = ax.step(s["t_s"], s["running_max"], where="post", lw=0.9, label=r["layout"])
        per_slot = r["block_bytes"] / r["block_size"] / 2**30
        sax.plot(s["t_s"], [x * per_slot for x in s["allocated_slots"]], lw=0.9, color=line.get_color(),
                 label=f"{r['layout']}: allocated")
        sax.plot(s["t_s"], [x * per_slot for x in s["effective_tokens"]], lw=0.7, ls="--",
                 color=line.get_color(), label=f"{r['layout']}: effective")
    ax.set_ylabel("running requests (max per bin)")
    sax.set_ylabel("KV GiB (bin means)")
    sax.set_xlabel("time since first arrival (s)")
    ax.legend(fontsize=7)
    sax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{data['config']['model']}: hybrid vs all-full KV at {data['config']['kv_budget']} "
                 "(all-full and hybrid nearly coincide)", fontsize=10)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    threads = pin_threads(args.threads)
    data = run_hybrid(args)
    data["machine"] = machine_info(threads)

    def summary(d: dict[str, Any], paths: dict[str, Path]) -> str:
        return "\n".join(f"{r['layout']}: peak concurrency {r['peak_concurrency']} "
                         f"({r['peak_concurrency_vs_all_full']:.2f}x all-full), mean {r['mean_concurrency']:.1f}"
                         for r in d["results"]) + f"\nwrote {paths['json']}"

    publish("capacity", data, render, args.out_dir, variant=args.variant or "hybrid",
            plots=single_plot("hybrid", "hybrid", _draw),
            as_json=args.json, json_keys=("config", "trace", "per_request_at_max_model_len", "results"),
            summary=summary)
    return 0
