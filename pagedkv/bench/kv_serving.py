"""KV cache formats under serving load: the seed §05 rate sweep with float32, bf16 and int8 caches at one byte budget.

The workload, arrivals, latency targets and in-process replay are ``pagedkv bench serve``'s
(trace-sized requests with a shared prefix, Poisson arrivals, greedy with EOS ignored, paging
on, prefix caching off; its flags apply). What changes is the KV cache format at a fixed
number of **bytes** (``--kv-cache-memory``, default: the serve benchmark's ``--num-blocks``
of float32), so each format holds the blocks its bytes per token allow: int8 about 3.9x the
tokens of float32. Per format and rate: blocks, completed requests, peak and mean running
requests, preemptions, TTFT / TPOT p90, output tok/s, and the sustainable rate (the highest
rate meeting the target, and the relaxed target). Rates outer, formats inner: the formats run
back to back at each rate, so a change in the machine's load hits them alike; one untimed
pass over the workload comes first (torch's per-shape kernel set-up).

Results: the variant ``kv_formats`` of ``serving.{json,md,png}``, beside ``pagedkv bench serve``'s
rate sweep (:mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pagedkv.bench.serve import run as serve
from pagedkv.bench.common import RunFacts, engine_from_args, json_clean, load_fp32_model, log, warm_up
from pagedkv.bench.report import closing_lines, markdown_table, publish, pyplot, save_figure, single_plot
from pagedkv.bench.workload import meets_target, poisson_arrivals, requests_from_args, summarize_run

NAME = "kv_serving"


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve.add_arguments(p)
    k = p.add_argument_group("KV cache formats")
    k.add_argument("--kv-cache-dtypes", default="float32,bfloat16,int8", help="formats (default float32,bfloat16,int8)")
    k.add_argument("--kv-cache-memory", default=None,
                   help="KV budget in bytes for every format (default: --num-blocks x --block-size float32 tokens)")


def run_kv_serving(args: argparse.Namespace, loaded: Any = None) -> dict[str, Any]:
    from pagedkv.kv import parse_size
    from pagedkv.utils import kv_cache_dtype

    if args.tiny:
        serve._apply_tiny(args)
    facts = RunFacts.start(args.threads)
    loaded = load_fp32_model(loaded)
    names = [kv_cache_dtype(n) for n in args.kv_cache_dtypes.split(",") if n.strip()]
    fp32 = engine_from_args(loaded, args, num_blocks=args.num_blocks)
    budget = parse_size(args.kv_cache_memory) if args.kv_cache_memory else fp32.num_blocks * args.block_size * fp32.kv_spec.bytes_per_token
    base, scaling = requests_from_args(args, int(loaded.config.vocab_size), args.shared_prefix_len)
    unit = poisson_arrivals(args.num_requests, 1.0, seed=args.seed + 2)
    target = (args.target_ttft_p90, args.target_tpot_p90)
    relaxed = (target[0] * args.relaxed_factor, target[1] * args.relaxed_factor)
    rates = sorted({float(x) for x in args.rates.split(",") if x.strip()})
    rows: list[dict[str, Any]] = []
    misses = {n: 0 for n in names}
    t0 = time.time()
    # one untimed pass over the whole workload first: the first run in a process pays for
    # torch's kernel set-up of every batch shape (measured: 15x the TTFT of the next runs)
    warm = engine_from_args(loaded, args, num_blocks=None, kv_cache_memory=budget, kv_cache_dtype=names[0])
    serve.replay_in_process(warm, serve._at_rate(base, unit, 100.0), args.max_run_seconds, desc="warm-up", progress=False)
    del warm
    for rate in rates:
        for n in names:
            if misses[n] >= args.stop_after_misses and not args.sweep_all:
                rows.append({"kv_cache_dtype": n, "rate": rate, "skipped": f"missed the relaxed target at {misses[n]} lower rates"})
                continue
            eng = engine_from_args(loaded, args, num_blocks=None, kv_cache_memory=budget, kv_cache_dtype=n,
                                   seed=args.seed, enable_paging=True, enable_prefix_caching=False)
            warm_up(eng, serve._warm_prompt(loaded))
            t = time.time()
            records, stats = serve.replay_in_process(eng, serve._at_rate(base, unit, rate), args.max_run_seconds,
                                                     desc=f"{n} @ {rate:g}", progress=False)
            s = summarize_run(records, stats)
            row = {"kv_cache_dtype": n, "rate": rate, "num_blocks": eng.num_blocks,
                   "kv_tokens": eng.num_blocks * args.block_size, "kv_bytes_per_token": eng.kv_spec.bytes_per_token,
                   **s, "meets_target": meets_target(s, *target), "meets_relaxed_target": meets_target(s, *relaxed)}
            rows.append(row)
            misses[n] = 0 if row["meets_relaxed_target"] else misses[n] + 1
            log(f"[kv_serving] {n} @ {rate:g} req/s ({eng.num_blocks} blocks): peak running {s['peak_running']}, "
                f"preempt {s['preemptions']}, TTFT p90 {s['ttft_s']['p90']:.2f}s, TPOT p90 {s['tpot_s']['p90'] * 1e3:.0f}ms, "
                f"{s['output_tokens_per_s']:.1f} tok/s, done {s['completed']}/{s['requests']} ({time.time() - t:.0f}s)")
    done = [r for r in rows if "skipped" not in r]
    summary = []
    for n in names:
        mine = [r for r in done if r["kv_cache_dtype"] == n]
        ok = [r["rate"] for r in mine if r["meets_target"]]
        ok_relaxed = [r["rate"] for r in mine if r["meets_relaxed_target"]]
        summary.append({"kv_cache_dtype": n, "num_blocks": mine[0]["num_blocks"] if mine else None,
                        "kv_tokens": mine[0]["kv_tokens"] if mine else None,
                        "peak_running": max((r["peak_running"] for r in mine), default=0),
                        "preemptions": sum(r["preemptions"] for r in mine),
                        "sustainable_rate": max(ok) if ok else None,
                        "sustainable_rate_relaxed": max(ok_relaxed) if ok_relaxed else None})
    return json_clean({
        "benchmark": NAME,
        "config": {"kv_budget_bytes": budget, "kv_cache_dtypes": names, "rates": rates,
                   "num_requests": args.num_requests, "length_scaling": scaling.describe(),
                   "shared_prefix_len": args.shared_prefix_len, "block_size": args.block_size,
                   "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "target": {"ttft_p90_s": target[0], "tpot_p90_s": target[1]},
                   "relaxed_target": {"ttft_p90_s": relaxed[0], "tpot_p90_s": relaxed[1]},
                   "threads": facts.threads, "tiny": bool(args.tiny), "notes": args.note},
        "summary": summary,
        "sweep": rows,
        "elapsed_s": time.time() - t0,
        **facts.finish(),
    })


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    c = data["config"]
    t, r = c["target"], c["relaxed_target"]
    setup = {
        "workload": f"`pagedkv bench serve`'s: {c['num_requests']} requests per run, {c['length_scaling']}",
        "shared prefix": f"{c['shared_prefix_len']} tokens (prefix caching off), Poisson arrivals, greedy, paging on",
        "engine": f"max_model_len {c['max_model_len']}, block size {c['block_size']}, max_num_batched_tokens "
                  f"{c['max_num_batched_tokens']}, torch threads {c['threads']}",
        "KV budget": f"{c['kv_budget_bytes']:,} bytes for every format",
        "target": f"p90 TTFT <= {t['ttft_p90_s']:g} s, p90 TPOT <= {t['tpot_p90_s']:g} s, every request completed",
        "relaxed target": f"{r['ttft_p90_s']:g} s / {r['tpot_p90_s']:g} s",
    }
    lines = ["# KV cache formats under serving load (one byte budget)", ""]
    lines += [f"* {k}: {v}" for k, v in setup.items()] + [""]
    lines += [
        "## Summary",
        "",
        markdown_table(data["summary"], ["kv_cache_dtype", "num_blocks", "kv_tokens", "peak_running", "preemptions",
                                         "sustainable_rate", "sustainable_rate_relaxed"]),
        "## Sweep",
        "",
    ]
    rows = [{**x, "ttft_p90_s": x["ttft_s"]["p90"], "tpot_p90_ms": x["tpot_s"]["p90"] * 1e3}
            for x in data["sweep"] if "skipped" not in x]
    lines.append(markdown_table(rows, ["rate", "kv_cache_dtype", "num_blocks", "completed", "requests",
                                       "peak_running", "mean_running", "preemptions", "ttft_p90_s", "tpot_p90_ms",
                                       "output_tokens_per_s", "meets_target", "meets_relaxed_target"]))
    return "\n".join(lines + closing_lines(data, plots, c.get("notes"))) + "\n"


def plot(data: dict[str, Any], path: Any) -> None:
    """p90 TTFT and peak running requests against the arrival rate, one line per format."""
    fig, axes = pyplot().subplots(1, 2, figsize=(10, 4))
    for n in data["config"]["kv_cache_dtypes"]:
        rs = [x for x in data["sweep"] if x["kv_cache_dtype"] == n and "skipped" not in x]
        axes[0].plot([x["rate"] for x in rs], [x["ttft_s"]["p90"] for x in rs], "o-", label=n)
        axes[1].plot([x["rate"] for x in rs], [x["peak_running"] for x in rs], "s-", label=n)
    axes[0].axhline(data["config"]["relaxed_target"]["ttft_p90_s"], color="gray", lw=1, ls="--", label="relaxed target")
    for ax, label in zip(axes, ("p90 TTFT (s)", "peak running requests")):
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle("KV cache formats at one byte budget")
    save_figure(fig, path)


def run(args: argparse.Namespace, loaded: Any = None) -> int:
    data = run_kv_serving(args, loaded)
    publish(serve.NAME, data, render_markdown, args.out_dir, variant=args.variant or "kv_formats", as_json=args.json,
            plots=None if args.no_plot else single_plot(NAME, "rate sweep", plot))
    return 0
