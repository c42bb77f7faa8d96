"""Ablation: paging {off, on} x prefix caching {off, on} on a workload with real sharing, plus the sharing goals.

Seed §07: switch prefix caching and paged KV separately, so their gains are never mixed into
one number. Every cell runs the *same* workload at the *same* KV budget (``--num-blocks`` x
``--block-size`` slots) on the bundled model, greedy with ``ignore_eos`` (so every cell must
produce the same tokens, which is checked):

* one long system prompt (``--system-len`` tokens) at the start of every request;
* ``--conversations`` multi-turn conversations run closed-loop: all start at t=0; when turn
  t finishes, turn t+1 is submitted at once with prompt = turn t's prompt + its answer + a new
  user message (``--user-len`` tokens), so each turn extends the previous one;
* each answer is ``--output-len`` tokens.

``enable_paging=False`` is the contiguous baseline: every admitted request reserves
``ceil(max_model_len / block_size)`` blocks. Per cell, sampled at every forward pass (after
the step's allocation): KV slots allocated (blocks in use x block_size) vs effective tokens
(the token positions the live requests' tables cover; a prefix shared by several requests
counts once per request, so with sharing it can exceed the slots), and the number running.
Reported: their means and peaks, peak concurrency (requests running at once), throughput
(output tokens and turns per second of wall time), TTFT per turn (submission -> first token),
tokens computed by the model, prefix-cache hit rate and preemptions.

The sharing part (``docs/benchmarks/sharing.*``) measures the two issue-4 goals:

* prefix TTFT: ``--prefix-requests`` requests whose prompts are one ``--prefix-len``-token
  system prompt + a distinct ``--suffix-len``-token question, all submitted at t=0 (burst),
  and again one at a time (sequential, ``--sequential-requests`` of them); mean TTFT with
  caching on / off (goal <= 0.2), outputs equal;
* parallel sampling: n=``--n`` samples of a ``--n-prompt-len``-token prompt, ``--n-output-len``
  new tokens, vs n independent requests (the same prompt, seeds s..s+n-1, caching off):
  peak KV blocks in use (goal <= 0.3), and each sample equals its independent twin.

Times are wall-clock seconds on this machine's CPU with torch pinned to ``--threads``
threads (default 2); ratios, not absolute times, are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from pagedkv.bench.common import RESULTS_DIR, machine_info, markdown_table, pin_threads, write_results
from pagedkv.bench.workload import finite_or_none, summarize

NAME = "ablation"
SHARING_NAME = "sharing"

CELLS = [
    {"cell": "paging off, caching off", "enable_paging": False, "enable_prefix_caching": False},
    {"cell": "paging off, caching on", "enable_paging": False, "enable_prefix_caching": True},
    {"cell": "paging on, caching off", "enable_paging": True, "enable_prefix_caching": False},
    {"cell": "paging on, caching on", "enable_paging": True, "enable_prefix_caching": True},
]

TINY = dict(
    system_len=16, conversations=3, turns=2, user_len=4, output_len=2, block_size=4, num_blocks=48,
    max_model_len=64, max_num_batched_tokens=32, prefix_len=24, suffix_len=3, prefix_requests=3,
    sequential_requests=2, prefix_output_len=1, n=3, n_prompt_len=14, n_output_len=3,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=["all", "ablation", "sharing"], default="all",
                   help="which results to produce (default all)")
    p.add_argument("--tiny", action="store_true", help="test-sized run (seconds): short prompts, few requests")
    p.add_argument("--no-plot", action="store_true", help="skip ablation.png")
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0, help="token ids of the synthetic prompts")
    w = p.add_argument_group("ablation workload")
    w.add_argument("--system-len", type=int, default=256, help="system prompt tokens (default 256)")
    w.add_argument("--conversations", type=int, default=8, help="concurrent conversations (default 8)")
    w.add_argument("--turns", type=int, default=3, help="turns per conversation (default 3)")
    w.add_argument("--user-len", type=int, default=24, help="tokens per user message (default 24)")
    w.add_argument("--output-len", type=int, default=24, help="tokens per answer (default 24)")
    e = p.add_argument_group("engine (the same in every cell)")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-blocks", type=int, default=128, help="KV budget in blocks (default 128)")
    e.add_argument("--max-model-len", type=int, default=512,
                   help="context limit, tokens; the contiguous reservation when paging is off (default 512)")
    e.add_argument("--max-num-batched-tokens", type=int, default=512)
    e.add_argument("--max-num-seqs", type=int, default=64)
    s = p.add_argument_group("sharing goals")
    s.add_argument("--prefix-len", type=int, default=1000, help="shared system prompt tokens (default 1000)")
    s.add_argument("--suffix-len", type=int, default=16, help="distinct question tokens (default 16)")
    s.add_argument("--prefix-requests", type=int, default=32, help="requests in the burst (default 32)")
    s.add_argument("--sequential-requests", type=int, default=32,
                   help="requests sent one at a time (default 32; 0 = skip)")
    s.add_argument("--prefix-output-len", type=int, default=4, help="answer tokens (default 4)")
    s.add_argument("--n", type=int, default=8, help="parallel samples (default 8)")
    s.add_argument("--n-prompt-len", type=int, default=512, help="prompt tokens for parallel sampling (default 512)")
    s.add_argument("--n-output-len", type=int, default=64, help="new tokens per sample (default 64)")


# ---------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------
def _rand_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    hi = min(vocab, 30000)
    return [rng.randrange(1000, hi) for _ in range(n)]


def make_conversations(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The ablation workload: one system prompt and, per conversation, one user message per
    turn (token ids; the answers come from the model)."""
    rng = random.Random(args.seed)
    system = _rand_tokens(rng, args.system_len, vocab)
    users = [[_rand_tokens(rng, args.user_len, vocab) for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return {"system": system, "users": users}


def _engine(loaded: Any, args: argparse.Namespace, **kw: Any) -> Any:
    from pagedkv.engine.engine import LLMEngine

    opts = dict(block_size=args.block_size, num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                dtype="float32")
    opts.update(kw)
    return LLMEngine(loaded, **opts)


class _Sampler:
    """Samples the KV state at every forward pass (after the step's allocation)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.slots: list[int] = []
        self.effective: list[int] = []
        self.running: list[int] = []
        real = engine.runner.execute
        bs = engine.config.block_size

        def execute(inp: Any) -> Any:
            kv = engine.kv
            self.slots.append(kv.num_used_blocks * bs)
            self.effective.append(sum(t.num_tokens for t in kv.tables.values()))
            self.running.append(len(engine.scheduler.running))
            return real(inp)

        engine.runner.execute = execute


def run_cell(loaded: Any, cell: dict[str, Any], wl: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Run the closed-loop conversations through one engine configuration."""
    from pagedkv.engine.request import SamplingParams

    eng = _engine(loaded, args, enable_paging=cell["enable_paging"],
                  enable_prefix_caching=cell["enable_prefix_caching"])
    sampler = _Sampler(eng)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    history = [list(wl["system"]) for _ in wl["users"]]
    turn = [0] * len(wl["users"])
    answers: dict[str, list[int]] = {}
    ttfts: list[float] = []
    out_tokens = 0

    def submit(c: int) -> None:
        prompt = history[c] + wl["users"][c][turn[c]]
        history[c] = prompt
        eng.add_request(f"c{c}t{turn[c]}", prompt, sp)

    t0 = time.perf_counter()
    for c in range(len(wl["users"])):
        submit(c)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if not o.finished:
                continue
            c = int(o.request_id[1:].split("t")[0])
            answers[o.request_id] = list(o.token_ids)
            ttfts.append(o.metrics.ttft)
            out_tokens += len(o.token_ids)
            history[c] = history[c] + list(o.token_ids)
            turn[c] += 1
            if turn[c] < len(wl["users"][c]):
                submit(c)
    wall = time.perf_counter() - t0
    st = eng.get_stats()
    n_turns = len(answers)
    sum_slots, sum_eff = sum(sampler.slots), sum(sampler.effective)
    return {
        **cell,
        "turns_completed": n_turns,
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall,
        "turns_per_s": n_turns / wall,
        "ttft_s": summarize(ttfts),
        "peak_concurrency": max(sampler.running, default=0),
        "mean_concurrency": sum(sampler.running) / len(sampler.running) if sampler.running else 0.0,
        "kv_slots_allocated_mean": sum_slots / len(sampler.slots) if sampler.slots else 0.0,
        "kv_slots_allocated_peak": max(sampler.slots, default=0),
        "effective_tokens_mean": sum_eff / len(sampler.effective) if sampler.effective else 0.0,
        "effective_tokens_peak": max(sampler.effective, default=0),
        "effective_per_allocated_slot": sum_eff / sum_slots if sum_slots else 0.0,
        "tokens_computed": eng.scheduler.stats.num_batched_tokens_total,
        "prefix_hit_rate": st.kv_prefix_hit_rate,
        "prefix_hit_tokens": st.kv_prefix_hits,
        "preemptions": st.num_preemptions,
        "peak_shared_blocks": st.peak_shared_blocks,
        "steps": st.num_steps,
        "_answers": answers,
    }


def run_ablation(loaded: Any, args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    wl = make_conversations(args, int(loaded.config.vocab_size))
    longest = args.system_len + args.turns * (args.user_len + args.output_len)
    if longest > args.max_model_len:
        raise SystemExit(f"a conversation reaches {longest} tokens > --max-model-len {args.max_model_len}")
    cells = []
    for cell in CELLS:
        if progress:
            print(f"[ablation] {cell['cell']} ...", flush=True)
        cells.append(run_cell(loaded, cell, wl, args))
    ref = cells[0].pop("_answers")
    same = True
    for c in cells[1:]:
        same &= c.pop("_answers") == ref
    return {
        "benchmark": "ablation",
        "config": {
            "block_size": args.block_size, "num_blocks": args.num_blocks,
            "kv_budget_tokens": args.block_size * args.num_blocks, "max_model_len": args.max_model_len,
            "contiguous_reservation_blocks": -(-args.max_model_len // args.block_size),
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
            "threads": args.threads, "tiny": bool(args.tiny), "model": loaded.config.model_id,
        },
        "workload": {
            "system_prompt_tokens": args.system_len, "conversations": args.conversations,
            "turns": args.turns, "user_tokens_per_turn": args.user_len, "output_tokens_per_turn": args.output_len,
            "longest_conversation_tokens": longest, "seed": args.seed,
            "arrivals": "closed loop: every conversation starts at t=0; turn t+1 is sent when turn t finishes",
        },
        "cells": cells,
        "same_outputs": bool(same),
        "machine": machine_info(args.threads),
    }


# ---------------------------------------------------------------------------------------
# sharing goals
# ---------------------------------------------------------------------------------------
def _drain(eng: Any) -> dict[str, Any]:
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def _prefix_run(loaded: Any, args: argparse.Namespace, prompts: list[list[int]], caching: bool,
                sequential: bool) -> dict[str, Any]:
    from pagedkv.engine.request import SamplingParams

    need_blocks = -(-(max(len(p) for p in prompts) + args.prefix_output_len) // args.block_size)
    # room for every request at once: the cells differ in caching only, not in memory pressure
    eng = _engine(loaded, args, enable_prefix_caching=caching, num_blocks=len(prompts) * need_blocks + 8,
                  max_model_len=max(args.max_model_len, need_blocks * args.block_size))
    sp = SamplingParams(temperature=0.0, max_tokens=args.prefix_output_len, ignore_eos=True)
    outs: dict[str, Any] = {}
    t0 = time.perf_counter()
    if sequential:
        for i, p in enumerate(prompts):
            eng.add_request(f"q{i}", p, sp)
            outs.update(_drain(eng))
    else:
        for i, p in enumerate(prompts):
            eng.add_request(f"q{i}", p, sp)
        outs = _drain(eng)
    wall = time.perf_counter() - t0
    order = [outs[f"q{i}"] for i in range(len(prompts))]
    st = eng.get_stats()
    return {
        "caching": caching,
        "ttft_s": summarize(o.metrics.ttft for o in order),
        "wall_s": wall,
        "tokens_computed": eng.scheduler.stats.num_batched_tokens_total,
        "prefix_hit_tokens": st.kv_prefix_hits,
        "prefix_hit_rate": st.kv_prefix_hit_rate,
        "_tokens": [o.token_ids for o in order],
        "_ttfts": [o.metrics.ttft for o in order],
    }


def run_prefix_ttft(loaded: Any, args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    vocab = int(loaded.config.vocab_size)
    system = _rand_tokens(rng, args.prefix_len, vocab)
    prompts = [system + _rand_tokens(rng, args.suffix_len, vocab) for _ in range(args.prefix_requests)]
    out: dict[str, Any] = {
        "prefix_tokens": args.prefix_len, "suffix_tokens": args.suffix_len,
        "output_tokens": args.prefix_output_len, "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    modes = [("burst", prompts, False)]
    if args.sequential_requests > 0:
        modes.append(("sequential", prompts[: args.sequential_requests], True))
    for mode, ps, seq in modes:
        runs = {}
        for caching in (False, True):
            if progress:
                print(f"[sharing] prefix TTFT, {mode}, {len(ps)} requests, caching {'on' if caching else 'off'} ...",
                      flush=True)
            runs[caching] = _prefix_run(loaded, args, ps, caching, seq)
        same = runs[False].pop("_tokens") == runs[True].pop("_tokens")
        ttfts = {c: runs[c].pop("_ttfts") for c in (False, True)}
        ratio = runs[True]["ttft_s"]["mean"] / runs[False]["ttft_s"]["mean"]
        out[mode] = {
            "requests": len(ps), "off": runs[False], "on": runs[True], "same_outputs": same,
            "ttft_mean_ratio_on_off": ratio, "ttft_p50_ratio_on_off": runs[True]["ttft_s"]["p50"] / runs[False]["ttft_s"]["p50"],
            "goal": "<= 0.2", "goal_met": bool(ratio <= 0.2 and same),
        }
        if seq and len(ps) > 1:  # the first request fills the cache; the others find it warm
            warm = [sum(ttfts[c][1:]) / (len(ps) - 1) for c in (False, True)]
            out[mode]["ttft_mean_ratio_on_off_after_first"] = warm[1] / warm[0]
    return out


def run_parallel_sampling(loaded: Any, args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    from pagedkv.engine.request import SamplingParams

    rng = random.Random(args.seed + 2)
    prompt = _rand_tokens(rng, args.n_prompt_len, int(loaded.config.vocab_size))
    base = dict(temperature=1.0, top_p=0.95, max_tokens=args.n_output_len, ignore_eos=True)
    need = args.n * -(-(args.n_prompt_len + args.n_output_len) // args.block_size)
    mml = max(args.max_model_len, args.n_prompt_len + args.n_output_len)
    res: dict[str, Any] = {"n": args.n, "prompt_tokens": args.n_prompt_len, "new_tokens": args.n_output_len,
                           "block_size": args.block_size}
    if progress:
        print(f"[sharing] parallel sampling n={args.n} ...", flush=True)
    eng = _engine(loaded, args, num_blocks=need + 8, max_model_len=mml)
    t0 = time.perf_counter()
    eng.add_request("n", prompt, SamplingParams(n=args.n, seed=100, **base))
    shared = _drain(eng)["n"]
    st = eng.get_stats()
    res["parallel"] = {"peak_used_blocks": st.peak_used_blocks, "peak_shared_blocks": st.peak_shared_blocks,
                       "cow_copies": st.kv_cow_copies, "tokens_computed": eng.scheduler.stats.num_batched_tokens_total,
                       "wall_s": time.perf_counter() - t0}
    if progress:
        print(f"[sharing] {args.n} independent requests ...", flush=True)
    eng = _engine(loaded, args, num_blocks=need + 8, max_model_len=mml)
    t0 = time.perf_counter()
    for i in range(args.n):
        eng.add_request(f"i{i}", prompt, SamplingParams(seed=100 + i, **base))
    indep = _drain(eng)
    st = eng.get_stats()
    res["independent"] = {"peak_used_blocks": st.peak_used_blocks,
                          "tokens_computed": eng.scheduler.stats.num_batched_tokens_total,
                          "wall_s": time.perf_counter() - t0}
    ratio = res["parallel"]["peak_used_blocks"] / res["independent"]["peak_used_blocks"]
    same = [c.token_ids for c in shared.outputs] == [indep[f"i{i}"].token_ids for i in range(args.n)]
    res.update({"peak_blocks_ratio": ratio, "same_outputs": same, "goal": "<= 0.3",
                "goal_met": bool(ratio <= 0.3 and same)})
    return res


def _loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_sharing(loaded: Any, args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    load0 = _loadavg()
    pt = run_prefix_ttft(loaded, args, progress)
    ps = run_parallel_sampling(loaded, args, progress)
    return {
        "benchmark": "sharing",
        "prefix_ttft": pt,
        "parallel_sampling": ps,
        "threads": args.threads, "tiny": bool(args.tiny),
        "load_average_1min": {"start": load0, "end": _loadavg()},
        "machine": machine_info(args.threads),
    }


# ---------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------
def render_ablation(data: dict[str, Any]) -> str:
    cfg, wl = data["config"], data["workload"]
    rows = []
    for c in data["cells"]:
        rows.append({
            "cell": c["cell"],
            "slots allocated (mean)": c["kv_slots_allocated_mean"],
            "effective tokens (mean)": c["effective_tokens_mean"],
            "effective / slot": c["effective_per_allocated_slot"],
            "peak slots": c["kv_slots_allocated_peak"],
            "peak concurrency": c["peak_concurrency"],
            "out tok/s": c["output_tokens_per_s"],
            "turns/s": c["turns_per_s"],
            "TTFT mean s": c["ttft_s"]["mean"],
            "TTFT p90 s": c["ttft_s"]["p90"],
            "tokens computed": c["tokens_computed"],
            "hit rate": c["prefix_hit_rate"],
            "preempt": c["preemptions"],
        })
    base = {c["cell"]: c for c in data["cells"]}
    off_off, on_on = base["paging off, caching off"], base["paging on, caching on"]
    lines = [
        "# Ablation: paging x prefix caching",
        "",
        "`pagedkv bench ablation --part ablation` (seed §07: the two switches measured separately, "
        "same workload, same KV budget).",
        "",
        f"Workload: a {wl['system_prompt_tokens']}-token system prompt shared by every request; "
        f"{wl['conversations']} conversations x {wl['turns']} turns, each turn = the previous turn's prompt + "
        f"its {wl['output_tokens_per_turn']}-token answer + a {wl['user_tokens_per_turn']}-token user message "
        f"(longest {wl['longest_conversation_tokens']} tokens); {wl['arrivals']}. Greedy, ignore_eos.",
        "",
        f"KV budget: {cfg['num_blocks']} blocks x {cfg['block_size']} = {cfg['kv_budget_tokens']} slots in every cell; "
        f"paging off reserves {cfg['contiguous_reservation_blocks']} blocks (max_model_len {cfg['max_model_len']}) "
        f"per request. Token budget {cfg['max_num_batched_tokens']}/step. Model {cfg['model']}, fp32, "
        f"torch threads pinned to {cfg['threads']}.",
        "",
        markdown_table(rows),
        f"Same outputs in all four cells: **{data['same_outputs']}**.",
        "",
        "Reading the numbers:",
        "",
        "- *slots allocated* are blocks in use x block size, sampled at every forward pass; *effective "
        "tokens* are the positions the live requests' tables cover (a shared prefix counts once per "
        "request, so with caching it can exceed the slots: effective / slot > 1 means sharing).",
        "- Paging alone (row 3 vs 1) changes what is *allocated*: no reservation, so more requests fit "
        "the budget (peak concurrency). Caching alone (row 2 vs 1) changes what is *computed* (tokens "
        "computed, TTFT). Note that with paging off the KV manager still maps the cached prefix "
        "blocks into the request's reservation (the reservation is counted in table entries), so "
        "here caching also saves slots and raises concurrency; a truly contiguous cache would have "
        "to copy the prefix into each request's region and keep the reservation's full size.",
        f"- Paging off fits {cfg['num_blocks']} // {cfg['contiguous_reservation_blocks']} = "
        f"{cfg['num_blocks'] // cfg['contiguous_reservation_blocks']} reservations, the most that run at once "
        "without caching.",
        f"- Both (row 4): {on_on['peak_concurrency']} vs {off_off['peak_concurrency']} requests at once, "
        f"{on_on['output_tokens_per_s'] / off_off['output_tokens_per_s']:.2f}x the output throughput, "
        f"{on_on['ttft_s']['mean'] / off_off['ttft_s']['mean']:.2f}x the mean TTFT, "
        f"{on_on['tokens_computed'] / off_off['tokens_computed']:.2f}x the tokens computed.",
    ]
    return "\n".join(lines) + "\n"


def render_sharing(data: dict[str, Any]) -> str:
    pt, ps = data["prefix_ttft"], data["parallel_sampling"]
    lines = [
        "# Sharing: prefix caching TTFT and parallel-sampling blocks",
        "",
        "`pagedkv bench ablation --part sharing`; the issue-4 performance goals. Bundled model, fp32, "
        f"CPU, torch threads pinned to {data['threads']}; block size {pt['block_size']}, "
        f"{pt['max_num_batched_tokens']} tokens per step.",
        "",
        f"## Prefix caching: a {pt['prefix_tokens']}-token system prompt + a {pt['suffix_tokens']}-token "
        f"question per request, {pt['output_tokens']} answer tokens",
        "",
    ]
    rows = []
    for mode in ("burst", "sequential"):
        if mode not in pt:
            continue
        m = pt[mode]
        for key in ("off", "on"):
            r = m[key]
            rows.append({"arrivals": f"{mode} ({m['requests']} requests)", "caching": key,
                         "TTFT mean s": r["ttft_s"]["mean"], "TTFT p50 s": r["ttft_s"]["p50"],
                         "TTFT p90 s": r["ttft_s"]["p90"], "tokens computed": r["tokens_computed"],
                         "hit rate": r["prefix_hit_rate"], "wall s": r["wall_s"]})
    lines.append(markdown_table(rows))
    for mode in ("burst", "sequential"):
        if mode in pt:
            m = pt[mode]
            warm = m.get("ttft_mean_ratio_on_off_after_first")
            lines.append(f"- {mode}: mean TTFT on/off = **{m['ttft_mean_ratio_on_off']:.3f}** "
                         f"(p50 {m['ttft_p50_ratio_on_off']:.3f}"
                         + (f"; requests 2..{m['requests']}, cache warm: {warm:.3f}" if warm is not None else "")
                         + f"; goal {m['goal']}), same outputs: {m['same_outputs']} -> goal met: **{m['goal_met']}**")
    lines += [
        "",
        "Burst: all requests submitted at t=0 (TTFT includes queueing behind other prefills); "
        "sequential: one request at a time (TTFT = its own prefill; the first request finds the "
        "cache cold in both runs). Every request's prompt is the same system prompt + its own "
        "question, so the hit is the system prompt's whole blocks (992 of 1016 tokens at block 16).",
        "The off and on runs execute one after the other on a shared machine, so their ratio moves "
        "with the machine's load"
        + (f" (1-minute load average {data['load_average_1min']['start']:.1f} at the start, "
           f"{data['load_average_1min']['end']:.1f} at the end, on {data['machine']['cpu_count']} CPUs)"
           if data.get("load_average_1min", {}).get("start") is not None else "")
        + ". In the burst, requests wait while the first one is still prefilling the system "
        "prompt (the scheduler does not admit a request whose next prefix block another request is "
        "computing), then hit all of it.",
        "",
        f"## Parallel sampling: n={ps['n']}, a {ps['prompt_tokens']}-token prompt, {ps['new_tokens']} new tokens",
        "",
        markdown_table([
            {"run": f"n={ps['n']} (one prefill, forked tables)", "peak KV blocks": ps["parallel"]["peak_used_blocks"],
             "tokens computed": ps["parallel"]["tokens_computed"], "CoW copies": ps["parallel"]["cow_copies"],
             "wall s": ps["parallel"]["wall_s"]},
            {"run": f"{ps['n']} independent requests (seeds s..s+{ps['n'] - 1})",
             "peak KV blocks": ps["independent"]["peak_used_blocks"],
             "tokens computed": ps["independent"]["tokens_computed"], "CoW copies": 0,
             "wall s": ps["independent"]["wall_s"]},
        ]),
        f"Peak blocks ratio = **{ps['peak_blocks_ratio']:.3f}** (goal {ps['goal']}); every sample equals its "
        f"independent twin: {ps['same_outputs']} -> goal met: **{ps['goal_met']}**.",
        "",
        "Peak KV blocks: blocks in use right after a step's allocation, the maximum over the run.",
    ]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = data["cells"]
    names = [c["cell"].replace(", ", "\n") for c in cells]
    colors = ["#bbbbbb", "#8da0cb", "#66c2a5", "#fc8d62"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    ax = axes[0]
    x = range(len(cells))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [c["kv_slots_allocated_mean"] for c in cells], w, label="slots allocated", color="#999999")
    ax.bar([i + w / 2 for i in x], [c["effective_tokens_mean"] for c in cells], w, label="effective tokens", color="#1b9e77")
    ax.axhline(data["config"]["kv_budget_tokens"], color="k", ls="--", lw=1, label="budget")
    ax.set_title("KV slots vs effective tokens (mean)")
    ax.legend(fontsize=8, loc="upper left")
    for ax, key, title in [
        (axes[1], "peak_concurrency", "peak concurrency (requests)"),
        (axes[2], "output_tokens_per_s", "throughput (output tokens/s)"),
        (axes[3], None, "TTFT mean (s)"),
    ]:
        vals = [c[key] if key else c["ttft_s"]["mean"] for c in cells]
        bars = ax.bar(x, vals, color=colors)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(title)
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=8)
    fig.suptitle("paging x prefix caching, same workload and KV budget"
                 + ("" if data["same_outputs"] else " (OUTPUTS DIFFER)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------
def _apply_tiny(args: argparse.Namespace) -> None:
    for k, v in TINY.items():
        setattr(args, k, v)


def _warm_up(loaded: Any) -> None:
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.request import SamplingParams

    eng = LLMEngine(loaded, block_size=16, num_blocks=16, max_model_len=128)
    eng.add_request("w", list(range(1000, 1040)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    _drain(eng)


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return finite_or_none(obj)


def run(args: argparse.Namespace, loaded: Any = None) -> int:
    """Run the ablation and/or the sharing goals; write docs/benchmarks/{ablation,sharing}.*"""
    threads = pin_threads(args.threads)
    args.threads = threads
    if args.tiny:
        _apply_tiny(args)
    if loaded is None:
        import torch

        from pagedkv.model.loader import load_model

        loaded = load_model(args.model, dtype=torch.float32)
    progress = not args.json
    _warm_up(loaded)
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    results: dict[str, Any] = {}
    if args.part in ("all", "ablation"):
        data = _clean(run_ablation(loaded, args, progress))
        paths = write_results(NAME, data, render_ablation(data), out_dir)
        if not args.no_plot:
            plot(data, out_dir / f"{NAME}.png")
        results["ablation"] = data
        if progress:
            print(paths["md"].read_text())
    if args.part in ("all", "sharing"):
        data = _clean(run_sharing(loaded, args, progress))
        paths = write_results(SHARING_NAME, data, render_sharing(data), out_dir)
        results["sharing"] = data
        if progress:
            print(paths["md"].read_text())
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
