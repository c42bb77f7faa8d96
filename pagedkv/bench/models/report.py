"""``pagedkv bench models``: the summary (median and IQR of every metric over the rounds),
the Markdown table and the plot. A system or metric with no value says why ("not measured:
<why>", "killed at N GB"), never drops out."""

from __future__ import annotations

from typing import Any, Optional

from pagedkv.bench.protocol import cell, spread

GB = 1e9
METRICS = ("cold_load_s", "cold_load_peak_rss_bytes", "warm_load_s", "peak_rss_bytes", "cache_bytes", "decode_tokens_per_s",
           "prefill_tokens_per_s", "decode_fraction_of_limit", "round_bandwidth_bytes_per_s", "decode_fraction_of_round_limit")


def _ok(rec: Optional[dict[str, Any]]) -> bool:
    return bool(rec) and rec.get("status") == "ok"


def run_metrics(system: str, run: dict[str, Any], file_bytes: int, bandwidth: float) -> dict[str, Any]:
    """The metric values of one round of ``system`` (None where that part did not succeed)."""
    m: dict[str, Any] = dict.fromkeys(METRICS)
    cold, warm = run.get("cold") or {}, run.get("warm") or {}
    if _ok(cold):
        m["cold_load_s"] = cold.get("load_s")
        m["cold_load_peak_rss_bytes"] = cold.get("ru_maxrss")
    if _ok(warm):
        m["warm_load_s"] = warm.get("load_s")
    if system == "pagedkv":
        if _ok(cold):
            m["cache_bytes"] = run.get("cache_bytes")
        meas = ((warm.get("child") or {}).get("measure") or {}) if _ok(warm) else {}
        m["decode_tokens_per_s"] = meas.get("decode_tokens_per_s")
        m["prefill_tokens_per_s"] = meas.get("prefill_tokens_per_s")
        m["peak_rss_bytes"] = warm.get("ru_maxrss") if _ok(warm) and not run.get("skipped") else None
    else:
        bench = run.get("bench") or {}
        m["cache_bytes"] = 0 if _ok(cold) else None  # llama.cpp writes no cache: it maps the file
        if _ok(bench):
            m["decode_tokens_per_s"] = bench.get("decode_tokens_per_s")
            m["prefill_tokens_per_s"] = bench.get("prefill_tokens_per_s")
            m["peak_rss_bytes"] = bench.get("ru_maxrss")
    if m["decode_tokens_per_s"] and file_bytes and bandwidth:
        m["decode_fraction_of_limit"] = m["decode_tokens_per_s"] / (bandwidth / file_bytes)
    probes = [v for v in ((run.get("bandwidth") or {}).get(k) for k in ("before", "after")) if v]
    if probes:  # the bandwidth probed around this round (runs of older results have none)
        m["round_bandwidth_bytes_per_s"] = sum(probes) / len(probes)
        if m["decode_tokens_per_s"] and file_bytes:
            m["decode_fraction_of_round_limit"] = m["decode_tokens_per_s"] / (m["round_bandwidth_bytes_per_s"] / file_bytes)
    return m


def why_missing(system: dict[str, Any], part: str) -> str:
    """Why ``part`` (``cold`` | ``warm`` | ``bench``) of a system has no value: the system's
    own reason, else the first round whose part did not succeed."""
    if system.get("status") not in ("ok", "killed") and system.get("reason"):
        return f"not measured: {system['reason']}"
    for run in system.get("runs", []):
        if run.get("skipped") and part in ("warm", "bench"):  # --load-only: the run part was not made
            return f"not measured: {run['skipped']}"
        rec = run.get(part) or {}
        if rec and rec.get("status") != "ok":
            return _short(rec)
    if system.get("reason"):
        return str(system["reason"])
    return "not measured"


def _short(rec: dict[str, Any]) -> str:
    status, reason = rec.get("status"), str(rec.get("reason") or "")
    if status == "killed_rss":
        return reason.split(" (")[0]
    if status == "not measured":
        return f"not measured: {reason}"
    return f"{status}: {reason.splitlines()[-1][:120] if reason else ''}".strip()


def summarize_model(entry: dict[str, Any], bandwidth: float) -> dict[str, Any]:
    """Per system: every metric's :func:`spread` over the rounds, and why a metric has none."""
    # the bytes a batch-1 step reads: the file's, or with experts only the routed ones' share
    file_bytes = ((entry.get("file") or {}).get("weight_bytes") or {}).get("per_token") \
        or (entry.get("file") or {}).get("bytes") or 0
    out: dict[str, Any] = {"weight_read_limit_tokens_per_s": bandwidth / file_bytes if file_bytes else None}
    for name, system in entry.get("systems", {}).items():
        per_run = [run_metrics(name, r, file_bytes, bandwidth) for r in system.get("runs", [])]
        s: dict[str, Any] = {m: spread([r[m] for r in per_run]) for m in METRICS}
        part_of = {"cold_load_s": "cold", "cold_load_peak_rss_bytes": "cold", "warm_load_s": "warm", "cache_bytes": "cold"}
        default_part = "warm" if name == "pagedkv" else "bench"
        s["missing"] = {m: why_missing(system, part_of.get(m, default_part)) for m in METRICS if s[m] is None}
        if not any(r.get("bandwidth") for r in system.get("runs", [])):
            for m in ("round_bandwidth_bytes_per_s", "decode_fraction_of_round_limit"):
                s["missing"][m] = "not probed (a run from before the per-round probes)"
        out[name] = s
    ours, peer = out.get("pagedkv") or {}, out.get("llama.cpp") or {}
    for m in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        a, b = ours.get(m), peer.get(m)
        out[f"{m}_ratio"] = a["median"] / b["median"] if a and b and b["median"] else None
    return out


# ---- Markdown -----------------------------------------------------------------------------------------
COLUMNS = (  # (metric, header, scale, digits)
    ("cold_load_s", "cold load s", 1.0, 1), ("cold_load_peak_rss_bytes", "cold-load peak RSS GB", GB, 2),
    ("warm_load_s", "warm load s", 1.0, 1), ("peak_rss_bytes", "run peak RSS GB", GB, 2), ("cache_bytes", "cache GB", GB, 2),
    ("decode_tokens_per_s", "decode tok/s", 1.0, 1), ("prefill_tokens_per_s", "prefill 512 tok/s", 1.0, 1),
    ("decode_fraction_of_limit", "decode / weight-read limit", 1.0, 2),
    ("round_bandwidth_bytes_per_s", "read GB/s around the round", GB, 1),
    ("decode_fraction_of_round_limit", "decode / the round's read limit", 1.0, 2),
)


#: the columns of a ``--load-only`` run (start-up only)
LOAD_COLUMNS = tuple(c for c in COLUMNS if c[0] in ("cold_load_s", "cold_load_peak_rss_bytes", "warm_load_s", "cache_bytes"))


def table_rows(data: dict[str, Any]) -> list[str]:
    columns = LOAD_COLUMNS if data["config"].get("load_only") else COLUMNS
    head = "| model | type | file GB | system | " + " | ".join(c[1] for c in columns) + " |"
    lines = [head, "|" + "---|" * 4 + "---:|" * len(columns)]
    for e in data["models"]:
        f = e.get("file") or {}
        size = f"{f['bytes'] / GB:.2f}" if f.get("bytes") else "n/a"
        summ = e.get("summary") or {}
        for name in ("pagedkv", "llama.cpp"):
            s = summ.get(name)
            sysrec = e.get("systems", {}).get(name, {})
            if s is not None and sysrec.get("status") in ("not measured", "killed"):
                s = None
            if s is None and sysrec.get("status") == "killed":
                cells = [f"{sysrec.get('reason')}: in the cold load of round 1 (no later round tried)"] + [""] * (len(columns) - 1)
            elif s is None:
                cells = [f"not measured: {sysrec.get('reason') or f.get('error') or 'no runs'}"] + [""] * (len(columns) - 1)
            else:
                cells = [cell(s[m], scale, d, s["missing"].get(m, "")) for m, _h, scale, d in columns]
            label = name
            if name == "pagedkv" and weights_of(sysrec):
                label = f"pagedkv ({weights_of(sysrec)})"
            lines.append(f"| {e['size']} | {e['type']} | {size} | {label} | " + " | ".join(cells) + " |")
    return lines


def weights_of(system: dict[str, Any]) -> Optional[str]:
    """The linear-layer format pagedkv ran a model in (``int4``, ``int8``, ...), from its runs."""
    for run in system.get("runs", []):
        for part in ("warm", "cold"):
            w = ((run.get(part) or {}).get("child") or {}).get("weights")
            if w:
                return str(w)
    return None


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    from pagedkv.bench.report import closing_lines

    cfg, bw = data["config"], data["read_bandwidth"]
    lc = data["llama_cpp"]
    stamp = lc.get("stamp") or {}
    variant = stamp.get("variant") if isinstance(stamp, dict) else None
    lines = [
        "# Models people run on CPUs: pagedkv beside llama.cpp",
        "",
        *([f"**Partial results**: written while the run was still going ({len(data['models'])} of "
           f"{len(cfg.get('sizes', [])) * len(cfg.get('types', []))} models started).", ""] if data.get("partial") else []),
        f"`{cfg['command']}`: random-weight GGUFs of Llama-family shapes (made by `pagedkv.bench.models.make`), "
        f"{cfg['rounds']} rounds with the systems interleaved, {cfg['threads']} threads, pagedkv "
        f"`weights={cfg['weights']}`, KV budget {cfg['kv_cache_memory']}, max_model_len {cfg['max_model_len']}, "
        f"every measured process killed above {cfg['rss_limit_gb']:g} GB RSS. CPU: {data['cpu_model']}; ISA "
        f"{(data['machine'].get('cpu_isa') or {}).get('isa', 'unknown')}; commit {data['machine']['commit']}"
        f"{' (dirty)' if data['machine'].get('dirty') else ''}.",
        "",
        data["method"].replace("``", "`").replace(":mod:", ""),
        "",
        *([f"Note: {cfg['note']}", ""] if cfg.get("note") else []),
        "Cold-load peak RSS: the cold-loading process (pagedkv: until `LLM` is built; llama.cpp: `llama-server` until "
        "`/health`); run peak RSS: the process that loaded and ran prefill and decode (pagedkv: the warm one; "
        "llama.cpp: `llama-bench`, whose KV cache holds its 576-token run). pagedkv's run peak RSS includes its whole KV "
        "budget: an engine faults its cache pages in from start-up, in the background (`PAGEDKV_KV_PREFAULT`). "
        "Cache GB: what pagedkv's cold load wrote to its cache dir (llama.cpp writes none). "
        "`pagedkv (gguf)`: the linear-layer format pagedkv's `weights` setting chose for that file (`auto`: `gguf`, "
        "the file's blocks as stored, so a decode step reads the file's bytes as llama.cpp's does). The weight-read limit uses the file's tensor bytes (a mixture of experts: its routed experts' share); the bandwidth is the one named below: from 2026-12-07 "
        "the fastest torch read (`torch.amax`) over memory on 2 MiB pages, the pages pagedkv's weights are on "
        "(`pagedkv.ops.hugepages`); before, `torch.sum` over 4 KiB pages, which read about half as fast on a Zen 4 VM, "
        "so a fraction above 1 there means the limit is an underestimate, not that a system beat it. From the same "
        "date llama.cpp runs with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, its buffers on 2 MiB pages too "
        "(`bench.common.llama_cpp_env`). "
        "The last two columns set each round against the bandwidth probed just before and after it (their mean): "
        "on a shared host the bandwidth left to one process moves between levels for seconds at a time, so the "
        "run-wide limit alone mixes those levels.",
        "",
        f"Cells: median [interquartile range] over the rounds. Read bandwidth {bw['bytes_per_s'] / GB:.1f} GB/s "
        f"({bw['method']}); weight-read limit = bandwidth / bytes read per token tokens/s. llama.cpp: "
        + (f"not measured: {lc['not_measured']}" if lc.get("not_measured") else
           f"{lc['tools'].get('llama-bench')} (build variant {variant or 'unknown: no llama.cpp.json stamp'})") + ".",
        "",
        *table_rows(data),
        "",
    ]
    ratios = []
    for e in data["models"]:
        s = e.get("summary") or {}
        d, p = s.get("decode_tokens_per_s_ratio"), s.get("prefill_tokens_per_s_ratio")
        if d or p:
            ratios.append(f"| {e['size']} | {e['type']} | {f'{d:.2f}x' if d else 'n/a'} | {f'{p:.2f}x' if p else 'n/a'} |")
    if ratios:
        lines += ["pagedkv / llama.cpp (medians):", "", "| model | type | decode | prefill 512 |", "|---|---|---:|---:|",
                  *ratios, ""]
    made = []
    for e in data["models"]:
        f = e.get("file") or {}
        if f.get("bytes"):
            how = "cached" if f.get("cached") else "made now"
            made.append(f"| {e['size']} | {e['type']} | {f.get('maker')} | {f.get('make_seconds', 0):.0f} ({how}) | "
                        + ", ".join(f"{k} {v}" for k, v in sorted((f.get("tensor_types") or {}).items())) + " |")
    if made:
        lines += ["Model files (`$PAGEDKV_CACHE_DIR/models/`):", "", "| model | type | made by | make s | tensor types |",
                  "|---|---|---|---:|---|", *made, ""]
    return "\n".join(lines + closing_lines(data, plots))


# ---- plot --------------------------------------------------------------------------------------------------
def plot(data: dict[str, Any], path: Any) -> None:
    from pagedkv.bench.report import pyplot, save_figure

    plt = pyplot()
    labels = [f"{e['size']}\n{e['type']}" for e in data["models"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = ((("cold_load_s", "cold load s", 1.0), ("warm_load_s", "warm load s", 1.0),
               ("cold_load_peak_rss_bytes", "cold-load peak RSS GB", GB)) if data["config"].get("load_only") else
              (("decode_tokens_per_s", "batch-1 decode tok/s", 1.0), ("prefill_tokens_per_s", "prefill 512 tok/s", 1.0),
               ("peak_rss_bytes", "run peak RSS GB", GB)))
    for ax, (metric, title, scale) in zip(axes, panels):
        for k, (name, color) in enumerate((("pagedkv", "tab:blue"), ("llama.cpp", "tab:orange"))):
            xs, ys, lo, hi = [], [], [], []
            for i, e in enumerate(data["models"]):
                s = ((e.get("summary") or {}).get(name) or {}).get(metric)
                if s:
                    xs.append(i + (k - 0.5) * 0.38)
                    ys.append(s["median"] / scale)
                    lo.append((s["median"] - s["q1"]) / scale)
                    hi.append((s["q3"] - s["median"]) / scale)
            ax.bar(xs, ys, width=0.38, color=color, label=name, yerr=[lo, hi] if ys else None, capsize=3)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{data['cpu_model']}, {data['config']['threads']} threads (bars: median; whiskers: IQR; "
                 "no bar: not measured, see the table)", fontsize=9)
    save_figure(fig, path)
