"""KV cache formats: perplexity and greedy agreement against the float32 cache (int8, fp8, bf16).

For each ``--kv-cache-dtypes`` format, the bundled SmolLM2-135M with float32 weights and
activations, on the CPU backend:

* **perplexity** of the fixed text ``tests/data/quality_text.txt`` (the text of the
  weight-format benchmark, ``pagedkv bench quality``): windows of ``--window`` tokens, each a
  fresh sequence written through the paged cache in chunks of ``--chunk`` tokens, so every
  chunk's queries read the earlier chunks' K/V in the cache format, as in serving; every
  token after a window's first is scored. One pass per ``--offsets`` entry (the windows start
  there): a quantised cache's rounding is a fixed but arbitrary perturbation per context, so
  one alignment alone moves the perplexity change by about +-0.4% on this text; the passes
  average it. Reported with the mean per-token NLL difference from float32 and its
  standard error (the same tokens in every format);
* **greedy agreement** with the float32 cache: ``PROMPTS`` (16, chat template) x
  ``--max-tokens`` (64) tokens, EOS ignored: identical completions, the mean fraction of
  tokens before the first difference, and the fraction of positions that agree;
* **bounds**: int8 perplexity within 1% of float32's, fp8_e4m3 within 2%.

Results: the variant ``kv_cache`` of ``weights_quality.{json,md}``, beside the weight formats'
(``pagedkv bench quality``; :mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

from pagedkv.bench.common import REPO_ROOT, RunFacts, add_run_options, load_fp32_model, log
from pagedkv.bench.report import closing_lines, markdown_table, publish
from pagedkv.model.tokenizer import encode_prompt

TEXT = REPO_ROOT / "tests" / "data" / "quality_text.txt"
BOUNDS = {"int8": 0.01, "fp8_e4m3": 0.02}  # relative perplexity increase allowed
PROMPTS = [
    "Explain what a page table does in an operating system.",
    "Write two sentences about the moon.",
    "What is the boiling point of water at sea level?",
    "Name four animals that live in the ocean.",
    "How many days are there in a leap year?",
    "Give three tips for learning a new language.",
    "What does a compiler do?",
    "Describe the colour green without naming it.",
    "Who wrote the play Hamlet?",
    "Why do leaves change colour in autumn?",
    "Write a limerick about a cat and a hat.",
    "What is the square root of 144?",
    "Suggest a title for a book about trains.",
    "How does a refrigerator keep food cold?",
    "List the first five prime numbers.",
    "What is the main ingredient of guacamole?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtypes", default="float32,bfloat16,int8,fp8_e4m3,fp8_e5m2",
                   help="formats to compare (float32 is the reference and always runs)")
    p.add_argument("--kv-quant-group-size", type=int, default=None, help="elements per scale (default head_dim)")
    p.add_argument("--text", default=str(TEXT), help="perplexity text (default tests/data/quality_text.txt)")
    p.add_argument("--window", type=int, default=1024, help="perplexity window, tokens (default 1024)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk inside a window, tokens (default 256)")
    p.add_argument("--offsets", default="0,256,512,768", help="first window's start per pass (default 0,256,512,768)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    add_run_options(p, tiny="a 200-token text window, 2 prompts x 8 tokens")


def token_nll(loaded: Any, token_ids: list[int], kv_cache_dtype: str, window: int, chunk: int,
              group: int | None = None, offset: int = 0) -> list[float]:
    """Per-token negative log-likelihoods (nats) of ``token_ids[offset + 1:]`` within windows of
    ``window`` tokens from ``offset`` (each window's first token is not scored), the model run through a
    paged cache of ``kv_cache_dtype`` in chunks of ``chunk`` tokens (``ModelRunner``; the
    logits of every row are kept)."""
    import torch

    from pagedkv.attention import get_backend
    from pagedkv.attention.quant import FORMATS
    from pagedkv.utils import cdiv, torch_dtype
    from pagedkv.worker.runner import ModelRunner

    mc, bs = loaded.config, 16
    cache_dtype = kv_cache_dtype if kv_cache_dtype in FORMATS else torch_dtype(kv_cache_dtype)
    runner = ModelRunner(loaded.model, get_backend("cpu"), mc.num_layers, cdiv(window, bs), bs,
                         mc.num_kv_heads, mc.head_dim, cache_dtype, "cpu", group if kv_cache_dtype in FORMATS else None)
    table = list(range(cdiv(window, bs)))
    out: list[float] = []
    for w0 in range(offset, len(token_ids) - 1, window):
        win = token_ids[w0:w0 + window]
        for s in range(0, len(win) - 1, chunk):
            toks = win[s:s + chunk]
            inp = runner.prepare([toks], [s], [table], [True])
            targets = win[s + 1:s + 1 + len(toks)]  # the last row of a window predicts nothing
            inp.logits_indices = torch.arange(len(targets))
            logp = torch.log_softmax(runner.execute(inp), dim=-1)
            out += (-logp[torch.arange(len(targets)), torch.tensor(targets)]).tolist()
    return out


def greedy_tokens(loaded: Any, kv_cache_dtype: str, prompts: list[str], max_tokens: int,
                  group: int | None = None) -> list[list[int]]:
    """Greedy completions (EOS ignored) of ``prompts`` through the chat template, with
    ``kv_cache_dtype``."""
    from pagedkv.attention.quant import FORMATS
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.request import SamplingParams

    llm = LLM(loaded, kv_cache_dtype=kv_cache_dtype, num_blocks=512, max_num_seqs=16,
              kv_quant_group_size=group if kv_cache_dtype in FORMATS else None)
    ids = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.token_ids) for o in outs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Identical completions, mean fraction of tokens before the first difference, fraction of
    positions equal."""
    prefix, same, pos, total = [], 0, 0, 0
    for a, b in zip(ref, got):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(k / max(len(a), 1))
        same += a == b
        pos += sum(x == y for x, y in zip(a, b))
        total += len(a)
    return {"identical": same, "prompts": len(ref), "mean_prefix_fraction": statistics.mean(prefix),
            "position_agreement": pos / max(total, 1)}


def run_quality(args: argparse.Namespace, loaded: Any = None) -> dict[str, Any]:
    from pathlib import Path

    from pagedkv.utils import kv_cache_dtype

    facts = RunFacts.start(args.threads)
    loaded = load_fp32_model(loaded)
    names = [kv_cache_dtype(n) for n in str(args.kv_cache_dtypes).split(",") if n.strip()]
    names = ["float32"] + [n for n in names if n != "float32"]
    text = Path(args.text).read_text()
    ids = encode_prompt(loaded.tokenizer, text)
    prompts, max_tokens = PROMPTS, args.max_tokens
    offsets = [int(x) for x in str(args.offsets).split(",") if x.strip()]
    if args.tiny:
        ids, prompts, max_tokens, offsets = ids[:200], PROMPTS[:2], min(max_tokens, 8), [0]
    t0 = time.time()
    rows, nll, greedy = [], {}, {}
    for n in names:
        t = time.time()
        nll[n] = [x for o in offsets for x in token_nll(loaded, ids, n, args.window, args.chunk,
                                                         args.kv_quant_group_size, o)]
        greedy[n] = greedy_tokens(loaded, n, prompts, max_tokens, args.kv_quant_group_size)
        base = nll["float32"]
        diff = [a - b for a, b in zip(nll[n], base)]
        ppl, ppl0 = math.exp(statistics.mean(nll[n])), math.exp(statistics.mean(base))
        row = {"kv_cache_dtype": n, "perplexity": ppl, "perplexity_vs_float32": ppl / ppl0 - 1,
               "mean_nll_diff": statistics.mean(diff),
               "nll_diff_stderr": statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else 0.0,
               **agreement(greedy["float32"], greedy[n]), "seconds": time.time() - t}
        if n in BOUNDS:
            row["bound"] = BOUNDS[n]
            row["within_bound"] = row["perplexity_vs_float32"] <= BOUNDS[n]
        rows.append(row)
        log(f"[kv_quality] {n}: perplexity {ppl:.4f} ({100 * row['perplexity_vs_float32']:+.2f}% vs float32), "
            f"greedy identical {row['identical']}/{row['prompts']}, prefix {row['mean_prefix_fraction']:.2f} "
            f"({row['seconds']:.0f} s)")
    return {
        "benchmark": "kv_quality",
        "config": {"text": str(Path(args.text).relative_to(REPO_ROOT)) if Path(args.text).is_relative_to(REPO_ROOT)
                   else args.text, "text_tokens": len(ids), "window": args.window, "chunk": args.chunk,
                   "offsets": offsets, "scored_tokens": len(nll["float32"]),
                   "prompts": len(prompts), "max_tokens": max_tokens, "weights": "float32",
                   "kv_quant_group_size": args.kv_quant_group_size or int(loaded.config.head_dim),
                   "backend": "cpu", "threads": facts.threads, "tiny": bool(args.tiny)},
        "results": rows,
        "runtime_s": time.time() - t0,
        **facts.finish(),
    }


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    c = data["config"]
    lines = [
        "# KV cache formats: quality against the float32 cache",
        "",
        f"SmolLM2-135M-Instruct, {c['weights']} weights and activations, CPU backend, torch threads "
        f"{c['threads']}. Quantised formats keep one bf16 scale per {c['kv_quant_group_size']} elements of "
        "each head vector (int8 / fp8 codes, see `pagedkv.attention.quant`).",
        "",
        f"* Perplexity: `{c['text']}` ({c['text_tokens']} tokens), windows of {c['window']} tokens written "
        f"through the paged cache in chunks of {c['chunk']} (each chunk reads the earlier chunks' K/V in the "
        f"cache format); every token after a window's first scored; one pass per window offset {c['offsets']} "
        f"({c['scored_tokens']} scored tokens in all: a cache's rounding is a fixed but arbitrary perturbation "
        "per context, so one alignment alone moves the change by about +-0.4% here). `mean_nll_diff` is the "
        "mean per-token NLL change from float32 (nats), `nll_diff_stderr` its standard error.",
        f"* Greedy agreement with the float32 cache: {c['prompts']} chat prompts x {c['max_tokens']} tokens "
        "(EOS ignored): identical completions, mean fraction of tokens before the first difference, "
        "fraction of equal positions.",
        "* Bounds: int8 within 1% of float32's perplexity, fp8_e4m3 within 2%.",
        "",
        markdown_table(data["results"], ["kv_cache_dtype", "perplexity", "perplexity_vs_float32", "bound",
                                         "within_bound", "mean_nll_diff", "nll_diff_stderr", "identical",
                                         "prompts", "mean_prefix_fraction", "position_agreement"]),
    ]
    return "\n".join(lines + closing_lines(data, plots)) + "\n"


def run(args: argparse.Namespace) -> int:
    data = run_quality(args)
    publish("weights_quality", data, render_markdown, args.out_dir, variant="kv_cache", as_json=args.json,
            json_keys=("config", "results", "runtime_s"))
    return 0
