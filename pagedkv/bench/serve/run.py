"""Serving: Poisson arrivals of trace-sized requests, paging on/off and prefix caching on/off, rate sweep.

Seed §05 "serving performance": fix the arrival rate, the KV budget and a latency target,
then compare sustainable throughput, preemptions/rejections, TTFT and TPOT.

* Requests: prompt and output lengths drawn from the Azure LLM conversation trace and scaled
  (``LengthScaling``: divided by ``--length-divisor`` and clipped); prompts are synthetic token
  ids whose first ``--shared-prefix-len`` tokens are one common "system prompt" (so prefix
  caching has something to find); outputs are forced to the drawn length (``ignore_eos``),
  greedy.
* Arrivals: a Poisson process at ``rate`` requests/s. One unit-rate draw is divided by the
  rate, so every rate replays the same requests in the same order.
* In-process replay in real time: a request is added (with its scheduled arrival time) as
  soon as that time has passed, and the engine steps in between; TTFT therefore includes the
  wait for the step in flight. With ``--http`` the same workload is also sent to
  ``pagedkv serve`` on 127.0.0.1 (``/v1/completions``, streamed; TTFT = first streamed text).
* Cells (one fixed rate, the same KV budget): paging on/off x prefix caching on/off.
  ``enable_paging=False`` is contiguous max reservation: each admitted request reserves
  ``ceil(max_model_len / block_size)`` blocks.
* Rate sweep (prefix caching off): the highest rate whose p90 TTFT and p90 TPOT meet the
  target (and nothing rejected or left unfinished), for paging on and off.
* ``--peer llama-server`` runs instead ``pagedkv serve`` side by side with llama.cpp's server
  at fixed concurrencies (:mod:`pagedkv.bench.serve.peer`; results: a variant of ``serving_peers.*``).

Results: the variant ``paging`` of ``serving.{json,md,png}`` (another weight format, compiled
decode or model: ``paging_<format>``, ``_compiled``, ``_<model>`` appended), beside
``pagedkv bench kv_serving``'s ``kv_formats`` (:mod:`pagedkv.bench.variants`).

Definitions (seconds): TTFT = first token time - arrival time; TPOT = (finish time - first
token time) / (output tokens - 1); duration = last finish - first arrival; throughput =
completed requests / duration and output tokens / duration. Percentiles interpolate
linearly between closest ranks.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any, Optional, Sequence

from pagedkv.bench import http
from pagedkv.bench.serve import peer as serve_peer
from pagedkv.bench.common import (
    RunFacts,
    add_run_options,
    engine_from_args,
    greedy,
    json_clean,
    load_fp32_model,
    weights_of,
    log,
    warm_up,
)
from pagedkv.bench.peers.systems import resolve_peer_model
from pagedkv.bench.report import publish, single_plot
from pagedkv.bench.variants import add_variant_option
from pagedkv.bench.serve.report import plot, render_markdown
from pagedkv.bench.workload import (
    BenchRequest,
    RequestRecord,
    RunStats,
    add_trace_arguments,
    meets_target,
    poisson_arrivals,
    requests_from_args,
    summarize,
    summarize_run,
)
from pagedkv.kv.block_table import blocks_needed

NAME = "serving"

#: paging on/off x prefix caching on/off; the sweep runs the first two.
CELLS = [{"name": f"paging {'on' if paging else 'off'}" + (" + prefix caching" if caching else ""),
          "enable_paging": paging, "enable_prefix_caching": caching}
         for caching in (False, True) for paging in (True, False)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    add_trace_arguments(w, num_requests=16)
    w.add_argument("--rate", type=float, default=0.3, help="arrival rate of the cell comparison, requests/s (default 0.3)")
    w.add_argument("--rates", default="0.2,0.3,0.45,0.6,0.9,1.2",
                   help="rate sweep, requests/s, comma-separated ('' = no sweep; default 0.2,0.3,0.45,0.6,0.9,1.2)")
    w.add_argument("--shared-prefix-len", type=int, default=64,
                   help="tokens of common system prompt at the start of every prompt (default 64)")
    e = p.add_argument_group("engine (the same KV budget in every cell)")
    e.add_argument("--max-model-len", type=int, default=1024, help="context limit, tokens; the contiguous reservation (default 1024)")
    e.add_argument("--num-blocks", type=int, default=128, help="KV budget in blocks (default 128 = 2 x max_model_len at block 16)")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--weights", default="fp32",
                   help="linear-layer format: fp32 | bf16 | int8 | int4 | auto (default fp32; results of another "
                        "format: the variant paging_<format>)")
    e.add_argument("--compile-decode", action="store_true",
                   help="decode steps through torch.compile (compiled once, before the first cell; "
                        "docs/performance.md; the variant gets a _compiled suffix)")
    e.add_argument("--max-num-batched-tokens", type=int, default=32,
                   help="tokens per engine step (default 32: a step of 512 tokens takes ~2 s on 2 idle cores and one "
                        "of 32 ~0.2 s, so larger steps put every running request past a TPOT target)")
    t = p.add_argument_group("target and limits")
    t.add_argument("--target-ttft-p90", type=float, default=2.0, help="latency target: p90 TTFT, s (default 2)")
    t.add_argument("--target-tpot-p90", type=float, default=0.2, help="latency target: p90 TPOT, s (default 0.2)")
    t.add_argument("--relaxed-factor", type=float, default=3.0,
                   help="also report a relaxed target, both limits times this factor (0 = off; default 3): on a "
                        "loaded shared machine the strict target may be out of reach at any rate")
    t.add_argument("--max-run-seconds", type=float, default=90.0,
                   help="a run still busy this many seconds after its last arrival aborts the rest (they count as "
                        "unfinished; default 90)")
    t.add_argument("--stop-after-misses", type=int, default=2,
                   help="stop sweeping a mode after it misses the (relaxed) target at this many rates in a row (default 2)")
    t.add_argument("--sweep-all", action="store_true", help="sweep every rate whatever the misses")
    h = p.add_argument_group("http")
    h.add_argument("--http", action="store_true", help="also run the paging-on cell against `pagedkv serve` over HTTP")
    h.add_argument("--http-server", choices=["subprocess", "thread"], default="subprocess",
                   help="`python -m pagedkv.cli serve` in a subprocess (default) or uvicorn in a thread of this process")
    h.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (default: a free one)")
    p.add_argument("--cells", default="all", help="'all' or 'none' (only the sweep)")
    serve_peer.add_arguments(p)
    add_variant_option(p, "the sweep: paging (+ _<weights>, _compiled, _<model>); --peer: the GGUF type, else the "
                          "model and peer (q4_k_m, vllm, openvino, gemma-3-270m); bench kv_serving: kv_formats")
    add_run_options(p, tiny="4 requests, short lengths, 2 sweep rates (--peer: 2 concurrencies, 16/4 tokens)",
                    note=True)


def _apply_tiny(args: argparse.Namespace) -> None:
    args.num_requests = min(args.num_requests, 4)
    args.max_prompt = min(args.max_prompt, 48)
    args.max_output = min(args.max_output, 4)
    args.max_model_len = min(args.max_model_len, 64)
    args.num_blocks = min(args.num_blocks, 16)
    args.shared_prefix_len = min(args.shared_prefix_len, 16)
    args.rates = ",".join(args.rates.split(",")[:2]) if args.rates else args.rates
    args.max_run_seconds = min(args.max_run_seconds, 60.0)


# --------------------------------------------------------------------------------------------
# In-process replay
# --------------------------------------------------------------------------------------------


def make_engine(loaded: Any, cell: dict[str, Any], args: argparse.Namespace) -> Any:
    return engine_from_args(loaded, args, seed=args.seed, enable_paging=cell["enable_paging"],
                            enable_prefix_caching=cell["enable_prefix_caching"],
                            compile_decode=bool(getattr(args, "compile_decode", False)))


def _warm_prompt(loaded: Any) -> list[int]:
    """The untimed warm-up prompt: the 20 highest token ids of the vocabulary."""
    vocab = int(loaded.config.vocab_size)
    return [vocab - 1 - j for j in range(20)]


def replay_in_process(engine: Any, reqs: Sequence[BenchRequest], max_run_s: float,
                      desc: str = "serve", progress: bool = True) -> tuple[list[RequestRecord], RunStats]:
    """Replay ``reqs`` (arrival offsets in seconds) against ``engine`` in real time: add each
    request once its arrival time has passed (with that time as ``arrival_time``), step the
    engine in between, sleep when idle. ``max_run_s`` seconds after the last arrival the rest
    is aborted (counted as unfinished)."""
    from tqdm.auto import tqdm

    from pagedkv.errors import InvalidRequestError

    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    st0 = engine.get_stats()
    stats = RunStats()
    records: list[RequestRecord] = [RequestRecord(0.0, expected_tokens=r.output_len) for r in reqs]
    ids = {f"r{i}": i for i in range(len(reqs))}
    bar = tqdm(total=len(reqs), desc=desc, unit="req", disable=not progress, leave=False)
    start = time.time() + 0.01
    for i, r in enumerate(reqs):
        records[i].arrival_time = start + r.arrival_s
    stats.started = start
    c0 = time.process_time()
    k = 0
    done = 0
    deadline = start + max((r.arrival_s for r in reqs), default=0.0) + max_run_s
    try:
        while True:
            now = time.time()
            while k < len(order) and records[order[k]].arrival_time <= now:
                i = order[k]
                k += 1
                try:
                    engine.add_request(f"r{i}", reqs[i].prompt_token_ids, greedy(reqs[i].output_len),
                                       arrival_time=records[i].arrival_time)
                except InvalidRequestError as exc:
                    records[i].status = "rejected"
                    stats.notes.append(f"r{i} rejected: {exc}")
                    done += 1
                    bar.update(1)
            if now > deadline:
                left = [rid for rid, i in ids.items() if records[i].status == "pending"]
                stats.notes.append(f"stopped {max_run_s:.0f}s after the last arrival: {len(left)} requests unfinished")
                engine.abort_request(left)
                while engine.has_unfinished_requests():
                    engine.step()
                for rid in left:
                    records[ids[rid]].status = "unfinished"
                break
            if engine.has_unfinished_requests():
                outs = engine.step()
                stats.steps += 1
                s = engine.get_stats()
                stats.running_samples.append(s.num_running)
                stats.kv_usage_samples.append(float(s.kv_usage))
                for o in outs:
                    if not o.finished or o.request_id not in ids:
                        continue
                    rec = records[ids[o.request_id]]
                    rec.first_token_time = o.metrics.first_token_time
                    rec.finish_time = o.metrics.finish_time
                    rec.output_tokens = len(o.token_ids)
                    rec.preemptions = o.metrics.num_preemptions
                    rec.cached_tokens = o.num_cached_tokens
                    rec.status = "ok" if o.finish_reason in ("length", "stop") else "error"
                    done += 1
                    bar.update(1)
            elif k < len(order):
                time.sleep(min(max(records[order[k]].arrival_time - time.time(), 0.0), 0.05))
            else:
                break
    finally:
        bar.close()
    stats.ended = time.time()
    stats.cpu_s = time.process_time() - c0
    st1 = engine.get_stats()
    stats.preemptions = st1.num_preemptions - st0.num_preemptions
    stats.peak_running = max(stats.running_samples, default=0)
    return records, stats


def run_cell_in_process(loaded: Any, cell: dict[str, Any], reqs: Sequence[BenchRequest],
                        args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    engine = make_engine(loaded, cell, args)
    warm_up(engine, _warm_prompt(loaded))
    records, stats = replay_in_process(engine, reqs, args.max_run_seconds, desc=cell["name"], progress=progress)
    summary = summarize_run(records, stats)
    summary["max_concurrency_by_reservation"] = engine.kv_summary()["max_concurrency_at_max_model_len"]
    return summary


# --------------------------------------------------------------------------------------------
# HTTP replay
# --------------------------------------------------------------------------------------------


def serve_flags(cell: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """``pagedkv serve`` flags for the engine of ``cell`` (the same engine as in-process)."""
    flags = ["--dtype", "float32", "--block-size", str(args.block_size), "--num-blocks", str(args.num_blocks),
             "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--threads", str(args.threads),
             "--seed", str(args.seed)]
    if getattr(args, "model", None):
        flags += ["--model", str(args.model)]
    if getattr(args, "weights", "fp32") != "fp32":
        flags += ["--weights", args.weights]
    if getattr(args, "compile_decode", False):
        flags.append("--compile-decode")
    if not cell["enable_paging"]:
        flags.append("--disable-paging")
    if cell["enable_prefix_caching"]:
        flags.append("--enable-prefix-caching")
    return flags


def run_cell_http(loaded: Any, cell: dict[str, Any], reqs: Sequence[BenchRequest], args: argparse.Namespace,
                  progress: bool = True) -> dict[str, Any]:
    """The cell against ``pagedkv serve`` over HTTP on 127.0.0.1 (``--http-server``)."""
    desc = cell["name"] + " (http)"
    if args.http_server == "thread":
        engine = make_engine(loaded, cell, args)
        warm_up(engine, _warm_prompt(loaded))
        with http.serve_in_thread(engine, args.port) as url:
            records, stats = http.replay(url, reqs, args.max_run_seconds, desc, progress)
        stats.preemptions = stats.preemptions or engine.get_stats().num_preemptions
        server = "uvicorn thread in the benchmark process"
    else:
        with http.serve_subprocess(serve_flags(cell, args), args.port) as url:
            # one warm-up request through the server, not timed
            http.replay(url, [BenchRequest(_warm_prompt(loaded), 3)], 120.0, "warm-up", False)
            records, stats = http.replay(url, reqs, args.max_run_seconds, desc, progress)
        server = "`python -m pagedkv.cli serve` subprocess"
    summary = summarize_run(records, stats)
    summary["server"] = server
    return summary


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------


def _at_rate(reqs: Sequence[BenchRequest], unit_arrivals: Sequence[float], rate: float) -> list[BenchRequest]:
    return [BenchRequest(r.prompt_token_ids, r.output_len, a / rate, r.trace_prompt_tokens, r.trace_output_tokens)
            for r, a in zip(reqs, unit_arrivals)]


def _row(name: str, rate: float, s: dict[str, Any], target: tuple[float, float],
         relaxed: Optional[tuple[float, float]] = None) -> dict[str, Any]:
    row = {"cell": name, "rate": rate, **s, "meets_target": meets_target(s, *target)}
    if relaxed is not None:
        row["meets_relaxed_target"] = meets_target(s, *relaxed)
    return row


def run_serving(args: argparse.Namespace, loaded: Any = None, progress: bool = True) -> dict[str, Any]:
    """Run the cells, the sweep and (``args.http``) the HTTP cell; ``loaded`` (a pagedkv
    LoadedModel, fp32, of ``args.model``) may be passed in to avoid reloading. Returns the results
    dict. Raises ``ConfigError`` for a ``--model`` that is missing or not a GGUF file."""
    if args.tiny:
        _apply_tiny(args)
    model = resolve_peer_model(getattr(args, "model", None))
    if model.sliding_window is not None:
        from pagedkv.errors import ConfigError

        raise ConfigError(f"--model {args.model}: {model.model_id} has sliding-window layers, and the sweep's "
                          "paging-off cells need a model without (compare it with --peer llama-server)")
    facts = RunFacts.start(args.threads)
    threads = facts.threads
    t_all = time.time()
    loaded = load_fp32_model(loaded, path=None if model.default else str(model.path), weights=args.weights)
    base, scaling = requests_from_args(args, int(loaded.config.vocab_size), args.shared_prefix_len)
    base = [replace(r, prompt_token_ids=model.with_bos(r.prompt_token_ids)) for r in base]  # Gemma-3: BOS first
    unit = poisson_arrivals(args.num_requests, 1.0, seed=args.seed + 2)
    target = (args.target_ttft_p90, args.target_tpot_p90)
    relaxed = (target[0] * args.relaxed_factor, target[1] * args.relaxed_factor) if args.relaxed_factor > 0 else None
    stop_key = "meets_relaxed_target" if relaxed is not None else "meets_target"
    cache: dict[tuple[str, float], dict[str, Any]] = {}

    def measure(cell: dict[str, Any], rate: float) -> dict[str, Any]:
        key = (cell["name"], rate)
        if key not in cache:
            t = time.time()
            s = run_cell_in_process(loaded, cell, _at_rate(base, unit, rate), args, progress)
            cache[key] = _row(cell["name"], rate, s, target, relaxed)
            log(f"[serve] {cell['name']} @ {rate:g} req/s: {s['output_tokens_per_s']:.1f} tok/s, TTFT p90 "
                f"{s['ttft_s']['p90']:.2f}s, TPOT p90 {s['tpot_s']['p90'] * 1e3:.0f}ms, preempt {s['preemptions']}, "
                f"done {s['completed']}/{s['requests']} ({time.time() - t:.0f}s)")
        return cache[key]

    cells = []
    if args.cells != "none":
        cells = [measure(c, args.rate) for c in CELLS]

    sweep: dict[str, list[dict[str, Any]]] = {}
    sustainable: dict[str, Optional[float]] = {}
    rates = sorted({float(x) for x in args.rates.split(",") if x.strip()}) if args.rates else []
    # rates outer, cells inner: paging on and off at one rate run back to back, so a change in
    # the machine's load hits both alike. A mode stops after missing the (relaxed) target at
    # --stop-after-misses rates in a row (one miss can be a burst of load from other jobs).
    misses = {c["name"]: 0 for c in CELLS[:2]}
    for c in CELLS[:2]:
        sweep[c["name"]] = []
    for r in rates:
        for cell in CELLS[:2]:
            name = cell["name"]
            if (misses[name] >= args.stop_after_misses and not args.sweep_all
                    and (name, r) not in cache):
                sweep[name].append({"cell": name, "rate": r, "skipped": "missed the "
                                    + ("relaxed target" if relaxed is not None else "target")
                                    + f" at {misses[name]} lower rates in a row"})
                continue
            row = measure(cell, r)
            sweep[name].append(row)
            misses[name] = 0 if row[stop_key] else misses[name] + 1
    sustainable_relaxed: dict[str, Optional[float]] = {}
    for name, rows in sweep.items():
        ok = [x["rate"] for x in rows if x.get("meets_target")]
        sustainable[name] = max(ok) if ok else None
        ok = [x["rate"] for x in rows if x.get("meets_relaxed_target")]
        sustainable_relaxed[name] = max(ok) if ok else None

    http_rows = []
    if args.http:
        cell = CELLS[0]
        t = time.time()
        try:
            s = run_cell_http(loaded, cell, _at_rate(base, unit, args.rate), args, progress)
            row = _row(cell["name"] + " (HTTP)", args.rate, s, target, relaxed)
            log(f"[serve] HTTP {cell['name']} @ {args.rate:g} req/s: {s['output_tokens_per_s']:.1f} tok/s, "
                f"TTFT p90 {s['ttft_s']['p90']:.2f}s ({time.time() - t:.0f}s)")
        except Exception as exc:  # noqa: BLE001 - reported in the results
            row = {"cell": cell["name"] + " (HTTP)", "rate": args.rate, "error": f"{type(exc).__name__}: {exc}"[:600]}
            log(f"[serve] HTTP failed: {row['error']}")
        http_rows.append(row)

    bpt = _bytes_per_token(loaded)
    data = {
        "benchmark": NAME,
        "description": (__doc__ or "").strip().splitlines()[0],
        "config": {
            **model.as_config(),
            "num_requests": args.num_requests,
            "rate_cells": args.rate,
            "rates_sweep": rates,
            "length_scaling": scaling.as_dict(),
            "length_scaling_text": scaling.describe(),
            "shared_prefix_len": args.shared_prefix_len,
            "seed": args.seed,
            "threads": threads,
            "dtype": "float32",
            "weights": weights_of(loaded),
            "compile_decode": bool(args.compile_decode),
            "decoding": "greedy, ignore_eos",
            "block_size": args.block_size,
            "num_blocks": args.num_blocks,
            "kv_budget_tokens": args.num_blocks * args.block_size,
            "kv_budget_bytes": args.num_blocks * args.block_size * bpt if bpt else None,
            "kv_bytes_per_token": bpt,
            "max_model_len": args.max_model_len,
            "contiguous_max_concurrency": args.num_blocks // blocks_needed(args.max_model_len, args.block_size),
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "target": {"ttft_p90_s": args.target_ttft_p90, "tpot_p90_s": args.target_tpot_p90,
                       "also": "every request completed, none rejected"},
            "relaxed_target": {"ttft_p90_s": relaxed[0], "tpot_p90_s": relaxed[1]} if relaxed else None,
            "max_run_seconds": args.max_run_seconds,
            "tiny": bool(args.tiny),
            "notes": model.note_bos(args.note, "the first token of every synthetic prompt is that BOS"),
        },
        "workload": {
            "prompt_len": summarize(r.prompt_len for r in base),
            "output_len": summarize(r.output_len for r in base),
            "prompt_tokens": sum(r.prompt_len for r in base),
            "output_tokens": sum(r.output_len for r in base),
        },
        "cells": cells,
        "sweep": sweep,
        "sustainable_rate": sustainable,
        "sustainable_rate_relaxed": sustainable_relaxed if relaxed is not None else None,
        "http": http_rows,
        "elapsed_s": time.time() - t_all,
        **facts.finish(),
    }
    return json_clean(data)


def _bytes_per_token(loaded: Any) -> Optional[int]:
    try:
        from pagedkv.kv import KVCacheSpec

        mc = loaded.config
        return int(KVCacheSpec(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                               dtype="fp32").bytes_per_token)
    except Exception:  # noqa: BLE001
        return None


def run(args: argparse.Namespace, loaded: Any = None) -> int:
    if args.peer == "openvino":  # no HTTP server of its own: offline continuous batching of both
        from pagedkv.bench.serve import offline as serve_offline

        return serve_offline.run(args)
    if args.peer:  # side by side with a peer server: its own runs and result files
        return serve_peer.run(args)
    data = run_serving(args, loaded=loaded, progress=not args.json)
    c = data["config"]
    variant = "paging" + ("" if c["weights"] == "fp32" else f"_{c['weights']}")
    variant += "_compiled" if args.compile_decode else ""
    variant += "" if c["model_is_default"] else f"_{c['model_name']}"  # never the default's
    publish(NAME, data, render_markdown, args.out_dir, variant=args.variant or variant, as_json=args.json,
            plots=None if args.no_plot else single_plot(NAME, "rate sweep", plot))
    return 0
