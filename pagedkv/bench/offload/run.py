"""KV tiers: multi-turn conversations through a primary pool of about 1/8 of their
working set, with and without tiers behind it, and TTFT after a restart.

* Conversations: ``--conversations`` chats of ``--turns`` turns, run one request at a time,
  round robin (turn 1 of every chat, then turn 2, ...), so by the time a chat comes back its
  blocks have left the pool. A chat opens with a ``--first-user-tokens``-token message (a
  pasted document, long instructions); each later turn resends the whole history (every
  earlier user message and answer) plus a new ``--user-tokens``-token message; answers are
  ``--answer-tokens`` greedy tokens. The pool holds ``--pool-fraction`` of the working set (the blocks of every
  chat's final history), at least one request. Cells: no tiers (the pool's prefix cache
  only), ``host``, ``disk``, and ``host+disk`` (host sized to ``--host-fraction`` of the
  working set, disk for the rest). Per cell: TTFT (p50, mean), prefix tokens recomputed (the
  history tokens of each turn not served from a cache), hits per tier, bytes moved, copy
  time; outputs must be equal in every cell. Goals: TTFT p50 with tiers <= 0.3x without,
  prefix tokens recomputed <= 0.2x.
* Restart: an engine with a disk tier computes a ``--prefix-len``-token prompt and closes
  (persisting the pool's cached blocks); a new engine on the same store (a restart; the
  model stays loaded) gets the prefix plus a new ``--user-tokens``-token question; TTFT vs
  a cold engine without tiers, ``--trials`` times each (medians). Goal: <= 0.3x.

One request at a time, so TTFT is the prefill (and loads) of that request alone; the cells
run side by side (each request goes to every cell's engine in turn), so a change in the
shared machine's load hits them alike; every engine has a short untimed warm-up request. Wall-clock seconds on this CPU, torch
pinned to ``--threads``; ratios measured side by side in one run are the result.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Any

from pagedkv.bench.common import RunFacts, add_options, add_run_options, greedy, load_fp32_model, log, warm_up
from pagedkv.bench.offload.report import plots, render_markdown
from pagedkv.bench.report import publish
from pagedkv.bench.workload import random_tokens, summarize
from pagedkv.utils import cdiv

CELLS = ("none", "host", "disk", "host+disk")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, [
        ("--conversations", 8, "chats (default 8)"),
        ("--turns", 6, "turns per chat (default 6)"),
        ("--first-user-tokens", 256, "tokens of each chat's first message, e.g. a pasted document (default 256)"),
        ("--user-tokens", 16, "tokens of each later user message (default 16)"),
        ("--answer-tokens", 12, "greedy tokens of each answer (default 12)"),
        ("--block-size", 16, "tokens per KV block (default 16)"),
        ("--pool-fraction", 0.125, "primary pool / working set (default 1/8)"),
        ("--host-fraction", 0.25, "host tier / working set in the host+disk cell (default 1/4)"),
        ("--prefix-len", 1000, "restart part: the stored prefix's tokens (default 1000)"),
        ("--trials", 3, "restart part: timed requests per side (default 3)"),
        ("--seed", 0, "token seed (default 0)"),
    ])
    p.add_argument("--cells", default=",".join(CELLS), help=f"conversation cells (default {','.join(CELLS)})")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    add_run_options(p, tiny="2 chats x 2 turns, a 96-token prefix (seconds)", note=True)


def _engine(loaded: Any, args: Any, num_blocks: int, max_model_len: int, kv_offload: list[str] | None) -> Any:
    from pagedkv.engine.engine import LLMEngine

    return LLMEngine(loaded, dtype="float32", block_size=args.block_size, num_blocks=num_blocks,
                     max_model_len=max_model_len, max_num_batched_tokens=max(512, max_model_len),
                     enable_prefix_caching=True, kv_offload=kv_offload)


def _ask(eng: Any, rid: str, prompt: list[int], max_tokens: int) -> Any:
    eng.add_request(rid, prompt, greedy(max_tokens))
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out = o
    return out


def _block_bytes(loaded: Any, block_size: int) -> int:
    from pagedkv.kv import KVCacheSpec

    c = loaded.config
    return KVCacheSpec(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                       dtype="float32").block_bytes(block_size)


def _tier_specs(cell: str, args: Any, work_bytes: int, tmp: str) -> list[str] | None:
    specs = {"none": None, "host": [f"host:{2 * work_bytes}"], "disk": [f"disk:{tmp}/{cell}:{4 * work_bytes + (64 << 20)}"],
             "host+disk": [f"host:{max(1, int(args.host_fraction * work_bytes))}",
                           f"disk:{tmp}/{cell}:{4 * work_bytes + (64 << 20)}"]}
    return specs[cell]


def run_conversations(loaded: Any, args: Any) -> dict[str, Any]:
    rng = random.Random(args.seed)
    vocab = int(loaded.config.vocab_size)
    users = [[random_tokens(rng, args.first_user_tokens if t == 0 else args.user_tokens, vocab)
              for t in range(args.turns)] for _ in range(args.conversations)]
    final_len = args.first_user_tokens + (args.turns - 1) * args.user_tokens + args.turns * args.answer_tokens
    bs = args.block_size
    work_blocks = args.conversations * cdiv(final_len, bs)
    one_request = cdiv(final_len, bs) + 2
    pool = max(int(args.pool_fraction * work_blocks), one_request)
    block_bytes = _block_bytes(loaded, bs)
    work_bytes = work_blocks * block_bytes
    res: dict[str, Any] = {"conversations": args.conversations, "turns": args.turns,
                           "first_user_tokens": args.first_user_tokens, "user_tokens": args.user_tokens,
                           "answer_tokens": args.answer_tokens, "block_size": bs, "working_set_blocks": work_blocks,
                           "pool_blocks": pool, "pool_fraction": pool / work_blocks, "block_bytes": block_bytes,
                           "cells": {}}
    cells = args.cells.split(",")
    with tempfile.TemporaryDirectory(prefix="pagedkv-offload-") as tmp:
        log(f"[offload] conversations ({args.conversations} x {args.turns} turns, pool {pool} of {work_blocks} "
            f"blocks), side by side: {', '.join(cells)}")
        engines = {c: _engine(loaded, args, pool, final_len + 8, _tier_specs(c, args, work_bytes, tmp)) for c in cells}
        for eng in engines.values():
            warm_up(eng, random_tokens(random.Random(99), 24, vocab))
        runs = {c: {"ttfts": [], "recomputed": 0, "history": 0, "outs": [], "wall": 0.0} for c in cells}
        hist = {c: [[] for _ in range(args.conversations)] for c in cells}
        for turn in range(args.turns):
            for conv in range(args.conversations):
                for c in cells:  # the same request on every engine, one after the other
                    h, r = hist[c], runs[c]
                    prompt = h[conv] + users[conv][turn]
                    t0 = time.perf_counter()
                    o = _ask(engines[c], f"c{conv}t{turn}", prompt, args.answer_tokens)
                    r["wall"] += time.perf_counter() - t0
                    r["ttfts"].append(o.metrics.ttft)
                    r["history"] += len(h[conv])
                    r["recomputed"] += max(0, len(h[conv]) - o.num_cached_tokens)
                    h[conv] = prompt + o.token_ids
                    r["outs"].append(o.token_ids)
        for c, eng in engines.items():
            st, r = eng.get_stats(), runs[c]
            eng.close()
            res["cells"][c] = {
                "ttft_s": summarize(r["ttfts"]), "wall_s": r["wall"], "history_tokens": r["history"],
                "prefix_tokens_recomputed": r["recomputed"], "pool_hit_tokens": st.kv_pool_hit_tokens,
                "tiers": st.kv_tiers.get("tiers", {}), "transfer": st.kv_tiers.get("transfer", {}),
            }
    answers = {c: runs[c]["outs"] for c in cells}
    base = res["cells"].get("none")
    for cell, r in res["cells"].items():
        if base is not None and cell != "none":
            r["ttft_p50_ratio"] = r["ttft_s"]["p50"] / base["ttft_s"]["p50"]
            r["recomputed_ratio"] = r["prefix_tokens_recomputed"] / max(1, base["prefix_tokens_recomputed"])
            r["goal_met"] = bool(r["ttft_p50_ratio"] <= 0.3 and r["recomputed_ratio"] <= 0.2)
    first = next(iter(answers.values()))
    res["same_outputs"] = all(a == first for a in answers.values())
    res["goal"] = "TTFT p50 <= 0.3x, prefix tokens recomputed <= 0.2x (with tiers vs without)"
    return res


def run_restart(loaded: Any, args: Any) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    vocab = int(loaded.config.vocab_size)
    prefix = random_tokens(rng, args.prefix_len, vocab)
    questions = [random_tokens(rng, args.user_tokens, vocab) for _ in range(args.trials)]
    mml = args.prefix_len + args.user_tokens + args.answer_tokens + 8
    blocks = cdiv(mml, args.block_size) + 4
    warm = random_tokens(random.Random(98), 24, vocab)
    with tempfile.TemporaryDirectory(prefix="pagedkv-restart-") as tmp:
        spec = [f"disk:{tmp}/kv:{2 * blocks * _block_bytes(loaded, args.block_size) + (64 << 20)}"]
        log(f"[offload] restart: storing a {args.prefix_len}-token prefix")
        first = _engine(loaded, args, blocks, mml, spec)
        stored = _ask(first, "store", prefix + [1], 1)
        first.close()
        restart, cold, cached, same = [], [], [], True
        for i, q in enumerate(questions):
            log(f"[offload] restart trial {i + 1}/{args.trials}")
            eng = _engine(loaded, args, blocks, mml, spec)  # a restart: the index comes from disk
            warm_up(eng, warm)
            o = _ask(eng, f"r{i}", prefix + q, args.answer_tokens)
            eng.close()
            ref = _engine(loaded, args, blocks, mml, None)
            warm_up(ref, warm)
            c = _ask(ref, f"c{i}", prefix + q, args.answer_tokens)
            restart.append(o.metrics.ttft)
            cold.append(c.metrics.ttft)
            cached.append(o.num_cached_tokens_by_tier)
            same = same and o.token_ids == c.token_ids
    ratio = statistics.median(restart) / statistics.median(cold)
    return {"prefix_tokens": args.prefix_len, "question_tokens": args.user_tokens, "stored_prompt": len(stored.prompt_token_ids),
            "ttft_restart_s": restart, "ttft_cold_s": cold, "cached_tokens_by_tier": cached,
            "ttft_median_ratio": ratio, "same_outputs": same, "goal": "<= 0.3", "goal_met": bool(ratio <= 0.3 and same)}


def collect(args: argparse.Namespace, loaded: Any = None) -> dict[str, Any]:
    if args.tiny:
        args.conversations, args.turns, args.first_user_tokens, args.prefix_len, args.trials = 2, 2, 48, 96, 1
    facts = RunFacts.start(args.threads)
    loaded = load_fp32_model(loaded, args.model)
    data = {"benchmark": "offload", "model": loaded.config.model_id, "tiny": bool(args.tiny), "note": args.note,
            "threads": args.threads, "conversations": run_conversations(loaded, args), "restart": run_restart(loaded, args)}
    data.update(facts.finish())
    return data


def run(args: argparse.Namespace, loaded: Any = None) -> int:
    data = collect(args, loaded)
    publish("offload", data, render_markdown, args.out_dir, plots=None if args.no_plot else plots,
            as_json=args.json)
    return 0
