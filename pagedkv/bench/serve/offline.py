"""``pagedkv bench serve --peer openvino``: offline continuous batching beside OpenVINO GenAI.

OpenVINO GenAI has no HTTP server (:data:`pagedkv.bench.peers.venv.OPENVINO_NO_SERVER`), and an
OpenAI server of ours around its pipeline would measure that wrapper. So this peer is measured
without HTTP on both sides, with the serving sweep's workload: for every concurrency ``c``
(default 1, 4, 16, 32), ``max(--min-requests, c x --requests-per-stream)`` requests of
``--prompt-tokens`` token-id prompts and ``--output-tokens`` outputs (EOS ignored, greedy) are
handed at once to

* **pagedkv**: ``LLM`` over the bundled GGUF with ``pagedkv serve``'s weights (``auto``),
  ``max_num_seqs = c``, float32 activations, ``--threads`` torch threads, in this process;
* **openvino**: ``ContinuousBatchingPipeline`` (paged attention, its own scheduler,
  ``max_num_seqs = c``, no prefix caching) over the int4 IR ``make peers`` converts, in its
  own venv, at most ``c`` requests in it at a time
  (:func:`pagedkv.bench.peers.worker.openvino_batched_runner`;
  :func:`pagedkv.bench.peers.worker.measure_batched`, the same code times both).

Output tokens/s = all output tokens / the wall time of the whole batch (seconds). There is no
TTFT or inter-token latency here (no streaming): the served goals' ITL column stays unmeasured
for this peer, and the results say so.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from pagedkv.bench.peers import worker as peer_worker
from pagedkv.bench.common import RunFacts, json_clean, load_average, log
from pagedkv.bench.peers.venv import OPENVINO, OPENVINO_NO_SERVER, run_venv_peer, weight_class

NAME = "serving_peer_openvino"
#: pagedkv / OpenVINO offline output tokens/s at least this, per concurrency (the served goal)
GOAL_RATIO = 1.2


def batched_spec(args: argparse.Namespace, threads: int, vocab_size: int) -> dict[str, Any]:
    """The worker's SPEC (``mode`` batched) from ``pagedkv bench serve``'s options; pagedkv's
    KV cache format follows a ``--serve-arg=--kv-cache-dtype=X`` (the served runs' flag) as
    ``pagedkv_kv_cache_dtype`` (default ``auto``)."""
    kv = next((a.split("=", 1)[1] for a in (getattr(args, "serve_arg", None) or [])
               if a.startswith("--kv-cache-dtype=")), "auto")
    return {"mode": "batched", "pagedkv_kv_cache_dtype": kv, "threads": threads, "vocab_size": vocab_size,
            "concurrency": [int(c) for c in str(args.concurrency).split(",") if c.strip()],
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "min_requests": args.min_requests, "requests_per_stream": args.requests_per_stream, "kv_cache_gib": 1}


def measure_pagedkv_batched(loaded: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """pagedkv's ``LLM`` (one engine per concurrency, ``max_num_seqs`` = c) timed by
    :func:`pagedkv.bench.peers.worker.measure_batched`. Returns the row (``status`` ok, ``batched`` rows)."""
    from pagedkv.bench.common import greedy, weights_of
    from pagedkv.engine.llm import LLM

    engines: dict[int, Any] = {}
    max_len = int(spec["prompt_tokens"]) + int(spec["output_tokens"]) + 16

    def gen_many(prompts: Any, k: int, c: int) -> Any:
        if c not in engines:
            engines.clear()
            engines[c] = LLM(loaded, dtype="float32", max_num_seqs=c, max_model_len=max_len,
                             kv_cache_dtype=spec.get("pagedkv_kv_cache_dtype", "auto"))
        outs = engines[c].generate([list(p) for p in prompts], greedy(k), use_tqdm=False)
        return [o.token_ids for o in outs]

    return {"name": "pagedkv", "status": "ok", "reason": None, "threads": spec["threads"],
            "weights": f"{weight_class('pagedkv', weights_of(loaded))}, "
                       f"KV cache {spec.get('pagedkv_kv_cache_dtype', 'auto')}",
            "batched": peer_worker.measure_batched(gen_many, spec)}


def batched_ratios(rows: list[dict[str, Any]], goal: float = GOAL_RATIO) -> list[dict[str, Any]]:
    """pagedkv / OpenVINO output tokens/s per concurrency (``missing`` where either did not run)
    and whether it reaches ``goal``."""
    by = {r["name"]: {b["concurrency"]: b for b in r.get("batched", [])} for r in rows if r["status"] == "ok"}
    ours, peer = by.get("pagedkv", {}), by.get(OPENVINO, {})
    out = []
    for c in sorted(set(ours) | set(peer)):
        if c not in ours or c not in peer:
            out.append({"concurrency": c, "missing": True})
            continue
        q = ours[c]["output_tokens_per_s"] / peer[c]["output_tokens_per_s"]
        out.append({"concurrency": c, "output_tok_s_ratio": q, "goal_output_tok_s_ratio": goal,
                    "output_tok_s_goal_met": q >= goal})
    return out


def run_offline_openvino(args: argparse.Namespace, loaded: Any = None) -> dict[str, Any]:
    """Both systems at every concurrency (pagedkv first, then OpenVINO in its venv); returns the
    results dict. OpenVINO not installed or failing is a row with its reason, not an exception."""
    from pagedkv.bench.common import load_fp32_model

    if args.tiny:
        from pagedkv.bench.serve.peer import apply_tiny

        apply_tiny(args)
    facts = RunFacts.start(args.threads)
    loaded = load_fp32_model(loaded, weights="auto")
    spec = batched_spec(args, facts.threads, int(loaded.config.vocab_size))
    rows = []
    for name in ("pagedkv", OPENVINO):
        log(f"[serve --peer openvino] {name}: offline continuous batching at {spec['concurrency']} ...")
        la = load_average()
        row = measure_pagedkv_batched(loaded, spec) if name == "pagedkv" else run_venv_peer(OPENVINO, spec)
        rows.append({**row, "load_1m_start": la, "load_1m_end": load_average()})
        for b in row.get("batched", []):
            log(f"[serve --peer openvino] {name} c={b['concurrency']}: {b['output_tokens_per_s']:.1f} output tok/s")
        if row["status"] != "ok":
            log(f"[serve --peer openvino] {name}: {row['status']}: {row['reason']}")
    data = {"benchmark": NAME, "description": (__doc__ or "").strip().splitlines()[0],
            "config": {"peer": OPENVINO, "why_offline": OPENVINO_NO_SERVER, "spec": spec, "tiny": bool(args.tiny),
                       "note": args.note, "command": command_line(args, facts.threads)},
            "rows": rows, "ratios": batched_ratios(rows), **facts.finish()}
    return json_clean(data)


def command_line(args: argparse.Namespace, threads: int) -> str:
    """The command that repeats this run."""
    return (f"pagedkv bench serve --peer openvino --threads {threads} --concurrency {args.concurrency} "
            f"--prompt-tokens {args.prompt_tokens} --output-tokens {args.output_tokens} "
            f"--requests-per-stream {args.requests_per_stream} --min-requests {args.min_requests}"
            + "".join(f" --serve-arg={a}" for a in (getattr(args, "serve_arg", None) or [])))


#: how the offline comparison is measured, as the report states it
METHOD = ("Both systems without HTTP, on the serving sweep's workload: for every concurrency c, "
          "max(min requests, c x requests per stream) requests of token-id prompts (EOS ignored, greedy) are handed "
          "at once to the engine, which runs at most c of them at a time (pagedkv: `LLM` with max_num_seqs = c in "
          "this process; OpenVINO GenAI: `ContinuousBatchingPipeline` with SchedulerConfig.max_num_seqs = c, no "
          "prefix caching, its other scheduler defaults, in its own venv, fed through add_request/step with at "
          "most c requests in it, since given all at once its scheduler ran them together even at max_num_seqs = "
          "1), after one untimed 2-token request. "
          "Output tokens/s = all output tokens / the wall time of the batch. No streaming, so no TTFT or "
          "inter-token latency: the served ITL goal cannot be checked for this peer.")


def _load(x: Any) -> str:
    return f"{x:.1f}" if isinstance(x, (int, float)) else "n/a"


def render_markdown(data: dict[str, Any], plots: Optional[dict[str, str]] = None) -> str:
    """The Markdown report: method, weights, one row per (system, concurrency), ratios and goals."""
    from pagedkv.bench.report import plot_links

    c, s = data["config"], data["config"]["spec"]
    lines = ["# Offline continuous batching: pagedkv vs OpenVINO GenAI", "", METHOD, "",
             f"Why not served: {c['why_offline']}.", "",
             f"Workload: prompts {s['prompt_tokens']} tokens, outputs {s['output_tokens']} tokens, "
             f"{s['threads']} threads for both." + (f" Note: {c['note']}." if c.get("note") else ""), "",
             "Weights:", ""]
    lines += [f"- {r['name']}: {r.get('weights') or r['status']}" for r in data["rows"]]
    lines += ["", *plot_links(plots or {}), "",
              "| system | concurrency | requests | output tokens | seconds | output tok/s | load 1m start/end |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for r in data["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']}: {str(r['reason']).splitlines()[-1][:200]} | | | | | |")
            continue
        la = f"{_load(r.get('load_1m_start'))} / {_load(r.get('load_1m_end'))} (whole system run)"
        for b in r["batched"]:
            lines.append(f"| {r['name']} | {b['concurrency']} | {b['requests']} | {b['output_tokens']} | "
                         f"{b['seconds']:.2f} | {b['output_tokens_per_s']:.1f} | {la} |")
    lines += ["", f"pagedkv / openvino output tok/s (goal ≥ {GOAL_RATIO:g}×; no ITL/TTFT offline):", ""]
    for q in data["ratios"]:
        lines.append(f"- concurrency {q['concurrency']}: " + ("not measured (a system failed)" if q.get("missing") else
                     f"{q['output_tok_s_ratio']:.2f}× — {'met' if q['output_tok_s_goal_met'] else 'NOT met'}"))
    la = data.get("load_average_1m") or {}
    lines += ["", f"Command: `{c['command']}`", "",
              f"1-minute load average at start / end: {_load(la.get('start'))} / {_load(la.get('end'))} "
              "(on 2 CPUs; other jobs share the machine).", ""]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Any) -> None:
    """Output tokens/s against concurrency, one line per system."""
    from pagedkv.bench.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in data["rows"]:
        if r["status"] == "ok":
            xs = [b["concurrency"] for b in r["batched"]]
            ax.plot(xs, [b["output_tokens_per_s"] for b in r["batched"]], marker="o", label=r["name"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests at once (max_num_seqs)")
    ax.set_ylabel("output tokens/s (higher is better)")
    ax.legend()
    s = data["config"]["spec"]
    ax.set_title(f"offline continuous batching, {s['prompt_tokens']}/{s['output_tokens']} tokens, {s['threads']} threads")
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    """Run, then write the variant ``openvino`` (or ``--variant``) of ``serving_peers.{json,md,png}``."""
    from pagedkv.bench.report import publish, single_plot
    from pagedkv.bench.serve.peer_report import RESULT_SET

    data = run_offline_openvino(args)
    publish(RESULT_SET, data, render_markdown, args.out_dir, variant=args.variant or OPENVINO, as_json=args.json,
            plots=None if args.no_plot else single_plot(NAME, "pagedkv vs OpenVINO GenAI, offline", plot))
    return 0
