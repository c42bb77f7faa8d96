"""The reports of ``pagedkv bench ablation``: the four cells (with a plot) and the sharing goals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.bench.report import closing_lines, markdown_table, pyplot, save_figure

#: the ablation table: (column, key of a cell's result, percentile for the TTFT columns)
_CELL_COLUMNS = [
    ("cell", "cell", None),
    ("slots allocated (mean)", "kv_slots_allocated_mean", None),
    ("effective tokens (mean)", "effective_tokens_mean", None),
    ("effective / slot", "effective_per_allocated_slot", None),
    ("peak slots", "kv_slots_allocated_peak", None),
    ("peak concurrency", "peak_concurrency", None),
    ("out tok/s", "output_tokens_per_s", None),
    ("turns/s", "turns_per_s", None),
    ("TTFT mean s", "ttft_s", "mean"),
    ("TTFT p90 s", "ttft_s", "p90"),
    ("tokens computed", "tokens_computed", None),
    ("hit rate", "prefix_hit_rate", None),
    ("preempt", "preemptions", None),
]


def render_ablation(data: dict[str, Any], plots: dict[str, str]) -> str:
    """The Markdown report of the four cells (``plots``: label -> PNG file name)."""
    cfg, wl = data["config"], data["workload"]
    rows = [{label: c[key][q] if q else c[key] for label, key, q in _CELL_COLUMNS} for c in data["cells"]]
    base = {c["cell"]: c for c in data["cells"]}
    off_off, on_on = base["paging off, caching off"], base["paging on, caching on"]
    lines = [
        "# Ablation: paging x prefix caching",
        "",
        "`pagedkv bench ablation --part ablation` (seed §07: the two switches measured separately, "
        "same workload, same KV budget).",
        "",
        f"Workload: a {wl['system_prompt_tokens']}-token system prompt shared by every request; "
        f"{wl['conversations']} conversations x {wl['turns']} turns, each turn = the previous turn's prompt + "
        f"its {wl['output_tokens_per_turn']}-token answer + a {wl['user_tokens_per_turn']}-token user message "
        f"(longest {wl['longest_conversation_tokens']} tokens); {wl['arrivals']}. Greedy, ignore_eos.",
        "",
        f"KV budget: {cfg['num_blocks']} blocks x {cfg['block_size']} = {cfg['kv_budget_tokens']} slots in every cell; "
        f"paging off reserves {cfg['contiguous_reservation_blocks']} blocks (max_model_len {cfg['max_model_len']}) "
        f"per request. Token budget {cfg['max_num_batched_tokens']}/step. Model {cfg['model']}, fp32, "
        f"torch threads pinned to {cfg['threads']}.",
        "",
        markdown_table(rows),
        f"Same outputs in all four cells: **{data['same_outputs']}**.",
        "",
        "Reading the numbers:",
        "",
        "- *slots allocated* are blocks in use x block size, sampled at every forward pass; *effective "
        "tokens* are the positions the live requests' tables cover (a shared prefix counts once per "
        "request, so with caching it can exceed the slots: effective / slot > 1 means sharing).",
        "- Paging alone (row 3 vs 1) changes what is *allocated*: no reservation, so more requests fit "
        "the budget (peak concurrency). Caching alone (row 2 vs 1) changes what is *computed* (tokens "
        "computed, TTFT). Note that with paging off the KV manager still maps the cached prefix "
        "blocks into the request's reservation (the reservation is counted in table entries), so "
        "here caching also saves slots and raises concurrency; a truly contiguous cache would have "
        "to copy the prefix into each request's region and keep the reservation's full size.",
        f"- Paging off fits {cfg['num_blocks']} // {cfg['contiguous_reservation_blocks']} = "
        f"{cfg['num_blocks'] // cfg['contiguous_reservation_blocks']} reservations, the most that run at once "
        "without caching.",
        f"- Both (row 4): {on_on['peak_concurrency']} vs {off_off['peak_concurrency']} requests at once, "
        f"{on_on['output_tokens_per_s'] / off_off['output_tokens_per_s']:.2f}x the output throughput, "
        f"{on_on['ttft_s']['mean'] / off_off['ttft_s']['mean']:.2f}x the mean TTFT, "
        f"{on_on['tokens_computed'] / off_off['tokens_computed']:.2f}x the tokens computed.",
    ]
    return "\n".join(lines + closing_lines(data, plots)) + "\n"


def render_sharing(data: dict[str, Any], plots: dict[str, str]) -> str:
    """The Markdown report of the sharing goals (no plots)."""
    pt, ps = data["prefix_ttft"], data["parallel_sampling"]
    lines = [
        "# Sharing: prefix caching TTFT and parallel-sampling blocks",
        "",
        "`pagedkv bench ablation --part sharing`; the issue-4 performance goals. Bundled model, fp32, "
        f"CPU, torch threads pinned to {data['threads']}; block size {pt['block_size']}, "
        f"{pt['max_num_batched_tokens']} tokens per step.",
        "",
        f"## Prefix caching: a {pt['prefix_tokens']}-token system prompt + a {pt['suffix_tokens']}-token "
        f"question per request, {pt['output_tokens']} answer tokens",
        "",
    ]
    rows = []
    for mode in ("burst", "sequential"):
        if mode not in pt:
            continue
        m = pt[mode]
        for key in ("off", "on"):
            r = m[key]
            rows.append({"arrivals": f"{mode} ({m['requests']} requests)", "caching": key,
                         "TTFT mean s": r["ttft_s"]["mean"], "TTFT p50 s": r["ttft_s"]["p50"],
                         "TTFT p90 s": r["ttft_s"]["p90"], "tokens computed": r["tokens_computed"],
                         "hit rate": r["prefix_hit_rate"], "wall s": r["wall_s"]})
    lines.append(markdown_table(rows))
    for mode in ("burst", "sequential"):
        if mode in pt:
            m = pt[mode]
            warm = m.get("ttft_mean_ratio_on_off_after_first")
            lines.append(f"- {mode}: mean TTFT on/off = **{m['ttft_mean_ratio_on_off']:.3f}** "
                         f"(p50 {m['ttft_p50_ratio_on_off']:.3f}"
                         + (f"; requests 2..{m['requests']}, cache warm: {warm:.3f}" if warm is not None else "")
                         + f"; goal {m['goal']}), same outputs: {m['same_outputs']} -> goal met: **{m['goal_met']}**")
    lines += [
        "",
        "Burst: all requests submitted at t=0 (TTFT includes queueing behind other prefills); "
        "sequential: one request at a time (TTFT = its own prefill; the first request finds the "
        "cache cold in both runs). Every request's prompt is the same system prompt + its own "
        "question, so the hit is the system prompt's whole blocks (992 of 1016 tokens at block 16).",
        "The off and on runs execute one after the other on a shared machine, so their ratio moves "
        "with the machine's load"
        + (f" (1-minute load average {data['load_average_1min']['start']:.1f} at the start, "
           f"{data['load_average_1min']['end']:.1f} at the end, on {data['machine']['cpu_count']} CPUs)"
           if data.get("load_average_1min", {}).get("start") is not None else "")
        + ". In the burst, requests wait while the first one is still prefilling the system "
        "prompt (the scheduler does not admit a request whose next prefix block another request is "
        "computing), then hit all of it.",
        "",
        f"## Parallel sampling: n={ps['n']}, a {ps['prompt_tokens']}-token prompt, {ps['new_tokens']} new tokens",
        "",
        markdown_table([
            {"run": f"n={ps['n']} (one prefill, forked tables)", "peak KV blocks": ps["parallel"]["peak_used_blocks"],
             "tokens computed": ps["parallel"]["tokens_computed"], "CoW copies": ps["parallel"]["cow_copies"],
             "wall s": ps["parallel"]["wall_s"]},
            {"run": f"{ps['n']} independent requests (seeds s..s+{ps['n'] - 1})",
             "peak KV blocks": ps["independent"]["peak_used_blocks"],
             "tokens computed": ps["independent"]["tokens_computed"], "CoW copies": 0,
             "wall s": ps["independent"]["wall_s"]},
        ]),
        f"Peak blocks ratio = **{ps['peak_blocks_ratio']:.3f}** (goal {ps['goal']}); every sample equals its "
        f"independent twin: {ps['same_outputs']} -> goal met: **{ps['goal_met']}**.",
        "",
        "Peak KV blocks: blocks in use right after a step's allocation, the maximum over the run.",
    ]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    """KV slots vs effective tokens, peak concurrency, throughput and TTFT per cell."""
    plt = pyplot()
    cells = data["cells"]
    names = [c["cell"].replace(", ", "\n") for c in cells]
    colors = ["#bbbbbb", "#8da0cb", "#66c2a5", "#fc8d62"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    ax = axes[0]
    x = range(len(cells))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [c["kv_slots_allocated_mean"] for c in cells], w, label="slots allocated", color="#999999")
    ax.bar([i + w / 2 for i in x], [c["effective_tokens_mean"] for c in cells], w, label="effective tokens", color="#1b9e77")
    ax.axhline(data["config"]["kv_budget_tokens"], color="k", ls="--", lw=1, label="budget")
    ax.set_title("KV slots vs effective tokens (mean)")
    ax.legend(fontsize=8, loc="upper left")
    for ax, key, title in [
        (axes[1], "peak_concurrency", "peak concurrency (requests)"),
        (axes[2], "output_tokens_per_s", "throughput (output tokens/s)"),
        (axes[3], None, "TTFT mean (s)"),
    ]:
        vals = [c[key] if key else c["ttft_s"]["mean"] for c in cells]
        bars = ax.bar(x, vals, color=colors)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(title)
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=8)
    fig.suptitle("paging x prefix caching, same workload and KV budget"
                 + ("" if data["same_outputs"] else " (OUTPUTS DIFFER)"))
    save_figure(fig, path)
