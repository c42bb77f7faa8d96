"""The report of the native llama.cpp comparison (:mod:`pagedkv.bench.peers_native`): the
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


def _file_name(path: Any) -> str:
    """The last component of ``path`` (``""`` for None)."""
    return str(path or "").rsplit("/", 1)[-1]


def plot(data: dict[str, Any], path: Any) -> None:
    """Decode and prefill tok/s per format, both systems: bars at the median, whiskers the IQR."""
    from pagedkv.bench.report import pyplot, save_figure

    plt = pyplot()
    types = [t for t in data["config"]["types"] if t in data["summary"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, label in zip(axes, METRICS, ("batch-1 decode tok/s", "prefill 512 tok/s")):
        for j, (system, color) in enumerate(((PAGEDKV, "tab:blue"), (LLAMA_CPP, "tab:orange"))):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(types))]
            ss = [(data["summary"][t].get(system) or {}).get(metric) for t in types]
            med = [s["median"] if s else 0 for s in ss]
            err = [[(s["median"] - s["q1"]) if s else 0 for s in ss], [(s["q3"] - s["median"]) if s else 0 for s in ss]]
            ax.bar(xs, med, 0.38, yerr=err, capsize=3, color=color, label=system)
        ax.set_xticks(range(len(types)), [t.upper() for t in types])
        ax.set_ylabel(label + " (higher is better)")
        ax.legend()
    cfg = data["config"]
    fig.suptitle(f"{cfg['model_id']}, {cfg['threads']} threads, {data.get('cpu_model')}: median of {cfg['rounds']} "
                 "interleaved rounds, whiskers IQR")
    save_figure(fig, path)
