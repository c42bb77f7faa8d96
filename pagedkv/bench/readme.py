"""The README results rows that come from the comparison protocol, regenerated from their result files.

``pagedkv bench readme`` rewrites, in README.md's results table, every row that links a run
of the interleaved-rounds protocol (:mod:`pagedkv.bench.protocol`): the batch-1 comparisons
with native llama.cpp (the ``llama_cpp_*`` variants of ``peers.json``) and ``pagedkv bench serve
--peer llama-server`` runs with rounds (variants of ``serving_peers.json`` whose config records
``rounds``). Each such run gives its rows (median [IQR] over the rounds, the per-round ratios'
median [IQR], the goals by the unfavourable quartile, the CPU class the kernels ran under),
linked to its section (``docs/benchmarks/<set>.md#<variant>``) and put where that link's first
row was; a run with no row yet gets its rows at the top of the table. Every other row is left
as written. ``--check`` writes nothing and exits 1 when the README is not up to date.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Optional

from pagedkv.bench.common import REPO_ROOT, RESULTS_DIR
from pagedkv.bench.peers.native_report import isa_class
from pagedkv.bench.variants import read_variants

LINK = re.compile(r"\]\((docs/benchmarks/[^)\s#]+\.md(?:#[^)\s]+)?)\)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when README.md is not up to date")
    p.add_argument("--readme", default=str(REPO_ROOT / "README.md"), help="the README to rewrite (default README.md)")


def _med(s: Optional[dict[str, Any]], digits: int = 1, scale: float = 1.0, bare: bool = False) -> str:
    """``median [q1-q3]`` (divided by ``scale``); ``bare``: the median alone."""
    if not s:
        return "n/a"
    f = f"{{:.{digits}f}}"
    if bare:
        return f.format(s["median"] / scale)
    return f"{f.format(s['median'] / scale)} [{f.format(s['q1'] / scale)}-{f.format(s['q3'] / scale)}]"


def _ratio(s: Optional[dict[str, Any]]) -> str:
    return f"{s['median']:.2f}x [{s['q1']:.2f}-{s['q3']:.2f}]" if s else "n/a"


def _met(flag: Optional[bool]) -> str:
    return "n/a" if flag is None else ("met" if flag else "NOT met")


def _row(*cells: str) -> str:
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def peers_rows(data: dict[str, Any], link: str) -> list[str]:
    """Batch-1 decode and prefill 512 rows of a native llama.cpp comparison (a ``llama_cpp_*`` variant of peers)."""
    cfg, summ = data["config"], data["summary"]
    types = [t for t in cfg["types"] if t in summ]
    stamp = (data.get("llama_cpp") or {}).get("stamp") or {}
    what = (f"{cfg['model_id']} vs native llama.cpp `llama-bench` ({stamp.get('variant', 'unknown')} build), same "
            f"GGUF, {' / '.join(t.upper() for t in types)}; median [IQR] of {cfg['rounds']} interleaved rounds")
    cls = isa_class(data["machine"].get("cpu_isa") or {})
    goal = cfg.get("goal_decode_ratio")
    rows = []
    for metric, label in (("decode_tokens_per_s", f"batch-1 decode tok/s, goal ≥ {goal:g}x by the lower quartile: "
                           + ", ".join(f"{t.upper()} {_met(summ[t].get('goal_met'))}" for t in types)),
                          ("prefill_tokens_per_s", "prefill 512 tok/s")):
        rows.append(_row(f"{label}; {what}",
                         " / ".join(_med((summ[t].get("pagedkv") or {}).get(metric)) for t in types),
                         " / ".join(_med((summ[t].get("llama.cpp") or {}).get(metric)) for t in types),
                         " / ".join(_ratio(summ[t].get(f"{metric}_ratio")) for t in types), cls, link))
    return rows


def serving_rows(data: dict[str, Any], link: str) -> list[str]:
    """Per workload: served output tok/s (with the goals) and ITL p50 / TTFT p50 rows of a
    ``serving_peer`` result set with rounds."""
    cfg = data["config"]
    peer = cfg["servers"][1]
    fmt = cfg.get("gguf_type") or (cfg.get("model_weights_as_stored") or "").lower()
    cls = isa_class((data.get("machine") or {}).get("cpu_isa") or {})
    rows = []
    for w in cfg.get("workloads") or [None]:
        qs = [q for q in data["ratios"] if q.get("workload") == w and not q.get("missing")]
        if not qs:
            continue
        conc = " / ".join(str(q["concurrency"]) for q in qs)
        n = max(q.get("rounds_paired", 1) for q in qs)
        head = (f"{fmt.upper()}, prompt/output {w} tokens, concurrency {conc}; median [IQR] of {n} rounds"
                + (f" (of {cfg['rounds']} planned)" if n < cfg["rounds"] else ""))
        goals = ", ".join(f"{q['concurrency']}: {_met(q.get('output_tok_s_goal_met'))}" for q in qs
                          if q.get("goal_output_tok_s_ratio") is not None)

        def side(name: str, key: str, digits: int, scale: float = 1.0) -> str:
            bare = scale != 1.0  # latencies: the medians (their ratios carry the spread)
            return " / ".join(_med((q["servers"].get(name) or {}).get(key), digits, scale, bare) for q in qs)

        rows.append(_row(f"served output tok/s vs {peer} ({head}); goals by the lower quartile: {goals}",
                         side("pagedkv", "output_tok_s", 1), side(peer, "output_tok_s", 1),
                         " / ".join(_ratio(q.get("output_tok_s_ratio_spread")) for q in qs), cls, link))
        rows.append(_row(f"served ITL p50 (decode) / TTFT p50 (prefill + queue) vs {peer}, ms, medians; ratios "
                         f"median [IQR] ({head})",
                         side("pagedkv", "itl_p50", 0, 1e-3) + "; " + side("pagedkv", "ttft_p50", 0, 1e-3),
                         side(peer, "itl_p50", 0, 1e-3) + "; " + side(peer, "ttft_p50", 0, 1e-3),
                         " / ".join(_ratio(q.get("itl_p50_ratio_spread")) for q in qs) + "; "
                         + " / ".join(_ratio(q.get("ttft_p50_ratio_spread")) for q in qs), cls, link))
    return rows


def rows_for(data: dict[str, Any], link: str) -> Optional[list[str]]:
    """The generated rows of one run (a result file's data, or one variant's), None when it is
    not one the protocol generates rows for."""
    if str(data.get("benchmark", "")).startswith("peers_llama_cpp") and "summary" in data:
        return peers_rows(data, link)
    if data.get("benchmark") == "serving_peer" and (data.get("config") or {}).get("rounds"):
        return serving_rows(data, link)
    return None


def regenerate(text: str, root: Path = REPO_ROOT, results: Path = RESULTS_DIR) -> str:
    """``text`` (a README) with its generated results rows rewritten (see the module doc)."""
    lines = text.splitlines()
    start = lines.index("## Results")
    rule = next(i for i in range(start, len(lines)) if lines[i].startswith("|---"))
    end = rule + 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    generated: dict[str, list[str]] = {}
    for path in sorted(results.rglob("*.json")):
        try:
            runs = read_variants(path)
        except (OSError, ValueError):
            continue
        page = path.with_suffix(".md").relative_to(root).as_posix()
        for variant, data in runs.items():
            link = f"{page}#{variant}" if variant else page
            made = rows_for(data, link) if isinstance(data, dict) else None
            if made is not None:
                generated[link] = [r.replace(f"| {link} |", f"| [{_label(link)}]({link}) |") for r in made]
    body, done = [], set()
    for line in lines[rule + 1:end]:
        m = LINK.search(line.rsplit("|", 2)[-2] if line.count("|") >= 2 else "")
        target = m.group(1) if m else None
        if target in generated:
            if target not in done:
                body += generated[target]
                done.add(target)
            continue
        body.append(line)
    new = [r for link, rows in generated.items() if link not in done for r in rows]
    return "\n".join(lines[:rule + 1] + new + body + lines[end:]) + ("\n" if text.endswith("\n") else "")


def _label(link: str) -> str:
    """The link text of a run: its result set's path under docs/benchmarks without ``.md``, then
    ``: <variant>`` for a variant (``peers: llama_cpp_avx2``)."""
    page, _, variant = link.partition("#")
    name = page.removeprefix("docs/benchmarks/").removesuffix(".md")
    return f"{name}: {variant}" if variant else name


def run(args: argparse.Namespace) -> int:
    path = Path(args.readme)
    old = path.read_text()
    new = regenerate(old, path.parent, path.parent / "docs" / "benchmarks")
    if args.check:
        if new != old:
            print(f"{path} is not up to date: run `pagedkv bench readme`", file=sys.stderr)
            return 1
        return 0
    if new != old:
        path.write_text(new)
    print(f"{path}: {'rewritten' if new != old else 'up to date'} ({len(new.splitlines())} lines)")
    return 0
