"""The sharing goals of ``pagedkv bench ablation --part sharing``, results: the variant
``sharing`` of ``docs/benchmarks/ablation.*``:

* prefix TTFT: requests whose prompts are one long system prompt + a distinct question, all
  at once (burst) and one at a time (sequential); mean TTFT with prefix caching on / off
  (goal <= 0.2), outputs equal;
* parallel sampling: n samples of one prompt vs n independent requests with the same seeds:
  peak KV blocks in use (goal <= 0.3), each sample equal to its independent twin.

The flags are ``pagedkv bench ablation``'s (:mod:`pagedkv.bench.ablation.run`).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from pagedkv.bench.common import drain, engine_from_args, greedy, load_average, machine_info, tokens_computed
from pagedkv.bench.workload import random_tokens, summarize
from pagedkv.utils import cdiv


def _prefix_run(loaded: Any, args: argparse.Namespace, prompts: list[list[int]], caching: bool,
                sequential: bool) -> dict[str, Any]:
    need_blocks = cdiv(max(len(p) for p in prompts) + args.prefix_output_len, args.block_size)
    # room for every request at once: the cells differ in caching only, not in memory pressure
    eng = engine_from_args(loaded, args, enable_prefix_caching=caching, num_blocks=len(prompts) * need_blocks + 8,
                           max_model_len=max(args.max_model_len, need_blocks * args.block_size))
    sp = greedy(args.prefix_output_len)
    outs: dict[str, Any] = {}
    t0 = time.perf_counter()
    if sequential:
        for i, p in enumerate(prompts):
            eng.add_request(f"q{i}", p, sp)
            outs.update(drain(eng))
    else:
        for i, p in enumerate(prompts):
            eng.add_request(f"q{i}", p, sp)
        outs = drain(eng)
    wall = time.perf_counter() - t0
    order = [outs[f"q{i}"] for i in range(len(prompts))]
    st = eng.get_stats()
    return {
        "caching": caching,
        "ttft_s": summarize(o.metrics.ttft for o in order),
        "wall_s": wall,
        "tokens_computed": tokens_computed(eng),
        "prefix_hit_tokens": st.kv_prefix_hits,
        "prefix_hit_rate": st.kv_prefix_hit_rate,
        "_tokens": [o.token_ids for o in order],
        "_ttfts": [o.metrics.ttft for o in order],
    }


def run_prefix_ttft(loaded: Any, args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    vocab = int(loaded.config.vocab_size)
    system = random_tokens(rng, args.prefix_len, vocab)
    prompts = [system + random_tokens(rng, args.suffix_len, vocab) for _ in range(args.prefix_requests)]
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
    prompt = random_tokens(rng, args.n_prompt_len, int(loaded.config.vocab_size))
    base = dict(temperature=1.0, top_p=0.95, max_tokens=args.n_output_len, ignore_eos=True)
    need = args.n * cdiv(args.n_prompt_len + args.n_output_len, args.block_size)
    mml = max(args.max_model_len, args.n_prompt_len + args.n_output_len)
    res: dict[str, Any] = {"n": args.n, "prompt_tokens": args.n_prompt_len, "new_tokens": args.n_output_len,
                           "block_size": args.block_size}
    if progress:
        print(f"[sharing] parallel sampling n={args.n} ...", flush=True)
    eng = engine_from_args(loaded, args, num_blocks=need + 8, max_model_len=mml)
    t0 = time.perf_counter()
    eng.add_request("n", prompt, SamplingParams(n=args.n, seed=100, **base))
    shared = drain(eng)["n"]
    st = eng.get_stats()
    res["parallel"] = {"peak_used_blocks": st.peak_used_blocks, "peak_shared_blocks": st.peak_shared_blocks,
                       "cow_copies": st.kv_cow_copies, "tokens_computed": tokens_computed(eng),
                       "wall_s": time.perf_counter() - t0}
    if progress:
        print(f"[sharing] {args.n} independent requests ...", flush=True)
    eng = engine_from_args(loaded, args, num_blocks=need + 8, max_model_len=mml)
    t0 = time.perf_counter()
    for i in range(args.n):
        eng.add_request(f"i{i}", prompt, SamplingParams(seed=100 + i, **base))
    indep = drain(eng)
    st = eng.get_stats()
    res["independent"] = {"peak_used_blocks": st.peak_used_blocks,
                          "tokens_computed": tokens_computed(eng),
                          "wall_s": time.perf_counter() - t0}
    ratio = res["parallel"]["peak_used_blocks"] / res["independent"]["peak_used_blocks"]
    same = [c.token_ids for c in shared.outputs] == [indep[f"i{i}"].token_ids for i in range(args.n)]
    res.update({"peak_blocks_ratio": ratio, "same_outputs": same, "goal": "<= 0.3",
                "goal_met": bool(ratio <= 0.3 and same)})
    return res


def run_sharing(loaded: Any, args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    load0 = load_average()
    pt = run_prefix_ttft(loaded, args, progress)
    ps = run_parallel_sampling(loaded, args, progress)
    return {
        "benchmark": "sharing",
        "prefix_ttft": pt,
        "parallel_sampling": ps,
        "threads": args.threads, "tiny": bool(args.tiny),
        "load_average_1min": {"start": load0, "end": load_average()},
        "machine": machine_info(args.threads),
    }
