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

Both parts are variants of one result set, ``docs/benchmarks/ablation.{json,md,png}``: ``ablation``
(the four cells) and ``sharing`` (:mod:`pagedkv.bench.variants`). The sharing part measures two goals:

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
import random
import time
from typing import Any

from pagedkv.bench.ablation.report import plot, render_ablation, render_sharing
from pagedkv.bench.common import (
    add_run_options,
    engine_from_args,
    greedy,
    json_clean,
    load_fp32_model,
    machine_info,
    pin_threads,
    tokens_computed,
    warm_up,
)
from pagedkv.bench.report import publish, single_plot
from pagedkv.bench.ablation.sharing import run_sharing
from pagedkv.bench.workload import random_tokens, summarize
from pagedkv.utils import cdiv

NAME = "ablation"  #: the result set; the variants are the parts: ablation, sharing

#: paging {off, on} x prefix caching {off, on}
CELLS = [{"cell": f"paging {'on' if paging else 'off'}, caching {'on' if caching else 'off'}",
          "enable_paging": paging, "enable_prefix_caching": caching}
         for paging in (False, True) for caching in (False, True)]

TINY = dict(
    system_len=16, conversations=3, turns=2, user_len=4, output_len=2, block_size=4, num_blocks=48,
    max_model_len=64, max_num_batched_tokens=32, prefix_len=24, suffix_len=3, prefix_requests=3,
    sequential_requests=2, prefix_output_len=1, n=3, n_prompt_len=14, n_output_len=3,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=["all", "ablation", "sharing"], default="all",
                   help="which results to produce, each its variant of ablation.* (default all: both)")
    add_run_options(p, tiny="short prompts, few requests (seconds)")
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
def make_conversations(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The ablation workload: one system prompt and, per conversation, one user message per
    turn (token ids; the answers come from the model)."""
    rng = random.Random(args.seed)
    system = random_tokens(rng, args.system_len, vocab)
    users = [[random_tokens(rng, args.user_len, vocab) for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return {"system": system, "users": users}


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
            self.running.append(engine.get_stats().num_running)
            return real(inp)

        engine.runner.execute = execute


def run_cell(loaded: Any, cell: dict[str, Any], wl: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Run the closed-loop conversations through one engine configuration."""
    eng = engine_from_args(loaded, args, enable_paging=cell["enable_paging"],
                           enable_prefix_caching=cell["enable_prefix_caching"])
    sampler = _Sampler(eng)
    sp = greedy(args.output_len)
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
        "tokens_computed": tokens_computed(eng),
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
            "contiguous_reservation_blocks": cdiv(args.max_model_len, args.block_size),
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
# entry point
# ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace, loaded: Any = None) -> int:
    """Run the ablation and/or the sharing goals; write each as its variant (``ablation``,
    ``sharing``) of docs/benchmarks/ablation.*"""
    args.threads = pin_threads(args.threads)
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    loaded = load_fp32_model(loaded, args.model)
    progress = not args.json
    warm_up(engine_from_args(loaded, args, block_size=16, num_blocks=16, max_model_len=128), list(range(1000, 1040)))
    results: dict[str, Any] = {}
    if args.part in ("all", "ablation"):
        results["ablation"] = json_clean(run_ablation(loaded, args, progress))
        publish(NAME, results["ablation"], render_ablation, args.out_dir, variant="ablation", echo=progress,
                plots=None if args.no_plot else single_plot(NAME, "paging x prefix caching", plot))
    if args.part in ("all", "sharing"):
        results["sharing"] = json_clean(run_sharing(loaded, args, progress))
        publish(NAME, results["sharing"], render_sharing, args.out_dir, variant="sharing", echo=progress)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
