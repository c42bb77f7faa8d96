"""Markdown and PNG of ``pagedkv bench route`` (:mod:`pagedkv.bench.route.run`)."""

from __future__ import annotations

from typing import Any

from pagedkv.bench.report import closing_lines, markdown_table, pyplot, save_figure, single_plot


def _rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, p in data["policies"].items():
        rows.append({"policy": name, "completed": f"{p['completed']}/{p['requests']}",
                     "prefix hit rate": p["hit_rate"],
                     "hit rate per round": " / ".join(f"{x:.3f}" for x in p["hit_rate_per_round"]),
                     "TTFT p50 ms": 1000 * p["ttft_s"]["p50"], "TTFT mean ms": 1000 * p["ttft_s"]["mean"],
                     "TTFT p90 ms": 1000 * p["ttft_s"]["p90"],
                     "requests per replica": " / ".join(str(r) for r in p["routed_per_replica"][0])})
    return rows


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    c, u = data["conversations"], data["uniform"]
    tiny = ", --tiny" if data["tiny"] else ""
    lines = ["# Data-parallel replicas: prefix-aware vs round-robin routing", "",
             f"`pagedkv bench route` on {data['model']}: {data['replicas']} replicas on Ray Serve (one machine, "
             f"loopback HTTP through the ingress), {data['weights']} weights, torch threads {data['replica_threads']} per "
             f"replica{tiny}.", "",
             f"## Conversations ({c['users']} users x {c['turns']} turns: a {c['system_tokens']}-token system prompt "
             f"per user + a {c['question_tokens']}-token question, {c['answer_tokens']}-token greedy answers; "
             f"{c['concurrency']} streams)", "",
             f"Each replica's pool: {data['num_blocks_per_replica']} blocks of {data['block_size']} tokens, i.e. "
             f"{c['pool_fraction']:.2f} of all users' system prompts ({c['system_prompt_blocks']} blocks) plus the "
             f"requests in flight. Cold caches before every run; runs in the order {', '.join(c['order'])}.", "",
             markdown_table(_rows(data)),
             f"**Prefix-aware / round-robin: hit rate {data['hit_rate_ratio']:.2f}x (goal >= 2), "
             f"TTFT p50 {data['ttft_p50_ratio']:.2f}x (goal <= 0.6); same outputs in every run: {data['same_outputs']} "
             f"({data['requests_with_differing_outputs']} of {data['conversations']['requests']} requests differ).**", "",
             f"## Uniform mix ({u['requests']} requests, {u['prompt_tokens']}-token prompts with no shared prefix, "
             f"{u['answer_tokens']}-token answers, {u['concurrency']} streams, prefix-aware)", ""]
    load = u["load"] or {}
    means = load.get("mean_per_replica", [])
    lines += [f"Requests per replica: {' / '.join(str(r) for r in u['routed_per_replica'])}; mean running + "
              f"waiting requests per replica (sampled every 100 ms while busy, {load.get('samples', 0)} samples): "
              f"{' / '.join(f'{m:.2f}' for m in means)}; **busiest / mean = {load.get('max_over_mean', float('nan')):.2f} "
              "(goal <= 1.5)**."]
    lines += ["", "Goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in data["goals"].items()) + "."]
    lines += closing_lines(data, plots, data.get("notes"))
    return "\n".join(lines) + "\n"


def _draw(data: dict[str, Any], path: Any) -> None:
    plt = pyplot()
    names = list(data["policies"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(names, [data["policies"][n]["hit_rate"] for n in names], color=["#999", "#2a7"])
    axes[0].set_title("prefix hit rate (cached / prompt tokens)")
    axes[1].bar(names, [1000 * data["policies"][n]["ttft_s"]["p50"] for n in names], color=["#999", "#2a7"])
    axes[1].set_title("TTFT p50, ms")
    means = (data["uniform"]["load"] or {}).get("mean_per_replica", [])
    axes[2].bar([f"replica {i}" for i in range(len(means))], means, color="#47a")
    axes[2].set_title("uniform mix: mean running + waiting")
    save_figure(fig, path)


def plots(data: dict[str, Any], out_dir: Any) -> dict[str, str]:
    return single_plot("route", "prefix hit rate, TTFT p50 and load per replica", _draw)(data, out_dir)
