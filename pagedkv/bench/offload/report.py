"""Markdown and PNG of ``pagedkv bench offload`` (:mod:`pagedkv.bench.offload.run`)."""

from __future__ import annotations

from typing import Any

from pagedkv.bench.report import closing_lines, markdown_table, save_figure, single_plot


def _rows(conv: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for cell, r in conv["cells"].items():
        tiers = r["tiers"]
        moved = r["transfer"].get("bytes", {})
        secs = r["transfer"].get("seconds", {})
        rows.append({
            "tiers": cell, "TTFT p50 ms": 1000 * r["ttft_s"]["p50"], "TTFT mean ms": 1000 * r["ttft_s"]["mean"],
            "x p50 vs none": r.get("ttft_p50_ratio", 1.0), "prefix tokens recomputed": r["prefix_tokens_recomputed"],
            "x recomputed vs none": r.get("recomputed_ratio", 1.0),
            "hit tokens pool/host/disk": f"{r['pool_hit_tokens']}/{tiers.get('host', {}).get('hit_tokens', 0)}/"
                                         f"{tiers.get('disk', {}).get('hit_tokens', 0)}",
            "MB moved": sum(moved.values()) / 1e6, "copy s": sum(secs.values()), "s in requests": r["wall_s"],
        })
    return rows


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    conv, rs = data["conversations"], data["restart"]
    tiny = ", --tiny" if data["tiny"] else ""
    lines = ["# KV tiers: offload to host memory and disk, restarts", "",
             f"`pagedkv bench offload` on {data['model']} (fp32, torch threads {data['threads']}{tiny}).", ""]
    lines += [
        f"## Multi-turn conversations ({conv['conversations']} chats x {conv['turns']} turns: a "
        f"{conv['first_user_tokens']}-token first message, then {conv['user_tokens']}-token messages; "
        f"{conv['answer_tokens']}-token answers; block {conv['block_size']})",
        "",
        f"Primary pool {conv['pool_blocks']} blocks = {conv['pool_fraction']:.3f} of the working set "
        f"({conv['working_set_blocks']} blocks, {conv['block_bytes']} B each). One request at a time, round robin "
        "over the chats; every turn resends the whole history. Goal: " + conv["goal"] + ". Outputs equal in "
        f"every cell: **{conv['same_outputs']}**.",
        "",
        markdown_table(_rows(conv)),
        "",
        "## TTFT after a restart",
        "",
        f"A {rs['prefix_tokens']}-token prefix stored on disk by one engine (closed: its cached blocks "
        f"persisted); a new engine on the same store gets prefix + a new {rs['question_tokens']}-token question. "
        f"Median TTFT restart / cold: **{rs['ttft_median_ratio']:.3f}** (goal {rs['goal']}; met: {rs['goal_met']}); "
        f"outputs equal: {rs['same_outputs']}. Restart TTFTs (s): "
        + ", ".join(f"{x:.3f}" for x in rs["ttft_restart_s"]) + "; cold: "
        + ", ".join(f"{x:.3f}" for x in rs["ttft_cold_s"]) + f"; cached tokens by tier: {rs['cached_tokens_by_tier']}.",
    ]
    if data.get("note"):
        lines += ["", data["note"]]
    return "\n".join(lines + closing_lines(data, plots)) + "\n"


def _draw(data: dict[str, Any], path: Any) -> None:
    from pagedkv.bench.report import pyplot

    plt = pyplot()
    conv, rs = data["conversations"], data["restart"]
    cells = list(conv["cells"])
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12, 4))
    a.bar(cells, [1000 * conv["cells"][k]["ttft_s"]["p50"] for k in cells], color="#4c72b0")
    a.set_ylabel("TTFT p50 (ms)")
    a.set_title("multi-turn TTFT")
    b.bar(cells, [conv["cells"][k]["prefix_tokens_recomputed"] for k in cells], color="#dd8452")
    b.set_ylabel("prefix tokens recomputed")
    b.set_title(f"pool = {conv['pool_fraction']:.2f} of working set")
    c.bar(["cold", "after restart"], [1000 * sorted(rs["ttft_cold_s"])[len(rs["ttft_cold_s"]) // 2],
                                      1000 * sorted(rs["ttft_restart_s"])[len(rs["ttft_restart_s"]) // 2]],
          color=["#8c8c8c", "#55a868"])
    c.set_ylabel("TTFT median (ms)")
    c.set_title(f"{rs['prefix_tokens']}-token prefix")
    save_figure(fig, path)


plots = single_plot("offload", "TTFT and recomputation with KV tiers", _draw)
