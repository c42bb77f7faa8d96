"""Data-parallel routing: replicas on Ray Serve, round-robin vs prefix-aware routing.

* Conversations: ``--users`` users, each with its own ``--system-tokens``-token system prompt,
  ask ``--turns`` questions of ``--question-tokens`` tokens each (prompt = the user's system
  prompt + the question; ``--answer-tokens`` greedy tokens, EOS ignored). Requests go out turn
  by turn, the users shuffled within a turn, through ``--concurrency`` closed-loop streams.
  Each replica's KV pool holds ``--pool-fraction`` of all users' system prompts (plus the
  requests in flight): the replicas together hold every user's prefix, one alone does not.
  Round-robin sends each user to every replica, so both must cache every prefix and the LRU
  evicts them; prefix-aware keeps a user on the replica that holds its prefix. Per policy:
  prefix hit rate (cached prompt tokens / prompt tokens, from each response's
  ``usage.prompt_tokens_details.cached_tokens``), TTFT (client side: request sent -> first
  streamed token), requests per replica; the outputs of both policies are compared.
  Goals: hit rate >= 2x round-robin's, TTFT p50 <= 0.6x round-robin's, same outputs.
* Uniform mix: ``--uniform-requests`` prompts with no shared prefix through
  ``--uniform-concurrency`` streams under prefix-aware routing; each replica's running +
  waiting requests are sampled (its engine, every 100 ms) while the run lasts. Goal: no
  replica's mean above 1.5x the mean over replicas.

Every policy starts with cold prefix caches (``reset_prefix_cache`` on every replica) on the
same replicas (Ray started once, models loaded once); the policies run in ``--rounds`` rounds
in ABBA order so a drift in the shared machine's load hits both alike. Loopback HTTP, wall
clock; ratios measured side by side in one run are the result.

Results: ``route.{json,md,png}``, the variant ``default`` (``--variant`` names another, e.g. a
run with roomier pools; :mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
from typing import Any

from pagedkv.bench.common import RunFacts, add_options, add_run_options, log
from pagedkv.bench.http import run_closed_loop
from pagedkv.bench.report import publish
from pagedkv.bench.route.report import plots, render_markdown
from pagedkv.bench.workload import BenchRequest, random_tokens, summarize
from pagedkv.bench.variants import add_variant_option
from pagedkv.utils import cdiv

POLICIES = ("round-robin", "prefix-aware")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, [
        ("--replicas", 2, "engine replicas (default 2)"),
        ("--users", 16, "users, each with its own system prompt (default 16)"),
        ("--turns", 4, "questions per user (default 4)"),
        ("--system-tokens", 192, "tokens of each user's system prompt (default 192)"),
        ("--question-tokens", 16, "tokens of each question (default 16)"),
        ("--answer-tokens", 8, "greedy tokens of each answer (default 8)"),
        ("--block-size", 16, "tokens per KV block (default 16)"),
        ("--pool-fraction", 0.55, "each replica's cache / all users' system prompts (default 0.55)"),
        ("--concurrency", 1, "closed-loop streams of the conversation runs (default 1: a batch of one, so "
                             "outputs compare exactly and TTFT is the request's own prefill)"),
        ("--rounds", 2, "rounds per policy, ABBA order (default 2)"),
        ("--uniform-requests", 48, "requests of the uniform mix (default 48)"),
        ("--uniform-concurrency", 8, "closed-loop streams of the uniform mix (default 8)"),
        ("--uniform-prompt-tokens", 48, "prompt tokens of each uniform request (default 48)"),
        ("--uniform-answer-tokens", 16, "greedy tokens of each uniform answer (default 16)"),
        ("--replica-threads", 1, "torch threads per replica (default 1)"),
        ("--max-run-s", 900.0, "cut a run after this many seconds (default 900)"),
        ("--seed", 0, "token seed (default 0)"),
        ("--weights", "fp32", "the replicas' weight format (default fp32: exact, like the other benches)"),
    ])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    add_variant_option(p, "default")
    add_run_options(p, tiny="3 users x 2 turns, 32-token system prompts, 8 uniform requests", note=True)


def _apply_tiny(args: argparse.Namespace) -> None:
    args.users, args.turns, args.system_tokens, args.question_tokens = 3, 2, 32, 4
    args.answer_tokens, args.rounds, args.uniform_requests, args.uniform_concurrency = 2, 1, 8, 4
    args.uniform_prompt_tokens, args.uniform_answer_tokens = 16, 2


def conversation_requests(args: Any, vocab: int) -> tuple[list[BenchRequest], list[tuple[int, int]]]:
    """The conversation requests in sending order and their (user, turn)."""
    rng = random.Random(args.seed)
    systems = [random_tokens(rng, args.system_tokens, vocab) for _ in range(args.users)]
    questions = [[random_tokens(rng, args.question_tokens, vocab) for _ in range(args.turns)] for _ in range(args.users)]
    reqs, keys = [], []
    for t in range(args.turns):
        users = list(range(args.users))
        rng.shuffle(users)
        for u in users:
            reqs.append(BenchRequest(systems[u] + questions[u][t], args.answer_tokens))
            keys.append((u, t))
    return reqs, keys


class LoadSampler:
    """Samples every replica's running + waiting requests (its engine's stats) every
    ``period_s`` seconds in a thread until :meth:`stop`."""

    def __init__(self, svc: Any, period_s: float = 0.1) -> None:
        self.svc, self.period_s = svc, period_s
        self.samples: list[list[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            stats = [h.stats.remote().result() for h in self.svc.handles]
            self.samples.append([s["running"] + s["waiting"] for s in stats])
            self._stop.wait(self.period_s)

    def stop(self) -> dict[str, Any]:
        """``{"mean_per_replica", "max_over_mean", "samples"}``."""
        self._stop.set()
        self._thread.join()
        busy = [s for s in self.samples if sum(s)] or [[0] * len(self.svc.handles)]
        means = [sum(col) / len(busy) for col in zip(*busy)]
        overall = sum(means) / len(means)
        return {"mean_per_replica": means, "max_over_mean": max(means) / overall if overall else float("nan"),
                "samples": len(busy)}


def _run_policy(svc: Any, policy: str, reqs: list[BenchRequest], concurrency: int, max_run_s: float,
                sample: bool = False) -> dict[str, Any]:
    from pagedkv.serving.threaded import ThreadedServer

    svc.reset_prefix_caches()
    app = svc.build_ingress(policy)
    with ThreadedServer(app) as srv:
        sampler = LoadSampler(svc) if sample else None
        t0 = time.time()
        records, _ = run_closed_loop(srv.url, reqs, concurrency, max_run_s, desc=policy, progress=False)
        wall = time.time() - t0
        load = sampler.stop() if sampler else None
        routed = [r.routed for r in app.state.ingress.router.replicas]
    ok = [r for r in records if r.status == "ok"]
    prompt_tokens = sum(q.prompt_len for q, r in zip(reqs, records) if r.status == "ok")
    cached = sum(r.cached_tokens for r in ok)
    return {
        "policy": policy, "completed": len(ok), "requests": len(reqs), "wall_s": wall,
        "prompt_tokens": prompt_tokens, "cached_tokens": cached, "hit_rate": cached / max(prompt_tokens, 1),
        "ttft_s": [r.first_token_time - r.arrival_time for r in ok if r.first_token_time is not None],
        "texts": [r.text if r.status == "ok" else None for r in records], "routed": routed, "load": load,
    }


def _pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one policy together."""
    ttfts = [x for r in runs for x in r["ttft_s"]]
    prompt, cached = sum(r["prompt_tokens"] for r in runs), sum(r["cached_tokens"] for r in runs)
    return {"rounds": len(runs), "completed": sum(r["completed"] for r in runs),
            "requests": sum(r["requests"] for r in runs), "hit_rate": cached / max(prompt, 1),
            "hit_rate_per_round": [r["hit_rate"] for r in runs], "ttft_s": summarize(ttfts),
            "ttft_p50_per_round": [summarize(r["ttft_s"])["p50"] for r in runs],
            "routed_per_replica": [r["routed"] for r in runs], "wall_s": sum(r["wall_s"] for r in runs)}


def run(args: argparse.Namespace) -> int:
    from pagedkv.model.loader import load_config
    from pagedkv.serving.replicas.launch import ReplicaService

    if args.tiny:
        _apply_tiny(args)
    facts = RunFacts.start(args.threads)
    vocab = int(load_config(args.model).vocab_size)
    reqs, keys = conversation_requests(args, vocab)
    rng = random.Random(args.seed + 1)
    uniform = [BenchRequest(random_tokens(rng, args.uniform_prompt_tokens, vocab), args.uniform_answer_tokens)
               for _ in range(args.uniform_requests)]
    bs = args.block_size
    per_request = cdiv(args.system_tokens + args.question_tokens + args.answer_tokens, bs)
    system_blocks = args.users * (args.system_tokens // bs)
    per_uniform = cdiv(args.uniform_prompt_tokens + args.uniform_answer_tokens, bs)
    in_flight = max(args.concurrency * per_request, args.uniform_concurrency * per_uniform)
    num_blocks = int(args.pool_fraction * system_blocks) + in_flight + 1
    max_len = max(args.system_tokens + args.question_tokens + args.answer_tokens,
                  args.uniform_prompt_tokens + args.uniform_answer_tokens)
    engine = {"block_size": bs, "num_blocks": num_blocks, "max_model_len": cdiv(max_len, bs) * bs,
              "enable_prefix_caching": True, "kv_events": "auto", "seed": 0, "dtype": "float32",
              "weights": args.weights}
    t_all = time.time()
    log(f"[route] starting Ray and {args.replicas} replicas ({num_blocks} KV blocks each)")
    svc = ReplicaService.start(args.replicas, args.model, engine, {}, num_cpus=os.cpu_count(),
                               replica_threads=args.replica_threads)
    try:
        warm = [BenchRequest(random_tokens(rng, 24, vocab), 2) for _ in range(2 * args.replicas)]
        _run_policy(svc, "round-robin", warm, args.replicas, args.max_run_s)  # untimed: first forwards
        order = [POLICIES[i % 2] if (i // 2) % 2 == 0 else POLICIES[1 - i % 2] for i in range(2 * args.rounds)]
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
        for policy in order:
            log(f"[route] conversations, {policy}")
            runs[policy].append(_run_policy(svc, policy, reqs, args.concurrency, args.max_run_s))
        log("[route] uniform mix, prefix-aware")
        uni = _run_policy(svc, "prefix-aware", uniform, args.uniform_concurrency, args.max_run_s, sample=True)
        info = svc.info
    finally:
        svc.stop()
    pooled = {p: _pool(rs) for p, rs in runs.items()}
    rr, pa = pooled["round-robin"], pooled["prefix-aware"]
    every = [r["texts"] for p in POLICIES for r in runs[p]]  # every run's outputs, request by request
    differ = sum(1 for outs in zip(*every) if len(set(outs)) > 1)
    same = differ == 0
    hit_ratio = pa["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
    ttft_ratio = pa["ttft_s"]["p50"] / rr["ttft_s"]["p50"]
    data = {
        "benchmark": "route", "model": info["model_id"], "threads": facts.threads,
        "replica_threads": args.replica_threads, "weights": args.weights, "tiny": bool(args.tiny), "notes": args.note,
        "replicas": args.replicas, "num_blocks_per_replica": num_blocks, "block_size": bs,
        "conversations": {"requests": len(reqs), "users": args.users, "turns": args.turns, "system_tokens": args.system_tokens,
                          "question_tokens": args.question_tokens, "answer_tokens": args.answer_tokens,
                          "concurrency": args.concurrency, "pool_fraction": args.pool_fraction,
                          "system_prompt_blocks": system_blocks, "order": order},
        "policies": pooled,
        "hit_rate_ratio": hit_ratio, "ttft_p50_ratio": ttft_ratio, "same_outputs": same,
        "requests_with_differing_outputs": differ,
        "goals": {"hit_rate_ratio >= 2": hit_ratio >= 2.0, "ttft_p50_ratio <= 0.6": ttft_ratio <= 0.6,
                  "same outputs": same,
                  "uniform max/mean <= 1.5": (uni["load"] or {}).get("max_over_mean", 9.9) <= 1.5},
        "uniform": {"requests": args.uniform_requests, "concurrency": args.uniform_concurrency,
                    "prompt_tokens": args.uniform_prompt_tokens, "answer_tokens": args.uniform_answer_tokens,
                    "completed": uni["completed"], "routed_per_replica": uni["routed"], "load": uni["load"],
                    "wall_s": uni["wall_s"]},
        "elapsed_s": time.time() - t_all,
        **facts.finish(),
    }
    publish("route", data, render_markdown, args.out_dir, variant=args.variant or "default",
            plots=None if args.no_plot else plots, as_json=args.json)
    return 0 if all(data["goals"].values()) or args.tiny else 1
