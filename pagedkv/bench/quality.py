"""Weight formats (fp32 | bf16 | int8 | int4): quality vs fp32 and linear-layer time per kernel route.

``pagedkv bench quality`` writes the variant ``<model>`` of ``weights_quality.{json,md}``
(``smollm2-135m`` for the bundled model, else the ``--model`` file's stem): per format,
perplexity on the fixed text ``tests/data/quality_text.txt`` (non-overlapping windows, every
token after a window's first scored; once whole, the prefill route, and once in
``DECODE_ROWS``-token chunks, the decode-batch route) and greedy agreement with fp32 (16 chat
prompts x 64 tokens, EOS ignored): the mean fraction of tokens before the first difference and
the number of identical completions; with the bounds (int8 within 2% of fp32's perplexity, int4
within 6%).

``--part routes`` writes the variant ``routes`` (``routes_<model>`` with ``--model``): the time
of all linear layers of one step (30 layers' q/k/v, o, gate/up, down on the model's own
weights, plus the LM head on the rows that are sampled) at decode batch 1 / 8 / 32 / 64 and a
512-token prefill (head on one row), for every format and route (``fast`` kernel, ``fallback``
dequantise + ``F.linear``), fp32 ``F.linear`` measured in the same loop; the CPU's flags and
torch's capability are recorded. ``ATEN_CPU_CAPABILITY=avx2`` shows what an AVX2-only CPU's
kernels do.

``pagedkv bench kv_quality`` writes the same result set's variant ``kv_cache`` (the KV cache
formats' quality; :mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from pagedkv.bench.variants import add_variant_option, variant_name

TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "quality_text.txt"
FORMATS = ("fp32", "bf16", "int8", "int4")
BOUNDS = {"bf16": 0.02, "int8": 0.02, "int4": 0.06}  # relative perplexity increase allowed
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "Summarise the plot of Romeo and Juliet.",
    "What are the planets of the solar system?",
    "Write a short story about a robot who learns to paint.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Describe a cat to someone who has never seen one.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery.",
]
#: perplexity is measured twice: whole windows (the prefill route) and in chunks of this many
#: tokens (the route of a decode batch that size: dynamic int8 in int8/int4, ``pagedkv.model.quant``)
DECODE_ROWS = 32
STEP_ROWS = {"decode 1": 1, "decode 8": 8, "decode 32": 32, "decode 64": 64, "prefill 512": 512}
RESULT_SET = "weights_quality"  #: both parts and bench kv_quality: variants of weights_quality.*
DEFAULT_MODEL_VARIANT = "smollm2-135m"  #: the bundled model's variant


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=["quality", "routes"], default="quality")
    p.add_argument("--model", default=None,
                   help="GGUF file, HF dir or bundled name (default: the bundled SmolLM2; gemma-3-270m: its K-quants)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats (default all)")
    p.add_argument("--text", default=str(TEXT), help="perplexity text (default tests/data/quality_text.txt)")
    p.add_argument("--window", type=int, default=1024, help="perplexity window in tokens (default 1024)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per cell (routes; prefill: half)")
    add_variant_option(p, "the model (smollm2-135m for the bundled one, else the --model file's stem); "
                          "--part routes: routes (routes_<model> with --model)")


def default_variant(args: argparse.Namespace) -> str:
    """The variant a run writes without ``--variant``: the model (``smollm2-135m``, the bundled
    one, else the ``--model`` file's stem, ``gemma-3-270m``); ``routes`` (``routes_<model>``)."""
    model = variant_name(Path(str(args.model)).stem) if args.model else None
    if args.part == "routes":
        return f"routes_{model}" if model else "routes"
    return model or DEFAULT_MODEL_VARIANT


def _formats(text: str) -> list[str]:
    from pagedkv.errors import ConfigError
    from pagedkv.model.quant import check_weights

    names = [check_weights(f) for f in text.split(",") if f.strip()]
    if "auto" in names or not names:
        raise ConfigError(f"--formats: name formats among {', '.join(FORMATS)}")
    return names


def perplexity(model: Any, token_ids: list[int], window: int, backend_name: str = "cpu",
               rows: int | None = None) -> float:
    """exp(mean negative log-likelihood) of ``token_ids`` under ``model`` (a
    ``LlamaForCausalLM``), in non-overlapping windows of ``window`` tokens, each its own
    sequence; every token but a window's first is scored. ``rows``: feed each window in
    chunks of that many tokens (chunked prefill over the paged cache), so the linear layers
    see ``rows``-row inputs and run the kernel route of a decode batch that size (``None``:
    the whole window at once, the wide prefill route). Raises ``ValueError`` for a window or
    a text under 2 tokens (nothing to score)."""
    import torch

    from pagedkv.attention import get_backend
    from pagedkv.attention.base import AttentionMetadata
    from pagedkv.testing.caches import allocate_kv_caches

    if window < 2 or len(token_ids) < 2:
        raise ValueError(f"perplexity needs a window of >= 2 tokens and a text of >= 2 tokens "
                         f"(window {window}, text {len(token_ids)} tokens)")
    backend = get_backend(backend_name)
    block = 16
    nll, count = 0.0, 0
    span = min(window, len(token_ids))  # the cache holds one window, never more than the text
    caches = allocate_kv_caches(model, backend, num_blocks=math.ceil(span / block), block_size=block)
    with torch.inference_mode():
        for start in range(0, len(token_ids) - 1, window):
            ids = token_ids[start:start + window]
            n = len(ids)
            if n < 2:
                break
            table = [list(range(math.ceil(n / block)))]
            parts = []
            chunk = rows or n
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                md = AttentionMetadata.build([b], [b - a], table, block)
                parts.append(model(torch.tensor(ids[a:b]), torch.arange(a, b), caches, md, backend))
            hidden = torch.cat(parts)
            logp = torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1)
            nll -= logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
            count += n - 1
    return math.exp(nll / count)


def greedy(loaded: Any, max_tokens: int) -> list[list[int]]:
    """Greedy completions (EOS ignored) of ``PROMPTS`` through the chat template (a base model
    without one: the prompts as plain completions)."""
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.request import SamplingParams

    llm = LLM(loaded, num_blocks=256, max_num_seqs=16)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng = llm.engine
    prompts = [eng.apply_chat_template([{"role": "user", "content": p}]) if eng.has_chat_template else eng.tokenize(p)
               for p in PROMPTS]
    return [list(o.token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, int]:
    """(mean over prompts of the fraction of tokens before the first difference, number of
    identical completions)."""
    fracs, same = [], 0
    for a, b in zip(ref, got):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        fracs.append(k / max(len(a), 1))
        same += a == b
    return statistics.mean(fracs), same


def _read_text(path: str) -> str:
    """The perplexity text, UTF-8. Raises ``ConfigError`` naming ``--text``."""
    from pagedkv.errors import ConfigError

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--text {path}: not a readable UTF-8 text file ({type(exc).__name__})") from None


def check_args(args: argparse.Namespace) -> None:
    """``ConfigError`` for option values the run cannot use, before any model is loaded."""
    from pagedkv.bench.report import results_dir
    from pagedkv.errors import ConfigError

    if args.part == "quality":
        if args.window < 2:
            raise ConfigError(f"--window: at least 2 tokens (one is scored against the one before), got {args.window}")
        if args.max_tokens < 1:
            raise ConfigError(f"--max-tokens: at least 1, got {args.max_tokens}")
    elif args.reps < 1:
        raise ConfigError(f"--reps: at least 1, got {args.reps}")
    results_dir(args.out_dir)  # a bad --out-dir fails now, not after the run


def _quality(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from pagedkv.errors import ConfigError
    from pagedkv.model.loader import load_model

    text = _read_text(args.text)
    rows, ref_tokens, ref_ppl, ref_rows = [], None, None, None
    chunk = min(DECODE_ROWS, args.window)
    for fmt in ["fp32"] + [f for f in _formats(args.formats) if f != "fp32"]:
        t0 = time.perf_counter()
        lm = load_model(args.model, weights=fmt)
        load_s = time.perf_counter() - t0
        ids = lm.tokenizer(text)["input_ids"]
        if len(ids) < 2:
            raise ConfigError(f"--text {args.text}: {len(ids)} token(s); perplexity needs at least 2")
        if args.window > lm.config.max_position_embeddings:
            raise ConfigError(f"--window {args.window}: above the model's context of "
                              f"{lm.config.max_position_embeddings} tokens")
        ppl = perplexity(lm.model, ids, args.window)
        ppl_rows = perplexity(lm.model, ids, args.window, rows=chunk)  # the decode-batch route
        tokens = greedy(lm, args.max_tokens)
        if fmt == "fp32":
            ref_tokens, ref_ppl, ref_rows = tokens, ppl, ppl_rows
        prefix, same = agreement(ref_tokens, tokens)
        rel = max(ppl / ref_ppl, ppl_rows / ref_rows) - 1.0
        bound = BOUNDS.get(fmt)
        rows.append({
            "weights": fmt, "perplexity": round(ppl, 4), f"perplexity {chunk}-row steps": round(ppl_rows, 4),
            "vs fp32 (worse of the two)": f"{rel:+.2%}",
            "bound": f"{bound:.0%}" if bound is not None else "exact",
            "within bound": bool(bound is None or rel <= bound),
            "greedy prefix agreement": round(prefix, 4), "identical completions": f"{same}/{len(PROMPTS)}",
            "routes": sorted({m.route for m in lm.model.modules() if hasattr(m, "route")}) or ["nn.Linear"],
            "load s": round(load_s, 2), "text tokens": len(ids),
        })
    data = {"rows": rows, "prompts": PROMPTS, "max_tokens": args.max_tokens, "window": args.window,
            "text": str(Path(args.text).name), "model": lm.config.model_id}
    opt = f" --model {args.model}" if args.model else ""
    md = (f"# Weight formats: quality vs fp32 ({lm.config.model_id})\n\nCommand: `pagedkv bench quality{opt}` (perplexity on "
          f"`tests/data/{data['text']}`, {rows[0]['text tokens']} tokens in windows of {args.window}; "
          f"greedy agreement on {len(PROMPTS)} prompts (through the chat template where the model has one) x {args.max_tokens} tokens, EOS ignored).\n\n")
    return data, md


def _linears(model: Any) -> tuple[list[list[Any]], Any]:
    """Per layer ``[qkv, o, gate_up, down]`` callables and the head, of a loaded model."""
    import torch.nn.functional as F

    layers = [[getattr(layer, n) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")] for layer in model.layers]
    head = model.lm_head if model.lm_head is not None else (lambda x: F.linear(x, model.embed_tokens.weight))
    return layers, head


def _step(layers: list[list[Any]], head: Any, rows: int, x: Any, x_mlp: Any) -> None:
    for qkv, o, gate_up, down in layers:
        qkv(x)
        o(x)
        gate_up(x)
        down(x_mlp)
    head(x[:1] if rows > 64 else x)


def _routes(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import torch

    from pagedkv.model.loader import load_model
    from pagedkv.model.quant import auto_route, cpu_features, resolve_weights

    cells = []  # (format, route, layers, head)
    for fmt in _formats(args.formats):
        for route in (("fast",) if fmt == "fp32" else ("fast", "fallback")):
            lm = load_model(args.model, weights=fmt, route=route)
            cells.append((fmt, route, *_linears(lm.model)))
    cfg = lm.config
    results: dict[tuple[str, str], dict[str, float]] = {(f, r): {} for f, r, *_ in cells}
    with torch.inference_mode():
        for step_name, rows in STEP_ROWS.items():
            x = torch.randn(rows, cfg.hidden_size)
            x_mlp = torch.randn(rows, cfg.intermediate_size)
            reps = max(1, args.reps // 2) if rows > 32 else args.reps
            times: dict[tuple[str, str], list[float]] = {(f, r): [] for f, r, *_ in cells}
            for f, r, layers, head in cells:  # warm-up
                _step(layers, head, rows, x, x_mlp)
            for _ in range(reps):  # interleaved, so load changes hit every cell alike
                for f, r, layers, head in cells:
                    t0 = time.perf_counter()
                    _step(layers, head, rows, x, x_mlp)
                    times[(f, r)].append(time.perf_counter() - t0)
            for key, ts in times.items():
                results[key][step_name] = statistics.median(ts) * 1e3
    base = results.get(("fp32", "fast"))
    table = []
    for (f, r), by_step in results.items():
        row: dict[str, Any] = {"weights": f, "route": r + (" (auto)" if auto_route(f) == r else "")}
        for step_name, ms in by_step.items():
            row[f"{step_name} ms"] = round(ms, 2)
            if base:
                row[f"{step_name} vs fp32"] = round(ms / base[step_name], 3)
        table.append(row)
    auto = resolve_weights("auto")
    data = {"rows": table, "cpu": cpu_features().as_dict(), "cpu_flags": _cpu_flags(),
            "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"), "auto": list(auto),
            "loadavg": os.getloadavg(), "reps": args.reps}
    md = (f"# Weight formats: linear-layer time per kernel route\n\nCommand: `pagedkv bench quality --part routes`"
          f"{' with ATEN_CPU_CAPABILITY=' + os.environ['ATEN_CPU_CAPABILITY'] if 'ATEN_CPU_CAPABILITY' in os.environ else ''}"
          f". All linear layers of one step (30 layers + LM head on the sampled rows), median of "
          f"{args.reps} interleaved runs (prefill: {max(1, args.reps // 2)}); ratios are to fp32 `F.linear` in the same loop.\n\n"
          f"torch capability `{data['cpu']['capability']}`; CPU flags: {', '.join(data['cpu_flags']) or 'none of note'}; "
          f"`weights=\"auto\"` here: **{auto[0]}** ({auto[1]}). Load average at the end: "
          f"{', '.join(f'{v:.2f}' for v in data['loadavg'])}.\n\n")
    return data, md


def _cpu_flags() -> list[str]:
    """The x86 flags that matter to the kernels (avx2, fma, avx512*, amx*), from /proc/cpuinfo."""
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))


def run(args: argparse.Namespace) -> int:
    import json

    from pagedkv.bench.common import machine_info, pin_threads
    from pagedkv.bench.report import markdown_table, publish

    check_args(args)
    threads = pin_threads(args.threads)
    data, md = _quality(args) if args.part == "quality" else _routes(args)
    data["machine"] = machine_info(threads)
    paths = publish(RESULT_SET, data, lambda d, _: md + markdown_table(d["rows"]), args.out_dir,
                    variant=args.variant or default_variant(args), echo=False)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(markdown_table(data["rows"]))
        print(f"[pagedkv] wrote {paths['json']} and {paths['md']}")
    return 0
