"""Structured outputs: the grammar mask's cost per step against a batch-8 decode step.

For ``--batch`` rows constrained by one JSON schema (nested object, array, enum, bounded
numbers), each step fills the token bitmask of every row and masks an fp32 ``[batch,
vocab]`` logits tensor (:func:`pagedkv.engine.structured.apply_grammar_masks`, what the
sampler runs), then advances every matcher with its row's pick from random logits under
the mask (so the rows walk through strings, numbers and structure). The median over
``--steps`` steps is set against the median plain greedy decode step of the same batch on
the same model (``LLMEngine.step``), and against a constrained decode step end to end. When
``xgrammar`` is installed its fill + apply is timed on the same schema for comparison. The
goal: the mask at most 10% of a batch-8 decode step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version
from typing import Any

from pagedkv.bench.common import add_options, load_fp32_model, log, machine_info, pin_threads
from pagedkv.bench.report import markdown_table, publish

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "kind": {"enum": ["person", "company", "other"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
}
PROMPT = "Describe a person as a JSON object."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, [
        ("--batch", 8, "constrained rows per step (default 8)"),
        ("--steps", 50, "steps timed (default 50)"),
    ])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    p.add_argument("--weights", default="auto", help="linear-layer format: auto (the engine's default: the fastest "
                   "route for this CPU, so the step the mask is compared with is the one users run), fp32, bf16, "
                   "int8, int4")


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000.0


def _walk(step_fn: Any, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        step_fn()
        out.append(time.perf_counter() - t)
    return out


def _pagedkv_mask(eng: Any, batch: int, steps: int) -> dict[str, float]:
    """Median ms of fill + apply (and of the fill alone) for ``batch`` rows over ``steps``."""
    import torch

    from pagedkv.engine.request import Request, SamplingParams
    from pagedkv.engine.structured import StructuredSpec, apply_grammar_masks, state_of

    params = SamplingParams(structured=StructuredSpec("json_schema", SCHEMA))
    eng.grammars.compile(params.structured)
    vocab = eng.model_config.vocab_size
    reqs = [Request(f"m{i}", [1], params, 0.0) for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.empty((batch, (vocab + 31) // 32), dtype=torch.int32)
    total, fill = [], []
    for step in range(steps + 1):  # step 0 makes every row's matcher: not timed
        logits = torch.randn(batch, vocab, generator=gen)
        t0 = time.perf_counter()
        for j, r in enumerate(reqs):
            state_of(r).fill(bitmask, j)
        fill.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        apply_grammar_masks(logits, reqs, list(range(batch)))
        if step:
            total.append(time.perf_counter() - t0)
        else:
            fill.pop()
        for r, tok in zip(reqs, logits.argmax(-1).tolist()):
            if r.grammar.matcher.is_stopped():  # restart a finished row: keep measuring live rows
                r.output_token_ids.clear()
                r.grammar = None
            else:
                r.append_output_token(tok)
    # apply (unpack + add) per step: the masked call's time less that step's fill (>= 0)
    apply = [max(0.0, t - f) for t, f in zip(total, fill)]
    return {"mask_ms": _median_ms(total), "fill_ms": _median_ms(fill), "apply_ms": _median_ms(apply)}


def _xgrammar_mask(eng: Any, batch: int, steps: int) -> Any:
    """Median ms of xgrammar's fill + apply on the same schema, or None if not installed."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    import torch

    vocab = eng.model_config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(eng.tokenizer, vocab_size=vocab, stop_token_ids=list(eng.eos_token_ids))
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    ms = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    gen = torch.Generator().manual_seed(0)
    total = []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        t0 = time.perf_counter()
        for j, m in enumerate(ms):
            m.fill_next_token_bitmask(bitmask, j)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        total.append(time.perf_counter() - t0)
        for j, tok in enumerate(logits.argmax(-1).tolist()):
            if ms[j].is_terminated():
                ms[j] = xgr.GrammarMatcher(compiled)
            else:
                ms[j].accept_token(tok)
    return {"mask_ms": _median_ms(total), "version": version("xgrammar")}


def _decode_steps(eng: Any, batch: int, steps: int, structured: bool) -> float:
    """Median ms of a greedy decode step of ``batch`` rows (each row constrained by the
    schema when ``structured``; EOS ignored so every row keeps decoding)."""
    from pagedkv.engine.request import SamplingParams
    from pagedkv.engine.structured import StructuredSpec

    prompt = eng.apply_chat_template([{"role": "user", "content": PROMPT}])
    spec = StructuredSpec("json_schema", SCHEMA) if structured else None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True, structured=spec)
    ids = [f"{'s' if structured else 'p'}{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, prompt + [100 + i], params)
    while any(r["status"] != "running" or r["output_tokens"] == 0 for r in eng.snapshot()["requests"]):
        eng.step()
    times = _walk(eng.step, steps)
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    return _median_ms(times)


def collect(args: argparse.Namespace, loaded: Any = None) -> dict[str, Any]:
    from pagedkv.engine.engine import LLMEngine

    threads = pin_threads(args.threads)
    loaded = load_fp32_model(loaded, args.model, weights=getattr(args, "weights", "auto"))
    eng = LLMEngine(loaded, dtype="float32", block_size=16, num_blocks=64 * args.batch + 64,
                    max_num_seqs=args.batch, max_num_batched_tokens=512)
    _decode_steps(eng, args.batch, 3, False)  # warm-up
    log("[structured] mask, llguidance")
    ours = _pagedkv_mask(eng, args.batch, args.steps)
    # plain and constrained decode alternate (3 rounds each, the median round): a shared host's
    # load changes between two back-to-back runs by more than the mask costs
    plain, constrained = [], []
    for r in range(3):
        log(f"[structured] plain / constrained decode, batch {args.batch}, round {r + 1}/3")
        plain.append(_decode_steps(eng, args.batch, args.steps, False))
        constrained.append(_decode_steps(eng, args.batch, args.steps, True))
    decode_ms, constrained_ms = statistics.median(plain), statistics.median(constrained)
    log("[structured] mask, xgrammar (if installed)")
    xg = _xgrammar_mask(eng, args.batch, args.steps)
    rows = [{"engine": f"llguidance {version('llguidance')} (used)", **{k: round(v, 4) for k, v in ours.items()},
             "share_of_decode_step": ours["mask_ms"] / decode_ms}]
    if xg is not None:
        rows.append({"engine": f"xgrammar {xg['version']}", "mask_ms": round(xg["mask_ms"], 4),
                     "share_of_decode_step": xg["mask_ms"] / decode_ms})
    return {
        "config": {"batch": args.batch, "steps": args.steps, "threads": threads, "schema": SCHEMA,
                   "vocab": eng.model_config.vocab_size, "model": eng.model_id, "weights": str(eng.loaded.weights)},
        "decode_step_ms": decode_ms,
        "constrained_decode_step_ms": constrained_ms,
        "engines": rows,
        "goal_met": ours["mask_ms"] <= 0.10 * decode_ms,
        "machine": machine_info(threads),
    }


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    c = data["config"]
    return "\n".join([
        "# Structured outputs: grammar mask cost per step",
        "",
        f"Batch {c['batch']}, {c['steps']} steps (medians; decode steps: the median of 3 alternating rounds), model {c['model']} (vocab {c['vocab']}), "
        f"{c['threads']} thread(s), {c.get('weights', 'fp32')} weights. One JSON schema (nested object, array, "
        "enum, bounded numbers).",
        "",
        f"- plain greedy decode step: **{data['decode_step_ms']:.2f} ms**",
        f"- the same step with every row constrained (mask included): **{data['constrained_decode_step_ms']:.2f} ms** "
        f"({data['constrained_decode_step_ms'] / data['decode_step_ms']:.2f}x)",
        f"- goal (mask <= 10% of the decode step): **{'met' if data['goal_met'] else 'NOT met'}**",
        "",
        markdown_table(data["engines"], ["engine", "mask_ms", "fill_ms", "apply_ms", "share_of_decode_step"]),
        "mask_ms: bitmask fill for every row + one masked fill of the [batch, vocab] fp32 logits; "
        "fill_ms: the bitmask fill alone.",
    ])


def run(args: argparse.Namespace, loaded: Any = None) -> int:
    data = collect(args, loaded)
    publish("structured", data, render_markdown, args.out_dir, as_json=args.json)
    return 0
