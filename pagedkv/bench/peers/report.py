"""The report of ``pagedkv bench peers``: the Markdown tables and the bar plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.bench.report import closing_lines, markdown_table, ms, pyplot, save_figure


_NOTES = (
    "Notes: transformers generate runs static batches in trace order, each left-padded and run to its "
    "longest output (tokens past a request's own length are computed but not counted; 'positions computed' "
    "counts padded prompt positions and every generated position). generate_batch is "
    "transformers' ContinuousBatchingManager with per-request max_new_tokens, the same tokens per step as "
    "pagedkv and a KV cache sized to hold all requests. llama.cpp runs one request at "
    "a time on the {weights} weights as stored (not fp32); 'pagedkv (one at a time)' runs the same requests the same "
    "way on the weights named in the title (fp32 unless --weights). The machine is shared with other jobs, so compare the "
    "ratios (measured side by side in one run) rather than absolute numbers. Output tokens per CPU-second "
    "(this process's CPU time, all threads, over the timed span) is less sensitive to other jobs than wall "
    "time."
)


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    """The Markdown report of ``run_peers``'s results (``plots``: label -> PNG file name)."""
    cfg = data["config"]
    w = data["workload"]
    weights = cfg.get("model_weights_as_stored") or "Q4_1"
    table = []
    for r in data["systems"]:
        if r["status"] != "ok":
            table.append({"system": r["name"], "output tok/s": f"{r['status']}: {r['reason']}"})
            continue
        table.append({
            "system": r["name"],
            "output tok/s": r["output_tokens_per_s"],
            "output tok/CPU-s": r["output_tokens_per_cpu_s"],
            "req/s": r["requests_per_s"],
            "TTFT p50 (s)": r["ttft_s"]["p50"],
            "TTFT p90 (s)": r["ttft_s"]["p90"],
            "TPOT p50 (ms)": ms(r["tpot_s"]["p50"]),
            "decode tok/s per request": r.get("decode_tokens_per_s", "n/a"),
            "positions computed (prompt+output)": _computed(r),
            "elapsed (s)": r["elapsed_s"],
        })
    lines = [
        "# Peers: pagedkv vs transformers and llama.cpp",
        "",
        *([f"Model: {cfg['model_id']} (`{cfg['model_file']}`, {weights} as stored), every system.", ""]
          if cfg.get("model_file") else []),
        f"{cfg['num_requests']} requests drawn from the Azure LLM conversation trace (2023), lengths scaled: "
        f"{cfg['length_scaling_text']}. Workload: {w['prompt_tokens']} prompt tokens, {w['output_tokens']} output "
        f"tokens (prompt p50 {w['prompt_len']['p50']:.0f}, output p50 {w['output_len']['p50']:.0f}). "
        f"Synthetic token-id prompts, {cfg['decoding']}, {cfg['dtype']} activations, pagedkv weights "
        f"{cfg.get('pagedkv_weights') or 'fp32'}, pagedkv KV cache "
        f"{(cfg.get('pagedkv_engine') or {}).get('kv_cache_dtype', 'auto')} (auto = float32), "
        f"{cfg['threads']} torch threads, {cfg['submission']}: TTFT includes queueing.",
        "",
        markdown_table(table),
        "Ratios pagedkv / peer (output tok/s: higher is better for pagedkv; TTFT: lower is better for pagedkv; "
        f"pagedkv = {data['goal'].get('pagedkv_run_used') or 'pagedkv'}, the slower pagedkv run):",
        "",
        markdown_table([{"peer": r["peer"], "output tok/s ratio": r["output_tok_s_ratio"],
                         "output tok/CPU-s ratio": r["output_tok_per_cpu_s_ratio"],
                         "TTFT p50 ratio": r["ttft_p50_ratio"], "TTFT p90 ratio": r["ttft_p90_ratio"]}
                        for r in data["ratios"]]),
    ]
    g = data["goal"]
    if g["ratio"] is not None:
        lines.append(f"**Goal**: pagedkv ≥ {g['target_ratio']:g}× {g['versus']} ({g['peer']}): "
                     f"measured {g['ratio']:.2f}× in output tokens/s (wall clock) — {'met' if g['met'] else 'NOT met'}; "
                     f"{g['cpu_ratio']:.2f}× in output tokens per CPU-second — "
                     f"{'met' if g.get('met_in_cpu_time') else 'NOT met'}. On a shared machine the wall-clock ratio "
                     "also carries the change in load between the runs (see the load average below); the CPU-time "
                     "ratio carries less of it.")
    else:
        lines.append("**Goal**: not measured in this run.")
    if data["greedy_agreement_with_pagedkv"]:
        lines += ["", "Greedy output agreement with pagedkv (identical requests / requests):"]
        for k, v in data["greedy_agreement_with_pagedkv"].items():
            lines.append(f"- {k}: {v['identical_requests']}/{v['requests']}, mean common prefix "
                         f"{100 * (v['mean_common_prefix_fraction'] or 0):.0f}% of the output")
    lines += ["", _NOTES.format(weights=weights)]
    if cfg.get("command"):
        lines += ["", f"Command: `{cfg['command']}`"]
    lines += closing_lines(data, plots, cfg.get("notes"))
    return "\n".join(lines) + "\n"


def _computed(r: dict[str, Any]) -> Any:
    p, o = r.get("computed_prompt_tokens"), r.get("computed_output_tokens")
    return f"{p}+{o}" if p is not None and o is not None else "n/a"


def plot(data: dict[str, Any], path: Path) -> None:
    """Output tokens/s, TTFT (p50, p90) and TPOT p50 per system, as bars."""
    plt = pyplot()
    ok = [r for r in data["systems"] if r["status"] == "ok"]
    names = [r["name"].replace("transformers ", "HF ") for r in ok]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4), sharey=True)  # names once, on the left
    a1.barh(names, [r["output_tokens_per_s"] or 0 for r in ok], color="tab:blue")
    a1.set_xlabel("output tokens/s (higher is better)")
    a1.invert_yaxis()
    a2.barh(names, [r["ttft_s"]["p50"] or 0 for r in ok], color="tab:orange", label="p50")
    a2.barh(names, [(r["ttft_s"]["p90"] or 0) - (r["ttft_s"]["p50"] or 0) for r in ok],
            left=[r["ttft_s"]["p50"] or 0 for r in ok], color="tab:orange", alpha=0.35, label="p90")
    a2.set_xlabel("TTFT, s (lower is better; all submitted at t0)")
    a2.legend(loc="lower right")
    a3.barh(names, [ms(r["tpot_s"]["p50"]) if r["tpot_s"]["p50"] else float("nan") for r in ok], color="tab:green")
    a3.set_xscale("log")
    a3.set_xlabel("TPOT p50, ms (log scale; lower is better)")
    cfg = data["config"]
    model = "" if cfg.get("model_is_default", True) else f"{cfg['model_id']}: "
    fig.suptitle(f"{model}{cfg['num_requests']} trace requests, {cfg['threads']} threads, pagedkv weights "
                 f"{cfg.get('pagedkv_weights') or 'fp32'}, greedy")
    save_figure(fig, path)
