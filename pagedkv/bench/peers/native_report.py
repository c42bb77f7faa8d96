"""The report of the native llama.cpp comparison (:mod:`pagedkv.bench.peers.native`): the
summary (median [IQR] over rounds, per-round ratios, the goal by the lower quartile), the
Markdown table and the plot."""

from __future__ import annotations

import math
from typing import Any, Optional

from pagedkv.bench.protocol import cell, goal_check, paired_ratios, ratio_cell, spread

PAGEDKV, LLAMA_CPP = "pagedkv", "llama.cpp"
METRICS = ("decode_tokens_per_s", "prefill_tokens_per_s")


def _value(run: Optional[dict[str, Any]], metric: str) -> Optional[float]:
    """``run[metric]`` of a run that succeeded, None otherwise (or when not a finite number)."""
    v = run.get(metric) if run and run.get("status") == "ok" else None
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """``{type: {system: {metric: spread, "load_1m": spread, "failed": [...]}, "<metric>_ratio":
    spread of the per-round ratios, "goal_met": bool | None}}``."""
    goal = data["config"].get("goal_decode_ratio")
    out: dict[str, Any] = {}
    for qtype in data["config"]["types"]:
        runs = [r for r in data["runs"] if r["type"] == qtype]
        entry: dict[str, Any] = {}
        by_round: dict[str, dict[int, dict[str, Any]]] = {PAGEDKV: {}, LLAMA_CPP: {}}
        for system in (PAGEDKV, LLAMA_CPP):
            mine = [r for r in runs if r["system"] == system]
            by_round[system] = {r["round"]: r for r in mine}
            entry[system] = {m: spread([_value(r, m) for r in mine]) for m in METRICS}
            entry[system]["load_1m"] = spread([r.get("load_1m_start") for r in mine])
            entry[system]["failed"] = [f"round {r['round']}: {r['status']}: {str(r.get('reason'))[:200]}"
                                       for r in mine if r.get("status") != "ok"]
        rounds = sorted(set(by_round[PAGEDKV]) | set(by_round[LLAMA_CPP]))
        for m in METRICS:
            entry[f"{m}_ratio"] = paired_ratios([_value(by_round[PAGEDKV].get(k), m) for k in rounds],
                                                [_value(by_round[LLAMA_CPP].get(k), m) for k in rounds])
        entry["goal_met"] = goal_check(entry["decode_tokens_per_s_ratio"], goal)
        out[qtype] = entry
    return out


def _weights(data: dict[str, Any], qtype: str) -> str:
    runs = [r for r in data["runs"] if r["type"] == qtype and r["system"] == PAGEDKV and r.get("weights")]
    return f"{runs[0]['weights']} ({runs[0].get('kv_cache_dtype')} KV)" if runs else "n/a"


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    """The Markdown report."""
    from pagedkv.bench.report import closing_lines, markdown_table

    cfg, summ = data["config"], data["summary"]
    stamp = (data.get("llama_cpp") or {}).get("stamp") or {}
    rows, goal = [], cfg.get("goal_decode_ratio")
    for qtype in cfg["types"]:
        s, f = summ.get(qtype) or {}, data["files"].get(qtype) or {}
        if "error" in f:
            rows.append({"type": qtype, "pagedkv decode tok/s": f"no file: {f['error']}"})
            continue
        ours, peer = s.get(PAGEDKV) or {}, s.get(LLAMA_CPP) or {}
        met = s.get("goal_met")
        rows.append({
            "type": qtype.upper(), "file MB": f"{f['bytes'] / 1e6:.1f}",
            "pagedkv route": _weights(data, qtype),
            "pagedkv decode tok/s": cell(ours.get("decode_tokens_per_s")),
            "llama.cpp decode tok/s": cell(peer.get("decode_tokens_per_s")),
            "decode ratio": ratio_cell(s.get("decode_tokens_per_s_ratio")),
            f"goal ≥ {goal:g}x (q1)": "n/a" if met is None else ("met" if met else "NOT met"),
            "pagedkv prefill 512 tok/s": cell(ours.get("prefill_tokens_per_s")),
            "llama.cpp prefill 512 tok/s": cell(peer.get("prefill_tokens_per_s")),
            "prefill ratio": ratio_cell(s.get("prefill_tokens_per_s_ratio")),
            "load 1m (pagedkv / llama.cpp)": f"{cell(ours.get('load_1m'))} / {cell(peer.get('load_1m'))}",
        })
    failed = [f"- {q} {sys_}: {x}" for q in cfg["types"] for sys_ in (PAGEDKV, LLAMA_CPP)
              for x in ((summ.get(q) or {}).get(sys_) or {}).get("failed", [])]
    files = [f"- {q.upper()}: `{_file_name(f.get('path'))}`, {f.get('how') or f.get('error')}; tensors "
             f"{', '.join(f'{k} {v}' for k, v in sorted((f.get('tensor_types') or {}).items()))}"
             for q, f in data["files"].items()]
    machine = data["machine"]
    isa = (machine.get("cpu_isa") or {})
    lines = [
        "# Batch 1 vs native llama.cpp, per GGUF format",
        "",
        f"Model: {cfg['model_id']}. {cfg['rounds']} rounds, in each every format with both systems back to back in "
        f"alternating order; each cell is the median over the rounds [interquartile range], each run's value the "
        f"median of {cfg['repetitions']} timed repetitions. Ratios are per round (pagedkv / llama.cpp of the same "
        f"round), summarised the same way. A goal is met only when the ratios' lower quartile meets it.",
        "",
        markdown_table(rows),
        f"Decode: pagedkv = ({cfg['measure_spec']['decode_tokens']} - 1) tokens / (time of a "
        f"{cfg['measure_spec']['decode_tokens']}-token request - a 1-token one), after a "
        f"{cfg['measure_spec']['decode_prompt']}-token prompt; llama.cpp = `llama-bench` tg"
        f"{cfg['measure_spec']['decode_tokens']} (from an empty context). Prefill: one 512-token prompt / llama-bench "
        "pp512. Same file, same threads, every run a fresh process. pagedkv runs each file on its default route "
        "(`weights=auto`: the GGUF's own blocks); llama.cpp's KV cache is f16 (llama-bench's default).",
        "",
        "Files:", "", *files, "",
        f"llama.cpp: `llama-bench` from `make peers`, variant **{stamp.get('variant', 'unknown')}** "
        f"({stamp.get('why', 'no build record')}), flags `{' '.join(stamp.get('cmake_flags') or [])}`, build "
        f"{(stamp.get('smoke') or {}).get('build_commit', 'unknown')}. CPU: {data.get('cpu_model')}; pagedkv ISA "
        f"{isa_class(isa)}; {cfg['threads']} threads; commit "
        f"{machine.get('commit')}{' (dirty tree)' if machine.get('dirty') else ''}.",
    ]
    lines += ["", "## Every run (in the order run)", "", markdown_table(_runs_table(data)),
              "A decode value is missing where the run's N-token request took no longer than its 1-token one "
              "(a load spike in between): the run is kept, the estimator has nothing to divide."]
    if data.get("partial"):
        lines += ["", "**Partial**: the run was cut short; the rounds finished so far."]
    if failed:
        lines += ["", "Runs that failed (kept in the JSON):", "", *failed]
    lines += ["", f"Command: `{cfg['command']}`"]
    lines += closing_lines(data, plots, cfg.get("note"))
    return "\n".join(lines) + "\n"


def isa_class(isa: dict[str, Any]) -> str:
    """The CPU class a run's kernels ran under, from ``machine.cpu_isa``: ``AVX-512 + VNNI``,
    ``AVX2 cap on an AVX-512 host`` (``PAGEDKV_CPU_ISA=avx2`` there), ``+ AMX`` where present."""
    if not isa or "isa" not in isa:
        return str(isa.get("error", "not recorded")) if isa else "not recorded"
    name = {"avx512": "AVX-512", "avx2": "AVX2"}.get(isa["isa"], isa["isa"])
    if isa["isa"] == "avx512":
        name += " + VNNI" if isa.get("vnni") else ""
        name += " + AMX" if isa.get("amx") else ""
    if isa.get("native_isa") and isa["native_isa"] != isa["isa"]:
        name += f" cap on an {({'avx512': 'AVX-512'}).get(isa['native_isa'], isa['native_isa'])} host"
    return name


def _runs_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"round": r["round"], "type": r["type"].upper(), "system": r["system"], "status": r.get("status"),
             "decode tok/s": _fmt(_value(r, "decode_tokens_per_s")), "prefill 512 tok/s": _fmt(_value(r, "prefill_tokens_per_s")),
             "load 1m start/end": f"{_fmt(r.get('load_1m_start'), 2)}/{_fmt(r.get('load_1m_end'), 2)}",
             "wall s": _fmt(r.get("wall_s"), 0)} for r in data["runs"]]


def _fmt(x: Any, digits: int = 1) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "n/a"


def _file_name(path: Any) -> str:
    """The last component of ``path`` (``""`` for None)."""
    return str(path or "").rsplit("/", 1)[-1]


def plot(data: dict[str, Any], path: Any) -> None:
    """The per-round ratios pagedkv / llama.cpp per format (decode, prefill 512): each round a
    point coloured by the higher 1-minute load of its two runs, the median a bar, the IQR a box,
    the decode goal a dashed line (absolute tok/s swing with the shared machine's load; the
    ratio of two runs back to back much less)."""
    from pagedkv.bench.report import pyplot, save_figure

    plt = pyplot()
    cfg = data["config"]
    types = [t for t in cfg["types"] if t in data["summary"]]
    fig, (*axes, cax) = plt.subplots(1, 3, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 1, 0.04]})
    sc = None
    for ax, metric, label in zip(axes, METRICS, ("batch-1 decode", "prefill 512")):
        for i, t in enumerate(types):
            pts = _round_ratios(data, t, metric)
            s = data["summary"][t].get(f"{metric}_ratio")
            if s:
                ax.add_patch(plt.Rectangle((i - 0.25, s["q1"]), 0.5, max(s["q3"] - s["q1"], 1e-3), alpha=0.2))
                ax.plot([i - 0.25, i + 0.25], [s["median"]] * 2, color="black")
            if pts:
                sc = ax.scatter([i + 0.04 * (k - len(pts) / 2) for k in range(len(pts))], [p[0] for p in pts],
                                c=[p[1] for p in pts], cmap="viridis", vmin=0, vmax=8, zorder=3)
        if metric == "decode_tokens_per_s" and cfg.get("goal_decode_ratio"):
            ax.axhline(cfg["goal_decode_ratio"], ls="--", color="tab:red", label=f"goal {cfg['goal_decode_ratio']:g}x")
            ax.legend(loc="upper right")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(types)), [t.upper() for t in types])
        ax.set_ylabel(f"{label}: pagedkv / llama.cpp, per round")
    if sc is not None:
        fig.colorbar(sc, cax=cax, label="1-minute load (2 CPUs)")
    fig.suptitle(f"{cfg['model_id']}, {cfg['threads']} threads, {data.get('cpu_model')}: {cfg['rounds']} interleaved rounds "
                 "(box: IQR, bar: median)")
    save_figure(fig, path)


def _round_ratios(data: dict[str, Any], qtype: str, metric: str) -> list[tuple[float, float]]:
    """``(ratio, the higher load of the two runs)`` of every round of ``qtype`` with both values."""
    by: dict[int, dict[str, dict[str, Any]]] = {}
    for r in data["runs"]:
        if r["type"] == qtype:
            by.setdefault(r["round"], {})[r["system"]] = r
    out = []
    for k in sorted(by):
        a, b = _value(by[k].get(PAGEDKV), metric), _value(by[k].get(LLAMA_CPP), metric)
        if a is not None and b:
            out.append((a / b, max(x.get("load_1m_start") or 0.0 for x in by[k].values())))
    return out
