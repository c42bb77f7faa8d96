"""The report of ``pagedkv bench serve``: Markdown tables, generated observations and the sweep plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.bench.report import closing_lines, markdown_table, ms, pyplot, save_figure


_DEFINITIONS = (
    "Definitions: TTFT = first token - arrival (includes queueing and the step in flight when the request "
    "arrived); TPOT = (finish - first token) / (output tokens - 1); throughput = completed / (last finish - "
    "first arrival). Low rates are arrival-bound (throughput ~ rate). The machine is shared with other jobs: "
    "compare cells measured in the same run."
)


def _table_row(r: dict[str, Any]) -> dict[str, Any]:
    if "skipped" in r:
        return {"cell": r["cell"], "rate (req/s)": r["rate"], "meets target (strict/relaxed)": f"skipped: {r['skipped']}"}
    if "error" in r:
        return {"cell": r["cell"], "rate (req/s)": r["rate"], "meets target (strict/relaxed)": f"error: {r['error']}"}
    return {
        "cell": r["cell"],
        "rate (req/s)": r["rate"],
        "done/rej/unfin": f"{r['completed']}/{r['rejected']}/{r['unfinished']}",
        "req/s": r["requests_per_s"],
        "out tok/s": r["output_tokens_per_s"],
        "TTFT p50/p90/p99 (s)": "/".join(f"{r['ttft_s'][k]:.2f}" if r["ttft_s"][k] is not None else "n/a"
                                        for k in ("p50", "p90", "p99")),
        "TPOT p50/p90/p99 (ms)": "/".join(f"{ms(r['tpot_s'][k]):.0f}" if r["tpot_s"][k] is not None else "n/a"
                                         for k in ("p50", "p90", "p99")),
        "preempt": r["preemptions"],
        "running per step (mean/peak)": f"{r['mean_running']:.1f}/{r['peak_running']}" if r["mean_running"] is not None else "n/a",
        "cached prompt tok": r["cached_prompt_tokens"],
        "meets target (strict/relaxed)": ("yes" if r["meets_target"] else "no") + (
            "/" + ("yes" if r["meets_relaxed_target"] else "no") if "meets_relaxed_target" in r else ""),
    }


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    """The Markdown report of ``run_serving``'s results (``plots``: label -> PNG file name)."""
    c = data["config"]
    w = data["workload"]
    tg = c["target"]
    budget_mib = (c["kv_budget_bytes"] or 0) / 2**20
    lines = [
        "# Serving: paging and prefix caching under Poisson arrivals",
        "",
        *([f"Model: {c['model_id']} (`{c['model_file']}`).", ""] if c.get("model_file") else []),
        f"{c['num_requests']} requests per run, lengths drawn from the Azure LLM conversation trace (2023) and "
        f"scaled: {c['length_scaling_text']} (prompt p50 {w['prompt_len']['p50']:.0f}, output p50 "
        f"{w['output_len']['p50']:.0f} tokens). Synthetic token-id prompts whose first {c['shared_prefix_len']} "
        f"tokens are a shared system prompt; {c['decoding']}; {c['dtype']} activations, "
        f"{c.get('weights', 'fp32')} linear layers"
        f"{', decode steps compiled (torch.compile)' if c.get('compile_decode') else ''}; {c['threads']} torch threads.",
        "",
        f"Same KV budget in every cell: {c['num_blocks']} blocks x {c['block_size']} tokens = {c['kv_budget_tokens']} "
        f"tokens = {budget_mib:.0f} MiB ({c['kv_bytes_per_token']} B/token); max_model_len {c['max_model_len']}, so "
        f"contiguous max reservation admits at most {c['contiguous_max_concurrency']} requests at once. "
        f"max_num_seqs {c['max_num_seqs']}, max_num_batched_tokens {c['max_num_batched_tokens']}.",
        "",
        f"Latency target: p90 TTFT <= {tg['ttft_p90_s']:g} s and p90 TPOT <= {tg['tpot_p90_s'] * 1000:g} ms, "
        f"{tg['also']}" + (f"; relaxed target: p90 TTFT <= {c['relaxed_target']['ttft_p90_s']:g} s and p90 TPOT "
                            f"<= {c['relaxed_target']['tpot_p90_s'] * 1000:g} ms" if c.get("relaxed_target") else "")
        + f". Runs still busy {c['max_run_seconds']:.0f} s after their last arrival are cut (the rest counts as "
        "unfinished).",
        "",
    ]
    if data["cells"]:
        lines += [f"## Cells at {c['rate_cells']:g} requests/s", "", markdown_table([_table_row(r) for r in data["cells"]])]
    if data["sweep"]:
        lines += ["## Rate sweep (prefix caching off)", ""]
        relaxed_rates = data.get("sustainable_rate_relaxed") or {}
        for name, rate in data["sustainable_rate"].items():
            line = (f"- **{name}**: highest rate meeting the target: "
                    f"{'%g req/s' % rate if rate is not None else 'none of the rates tried'}")
            if name in relaxed_rates:
                rr = relaxed_rates[name]
                line += f"; the relaxed target: {'%g req/s' % rr if rr is not None else 'none of the rates tried'}"
            lines.append(line)
        lines += ["", markdown_table([_table_row(r) for rows in data["sweep"].values() for r in rows])]
        lines.append("Rates are a grid: the sustainable rate lies between the highest passing rate and the next one. "
                     "Paging on and off run back to back at each rate; a burst of load from other jobs can still make "
                     "one rate look worse than a higher one.")
        lines.append("")
    if data["sweep"]:
        lines += ["## Reading the numbers", ""] + _reading(data) + [""]
    if data["http"]:
        lines += ["## Over HTTP (`pagedkv serve`, streamed /v1/completions on 127.0.0.1)", "",
                  markdown_table([_table_row(r) for r in data["http"]])]
        srv = next((r.get("server") for r in data["http"] if r.get("server")), None)
        if srv:
            lines.append(f"Server: {srv}; TTFT = first streamed text chunk.")
        lines.append("")
    lines += [_DEFINITIONS] + closing_lines(data, plots, c.get("notes"))
    return "\n".join(lines) + "\n"


def _misses(r: dict[str, Any], ttft_p90: float, tpot_p90: float) -> list[str]:
    out = []
    if r["completed"] < r["requests"]:
        out.append(f"{r['requests'] - r['completed']} requests not completed")
    t, p = r["ttft_s"]["p90"], r["tpot_s"]["p90"]
    if t is not None and t > ttft_p90:
        out.append(f"p90 TTFT {t:.2f} s > {ttft_p90:g} s")
    if p is not None and p > tpot_p90:
        out.append(f"p90 TPOT {p * 1000:.0f} ms > {tpot_p90 * 1000:g} ms")
    return out


def _reading(data: dict[str, Any]) -> list[str]:
    """Generated observations: which limit binds for each mode, and the ratio of rates."""
    c = data["config"]
    tg, rt = c["target"], c.get("relaxed_target")
    lines = []
    for name, rows in data["sweep"].items():
        done = [r for r in rows if "skipped" not in r and "error" not in r]
        if not done:
            continue
        low = min(done, key=lambda r: r["rate"])
        why = _misses(low, tg["ttft_p90_s"], tg["tpot_p90_s"])
        if why:
            lines.append(f"- {name}: at its lowest rate ({low['rate']:g} req/s) the strict target is missed by "
                         + " and ".join(why) + ".")
        peak = max(done, key=lambda r: r["output_tokens_per_s"])
        lines.append(f"- {name}: highest measured throughput {peak['output_tokens_per_s']:.1f} output tok/s "
                     f"({peak['requests_per_s']:.2f} req/s completed) at {peak['rate']:g} req/s offered; "
                     f"peak {peak['peak_running']} requests running at once.")
    sr = data.get("sustainable_rate_relaxed") or {}
    on, off = sr.get("paging on"), sr.get("paging off")
    if rt and on and off:
        lines.append(f"- Relaxed target: paging sustains {on:g} req/s against {off:g} req/s without it "
                     f"({on / off:.1f}x) in the same {c['kv_budget_tokens']}-token KV budget: contiguous reservation "
                     f"runs at most {c['contiguous_max_concurrency']} requests, so arrivals queue and TTFT grows, "
                     "while paged blocks let more requests share the batch.")
    lines.append("- The trade-off shows in TPOT: with more requests admitted, their prefill chunks share steps "
                 "with the running decodes (chunked prefill, "
                 f"{c['max_num_batched_tokens']} tokens per step), so paging's p90 TPOT sits above the "
                 "contiguous baseline's, which rarely has more than two requests in a step.")
    return lines


def plot(data: dict[str, Any], path: Path) -> None:
    """The sweep: p90 TTFT, p90 TPOT and output tokens/s against the arrival rate."""
    plt = pyplot()
    c = data["config"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    rt = c.get("relaxed_target") or {}
    panels = [("ttft_s", "p90 TTFT (s)", c["target"]["ttft_p90_s"], rt.get("ttft_p90_s"), 1.0),
              ("tpot_s", "p90 TPOT (ms)", c["target"]["tpot_p90_s"] * 1000,
               rt["tpot_p90_s"] * 1000 if rt else None, 1000.0),
              ("output_tokens_per_s", "output tokens/s", None, None, 1.0)]
    for ax, (key, label, tgt, rtgt, mult) in zip(axes, panels):
        for name, rows in data["sweep"].items():
            pts = [(r["rate"], r[key]["p90"] if isinstance(r.get(key), dict) else r.get(key))
                   for r in rows if "skipped" not in r and "error" not in r]
            pts = [(x, y * mult) for x, y in pts if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        if tgt is not None:
            ax.axhline(tgt, color="grey", linestyle="--", linewidth=1, label="target")
        if rtgt is not None:
            ax.axhline(rtgt, color="grey", linestyle=":", linewidth=1, label="relaxed target")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Serving sweep: KV budget {c['kv_budget_tokens']} tokens, max_model_len {c['max_model_len']}, "
                 f"{c['threads']} threads")
    save_figure(fig, path)
