"""Speculative decoding (prompt lookup; a draft model with ``--speculative draft:MODEL``) at
batch 1: decode tok/s with and without it.

Two workloads on the bundled chat model: **repetitive** (requests whose answer repeats or
edits text of the prompt: copy a list, fix a typo in a paragraph, copy code) and **free chat** (open questions, where proposals mostly miss). Each request runs
alone (batch 1), greedy, up to EOS or ``--max-tokens`` tokens (both sides generate the same
tokens); plain and speculative engines alternate
request by request in one process (a shared host's load changes between two runs), and
each side's decode tok/s is its generated tokens after the first / the time after the
first token. When ``llama-server`` is built (``make peers``), llama.cpp on the same GGUF runs
the same prompt token ids plain and with its own C++ n-gram lookup decoding, interleaved with
pagedkv's sides request by request (``pagedkv.bench.spec.peer``); without it the llama.cpp
columns say why they were not measured.
Each round runs every prompt once on every side; rates and ratios are medians over the rounds
with their interquartile range, ratios taken per round (``pagedkv.bench.protocol``).
Goals: >= 2x on the repetitive workload, >= 0.95x on free chat, by the lower quartile.

Results: ``spec.{json,md,png}``, the variant ``ngram`` (prompt lookup) or, with a draft model,
``<weights>_draft_<draft weights>`` (``fp32_draft_int4``; :mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from typing import Any, Optional

from pagedkv.bench.common import add_options, load_fp32_model, log, machine_info, pin_threads, weights_of
from pagedkv.bench.protocol import cell, paired_ratios, ratio_cell, spread
from pagedkv.bench.report import markdown_table, plot_links, publish, pyplot, save_figure, single_plot
from pagedkv.bench.variants import add_variant_option
from pagedkv.errors import ConfigError

PARAGRAPH = ("Paged attention splits each request's key-value cache into fixed-size blocks, so memory is "
             "allocated on demand and shared prefixes are stored once. The scheduler admits requests while "
             "blocks are free and preempts the latest one when the pool runs out.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
        "    return subtotal + tax\n")
WORKLOADS = {
    "repetitive": [
        "Copy this list exactly, one item per line: red apples, green pears, ripe plums, sweet cherries, "
        "dark grapes, sour lemons, fresh limes, dried figs, yellow bananas, orange mangos.",
        f"Fix the spelling mistake and repeat the whole paragraph:\n\n{PARAGRAPH}",
        f"Repeat this code exactly:\n\n{CODE}",
        f"Repeat this text word for word:\n\n{PARAGRAPH}",
    ],
    "free chat": [
        "What is the capital of France? Answer in one sentence.",
        "Give me three tips for a good night's sleep.",
        "Why is the sky blue?",
        "Write a short poem about the sea.",
    ],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, [
        ("--max-tokens", 128, "most tokens generated per request (default 128)"),
        ("--num-speculative-tokens", 4, "draft tokens per step (default 4)"),
        ("--rounds", 2, "times each prompt runs on each side (default 2)"),
        ("--ngram-min", 2, "shortest n-gram matched (default 2, the engine's)"),
    ])
    p.add_argument("--weights", default="auto", help="linear-layer format (default auto: what users run)")
    p.add_argument("--speculative", default="ngram", metavar="ngram|draft:MODEL",
                   help="ngram (default): plain and prompt lookup; draft:MODEL (a GGUF/HF path or a bundled name, "
                        "e.g. draft:smollm2-135m) adds a draft-model side beside them")
    p.add_argument("--draft-weights", default="auto", help="the draft model's linear-layer format (default auto)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even when built")
    p.add_argument("--llama-server", default=None,
                   help="llama-server binary (default: $PAGEDKV_LLAMA_SERVER, the one `make peers` built, or PATH)")
    add_variant_option(p, "ngram; with a draft model <weights>_draft_<draft weights>, e.g. fp32_draft_int4")


def _timed(gen: Any) -> tuple[int, float]:
    """(tokens after the first, seconds after the first) of a token iterator."""
    n, t1 = 0, None
    for _ in gen:
        n += 1
        if t1 is None:
            t1 = time.perf_counter()
    return max(0, n - 1), (time.perf_counter() - t1) if t1 is not None else 0.0


def _pagedkv_run(eng: Any, prompt_ids: list[int], max_tokens: int):
    """One request alone on ``eng``: yields once per generated token (up to EOS or ``max_tokens``)."""
    from pagedkv.engine.request import SamplingParams

    eng.add_request("b", prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    seen = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            n = len(out.outputs[0].token_ids)
            yield from range(n - seen)
            seen = n


def _lookup_peer(args: argparse.Namespace, loaded: Any, threads: int) -> tuple[Any, dict[str, Any]]:
    """``(LookupPeer or None, what was run or why not)``: llama.cpp's C++ lookup decoding on the
    same GGUF when ``llama-server`` is built and the model is a GGUF file."""
    from pagedkv.bench.serve.peer import binary_facts, find_llama_server
    from pagedkv.bench.spec.peer import LookupPeer, lookup_flags

    path = str(getattr(loaded, "path", "") or "")
    if args.no_llama_cpp:
        return None, {"measured": False, "reason": "--no-llama-cpp"}
    if not path.endswith(".gguf"):
        return None, {"measured": False, "reason": "the model is not a GGUF file"}
    binary = find_llama_server(getattr(args, "llama_server", None))
    if binary is None:
        return None, {"measured": False, "reason": "llama-server not found: run `make peers`"}
    size_n, size_m = max(3, args.ngram_min), args.num_speculative_tokens
    return LookupPeer(binary, path, threads, size_n, size_m), {
        "measured": True, "server": binary_facts(binary), "lookup_flags": lookup_flags(size_n, size_m)}


# a row's ratios: (column, numerator side, denominator side), each taken per round
RATIOS = (("speedup", "ngram", "plain"), ("draft_speedup", "draft", "plain"),
          ("llama_cpp_speedup", "llama_cpp_lookup", "llama_cpp"), ("ngram_vs_llama_cpp_lookup", "ngram", "llama_cpp_lookup"))
RATIO_COLS = frozenset(c for c, _, _ in RATIOS)


def _peer_round(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """llama.cpp's decode tok/s per side over one round (the peer's totals after minus before)."""
    out = {}
    for side, name in (("plain", "llama_cpp"), ("lookup", "llama_cpp_lookup")):
        n = after[side]["decode_tokens"] - before[side]["decode_tokens"]
        ms = after[side]["decode_ms"] - before[side]["decode_ms"]
        out[name] = n / ms * 1e3 if ms > 0 else None
    return out


def _workload(args: argparse.Namespace, engines: dict[str, Any], peer: Any, workload: str,
              texts: list[str]) -> dict[str, Any]:
    """One workload's row: every prompt ``args.rounds`` times on every side, the sides
    alternating request by request (pagedkv's engines, then llama.cpp plain and lookup). A round
    runs every prompt once on every side; each side's decode tok/s per round is its tokens after
    the first over its seconds after the first in that round. Rates and ratios are the median
    over the rounds (ratios taken per round: the sides of one round ran minutes apart at most),
    with their spread (``pagedkv.bench.protocol.spread``) in ``row["spread"]`` and every
    round's rates in ``row["rounds"]``."""
    prompts = [engines["plain"].apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    if peer is not None:
        peer.reset()
    per_round: list[dict[str, Optional[float]]] = []
    for _ in range(args.rounds):
        side = {name: [0, 0.0] for name in engines}
        before = copy.deepcopy(peer.totals) if peer is not None else None
        for ids in prompts:
            for name, eng in engines.items():
                n, s = _timed(_pagedkv_run(eng, ids, args.max_tokens))
                side[name][0] += n
                side[name][1] += s
            if peer is not None:
                peer.run(ids, args.max_tokens)
        rates: dict[str, Optional[float]] = {name: n / s if s > 0 else None for name, (n, s) in side.items()}
        if peer is not None:
            rates.update(_peer_round(before, peer.totals))
        per_round.append(rates)
    log(f"[spec] {workload}: {per_round}")
    sides = list(per_round[0])
    spreads = {f"{name}_tok_s": spread([r[name] for r in per_round]) for name in sides}
    for col, num, den in RATIOS:
        if num in sides and den in sides:
            spreads[col] = paired_ratios([r[num] for r in per_round], [r[den] for r in per_round])
    row: dict[str, Any] = {"workload": workload}
    for col, sp in spreads.items():
        if sp is not None:
            row[col] = round(sp["median"], 3 if col in RATIO_COLS else 2)
    if peer is not None:
        row.update(llama_cpp_acceptance=round(peer.rates()["acceptance"], 4), llama_cpp_same_tokens=peer.same_tokens)
    row["spread"] = {col: {k: sp[k] for k in ("median", "q1", "q3", "n")} for col, sp in spreads.items() if sp is not None}
    row["rounds"] = [{k: (round(v, 2) if v is not None else None) for k, v in r.items()} for r in per_round]
    return row


def _cell(row: dict[str, Any], col: str) -> Any:
    """``col`` of ``row`` as the table shows it: ``median [q1-q3]`` where the row has its
    spread over 2+ rounds (a ratio as ``1.23x [1.10-1.30]``), else the value as stored."""
    sp = (row.get("spread") or {}).get(col)
    if sp is None or sp["n"] < 2:
        return row.get(col, "")
    if col in RATIO_COLS:
        return ratio_cell(sp)
    return cell(sp)


def _goal(row: dict[str, Any], target: float) -> bool:
    """Whether ``row``'s speedup meets ``target`` by its lower quartile (the value itself
    for one round)."""
    sp = (row.get("spread") or {}).get("speedup")
    return bool((sp["q1"] if sp is not None else row["speedup"]) >= target)


def collect(args: argparse.Namespace, loaded: Any = None) -> dict[str, Any]:
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.worker.proposer import draft_model_name

    threads = pin_threads(args.threads)
    loaded = load_fp32_model(loaded, getattr(args, "model", None), weights=args.weights)
    sides = [("plain", None), ("ngram", "ngram")]
    draft = getattr(args, "speculative", "ngram")
    if draft != "ngram":
        if draft_model_name(draft) is None:
            raise ConfigError(f"--speculative: 'ngram' or 'draft:<model>', got {draft!r}")
        sides.append(("draft", draft))
    engines = {name: LLMEngine(loaded, dtype="float32", block_size=16, num_blocks=128, max_num_seqs=1,
                               speculative=spec, num_speculative_tokens=args.num_speculative_tokens,
                               ngram_min=args.ngram_min, ngram_max=max(3, args.ngram_min),
                               draft_weights=getattr(args, "draft_weights", "auto"))
               for name, spec in sides}
    peer, peer_info = _lookup_peer(args, loaded, threads)
    rows = []
    with peer or contextlib.nullcontext():
        for workload, texts in WORKLOADS.items():
            rows.append(_workload(args, engines, peer, workload, texts))
    st = engines["ngram"].get_stats()
    extra: dict[str, Any] = {}
    if "draft" in engines:
        dst = engines["draft"].get_stats()
        extra = {"draft_acceptance_rate": round(dst.spec_acceptance_rate, 4),
                 "draft_mean_accepted_length": round(dst.spec_mean_accepted_length, 3)}
    return {
        **extra,
        "config": {"max_tokens": args.max_tokens, "num_speculative_tokens": args.num_speculative_tokens,
                   "ngram_min": args.ngram_min, "speculative": draft,
                   "draft_weights": getattr(args, "draft_weights", "auto") if "draft" in engines else None,
                   "rounds": args.rounds, "threads": threads, "weights": weights_of(loaded),
                   "prompts": WORKLOADS, "llama_cpp": peer_info},
        "rows": rows,
        "acceptance_rate": round(st.spec_acceptance_rate, 4),
        "mean_accepted_length": round(st.spec_mean_accepted_length, 3),
        "goals": {"repetitive >= 2x": _goal(rows[0], 2.0), "free chat >= 0.95x": _goal(rows[1], 0.95)},
        "machine": machine_info(threads),
    }


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    c = data["config"]
    cols = ["workload", "plain_tok_s", "ngram_tok_s", "speedup"]
    if "draft_acceptance_rate" in data:
        cols += ["draft_tok_s", "draft_speedup"]
    if any("llama_cpp_tok_s" in r for r in data["rows"]):
        cols += ["llama_cpp_tok_s", "llama_cpp_lookup_tok_s", "llama_cpp_speedup", "llama_cpp_acceptance",
                 "ngram_vs_llama_cpp_lookup"]
    lc = c.get("llama_cpp") or {"measured": False, "reason": "not recorded"}
    if lc.get("measured"):
        variant = ((lc.get("server") or {}).get("build") or {}).get("variant", "unknown")
        lc_line = (f"llama.cpp: `llama-server` ({variant} build), plain and with its C++ n-gram lookup "
                   f"(`{' '.join(lc['lookup_flags'])}`), one slot each, the same prompt token ids, interleaved with "
                   "pagedkv request by request; decode tok/s from the server's own timings (tokens after the first / "
                   "time after the first). `ngram_vs_llama_cpp_lookup` = pagedkv n-gram / llama.cpp lookup.")
    else:
        lc_line = f"llama.cpp: not measured ({lc.get('reason')})."
    return "\n".join([
        f"# Speculative decoding (prompt lookup{', draft model' if 'draft_acceptance_rate' in data else ''}), batch 1",
        "",
        f"`pagedkv bench spec`: greedy, up to EOS or {c['max_tokens']} tokens per request, up to {c['num_speculative_tokens']} "
        f"drafts per step, {c['weights']} weights, {c['threads']} thread(s), {c['rounds']} rounds, plain and "
        "speculative engines alternating request by request. Decode tok/s = tokens after the first / time after "
        "the first token.",
        "",
        lc_line,
        "",
        markdown_table([{c: _cell(r, c) for c in cols} for r in data["rows"]], cols),
        "Cells: median [interquartile range] over the rounds where there are 2 or more; ratios are taken per round "
        "(the sides of one round ran minutes apart at most), then summarised; a goal is met only by the lower "
        "quartile." if any((r.get("spread") or {}).get("speedup", {}).get("n", 0) > 1 for r in data["rows"]) else "",
        f"Acceptance rate (all workloads): {data['acceptance_rate']:.2f}; mean tokens kept per verified row: "
        f"{data['mean_accepted_length']:.2f}."
        + (f" Draft model `{c['speculative'][6:]}` ({c['draft_weights']} weights): acceptance "
           f"{data['draft_acceptance_rate']:.2f}, {data['draft_mean_accepted_length']:.2f} tokens kept per verified row."
           if "draft_acceptance_rate" in data else ""),
        "",
        "Goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in data["goals"].items()) + ".",
        "",
        *plot_links(plots),
    ])


def _draw(data: dict[str, Any], path: Any) -> None:
    """Grouped bars: decode tok/s of every side (plain, ngram, draft, llama.cpp) per workload."""
    plt = pyplot()
    rows = data["rows"]
    sides = [k for k in ("plain_tok_s", "ngram_tok_s", "draft_tok_s", "llama_cpp_tok_s", "llama_cpp_lookup_tok_s")
             if k in rows[0]]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(sides)
    for i, key in enumerate(sides):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width, label=key[: -len("_tok_s")].replace("_", " "))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r["workload"] for r in rows])
    ax.set_ylabel("batch-1 decode tok/s")
    ax.set_title(f"speculative decoding, {data['config']['weights']} weights")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def run(args: argparse.Namespace, loaded: Any = None) -> int:
    data = collect(args, loaded)
    c = data["config"]  # a draft-model run (its own target weights) is its own variant
    variant = "ngram" if c["speculative"] == "ngram" else f"{c['weights']}_draft_{c['draft_weights']}"
    publish("spec", data, render_markdown, args.out_dir, variant=getattr(args, "variant", None) or variant,
            as_json=args.json, plots=single_plot("spec", "decode tok/s per side", _draw))
    return 0
