"""Interleaved rounds for the venv peers' sections of ``pagedkv bench peers`` (batch-1 /
prefill 512, and offline throughput on the trace): every system measured once per round, their
order alternating (:func:`pagedkv.bench.protocol.interleaved`), every run kept with the load it
ran under, each system summarised by the median and interquartile range over its rounds, and
pagedkv / peer taken per round (the two measured minutes apart at most), then summarised the
same way (docs/benchmarks/README.md, "protocol"). A peer that is not installed is asked once,
not every round (its reason does not change). pagedkv's sources are checked before each of its
runs: a change stops the rounds, and what finished is kept (the section says ``partial``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from pagedkv.bench.common import load_average
from pagedkv.bench.protocol import (SourcesChanged, check_sources, interleaved, paired_ratios, source_digest, spread,
                                    stamp_run)

PAGEDKV = "pagedkv"


def run_rounds(names: Sequence[str], measure: Callable[[str], dict[str, Any]], rounds: int, what: str,
               log: Any = print, digest: Optional[str] = None) -> tuple[list[dict[str, Any]], Optional[str]]:
    """``measure(name)`` for every name in every one of ``rounds`` rounds (>= 1), interleaved.
    Returns ``(rows, stopped)``: the rows in run order, each with ``round`` (1-based),
    ``load_1m_start`` / ``load_1m_end`` and ``wall_s`` (None for a peer not installed, asked
    once); ``stopped`` None, or why the rounds stopped early: pagedkv's sources differ from
    ``digest`` (taken now when None) before one of its runs. Raises ``ValueError`` for
    ``rounds`` < 1."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    digest = digest or source_digest()
    absent: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for r in range(rounds):
        for name in interleaved(names, r):
            if name in absent:  # not installed: the same row again, not another attempt
                rows.append({**absent[name], "round": r + 1, "load_1m_start": None, "load_1m_end": None,
                             "wall_s": None})
                continue
            if name == PAGEDKV:
                try:
                    check_sources(digest, f"pagedkv's {what} run of round {r + 1}")
                except SourcesChanged as exc:
                    log(f"[peers] stopped: {exc}")
                    return rows, str(exc)
            log(f"[peers] round {r + 1}/{rounds}: {name} {what} ...")
            t0, load0 = time.time(), load_average()
            row = stamp_run({**measure(name), "round": r + 1}, load0, t0)
            rows.append(row)
            if row["status"] == "not installed":
                absent[name] = row
            log(f"[peers] {name}: {row['status']} {row.get('reason') or ''}")
    return rows, None


def _by_round(rows: Sequence[dict[str, Any]], name: str, metric: str, rounds: int) -> list[Optional[float]]:
    got: list[Optional[float]] = [None] * rounds
    for r in rows:
        if r["name"] == name and r["status"] == "ok" and r.get(metric) is not None:
            got[r["round"] - 1] = float(r[metric])
    return got


def summarize_rounds(rows: Sequence[dict[str, Any]], metrics: Sequence[str]) -> dict[str, Any]:
    """``{"rounds", "systems": [{"name", "runs", "ok", metric: spread...}], "ratios": [{"peer",
    metric: spread of the per-round pagedkv / peer ratios...}]}`` of :func:`run_rounds`' rows
    (a spread is :func:`pagedkv.bench.protocol.spread`'s dict, None where nothing ran)."""
    rounds = max((r["round"] for r in rows), default=0)
    names = list(dict.fromkeys(r["name"] for r in rows))
    systems = []
    for name in names:
        mine = [r for r in rows if r["name"] == name]
        systems.append({"name": name, "runs": len(mine), "ok": sum(r["status"] == "ok" for r in mine),
                        **{m: spread(_by_round(rows, name, m, rounds)) for m in metrics}})
    ratios = []
    if PAGEDKV in names:
        for peer in names:
            if peer == PAGEDKV:
                continue
            q = {m: paired_ratios(_by_round(rows, PAGEDKV, m, rounds), _by_round(rows, peer, m, rounds)) for m in metrics}
            if any(v is not None for v in q.values()):
                ratios.append({"peer": peer, **q})
    return {"rounds": rounds, "systems": systems, "ratios": ratios}


def first_ok(rows: Sequence[dict[str, Any]], name: str) -> Optional[dict[str, Any]]:
    """The first row of ``name`` that ran (its version and weights for a table), else its
    first row (its status and reason), else None."""
    mine = [r for r in rows if r["name"] == name]
    return next((r for r in mine if r["status"] == "ok"), mine[0] if mine else None)


def runs_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> list[str]:
    """Markdown lines of every run: round, system, status, then ``columns`` (header, metric
    key, format), and the 1-minute load average at the run's start and end."""
    head = "| round | system | status | " + " | ".join(c[0] for c in columns) + " | load 1m start/end |"
    lines = [head, "|---:|---|---|" + "---:|" * len(columns) + "---|"]
    for r in rows:
        ok = r["status"] == "ok"
        vals = [format(r[k], f) if ok and r.get(k) is not None else "" for _, k, f in columns]
        load = (f"{r['load_1m_start']:.1f}/{r['load_1m_end']:.1f}"
                if r.get("load_1m_start") is not None and r.get("load_1m_end") is not None else "")
        lines.append(f"| {r['round']} | {r['name']} | {r['status']} | " + " | ".join(vals) + f" | {load} |")
    return lines


def bars(section: dict[str, Any], metrics: Sequence[str]) -> list[tuple[str, dict[str, tuple[float, float, float]]]]:
    """What a section's bar plot draws: ``(label, {metric: (median, q1, q3)})`` per system
    that ran; a section with rounds from its summary, one from before rounds from its rows
    (q1 = q3 = the one value)."""
    out = []
    if "rounds" in section:
        for s in section["systems"]:
            r = first_ok(section["rows"], s["name"])
            if s["ok"] and r is not None:
                out.append((f"{s['name']}\n({_weights_label(r)})",
                            {m: (s[m]["median"], s[m]["q1"], s[m]["q3"]) for m in metrics}))
        return out
    for r in section["rows"]:
        if r["status"] == "ok":
            out.append((f"{r['name']}\n({_weights_label(r)})", {m: (r[m], r[m], r[m]) for m in metrics}))
    return out


def _weights_label(row: dict[str, Any]) -> str:
    return str(row.get("weights", "")).split(" ")[0].split(":")[0]


def barh(ax: Any, items: list[tuple[str, dict[str, tuple[float, float, float]]]], metric: str, color: str) -> None:
    """Horizontal bars of ``metric``'s medians with their interquartile ranges as error bars."""
    med = [v[metric][0] for _, v in items]
    err = [[m - v[metric][1] for m, (_, v) in zip(med, items)], [v[metric][2] - m for m, (_, v) in zip(med, items)]]
    ax.barh([n for n, _ in items], med, xerr=err, color=color, capsize=3)


def intro(rounds: int) -> str:
    """The sentence a section with rounds opens with (how its cells and ratios are made)."""
    return (f"{rounds} round(s), pagedkv and the peers interleaved (their order alternating per round). Cells: median "
            "[interquartile range] over the rounds; ratios: per round (pagedkv / the peer of the same round), "
            "summarised the same way.")


def system_rows(section: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any], Optional[str]]]:
    """``(summary, row, why)`` per system of a section with rounds: its :func:`summarize_rounds`
    entry, its first row that ran (:func:`first_ok`), and, when no round ran, ``"status:
    reason"`` (the reason's last line, at most 160 characters), else None."""
    out = []
    for s in section["systems"]:
        r = first_ok(section["rows"], s["name"]) or {"status": "?"}
        why = None if s["ok"] else f"{r['status']}: {str(r.get('reason')).splitlines()[-1][:160]}"
        out.append((s, r, why))
    return out
