"""KV blocks one long request holds: hybrid (sliding-window layer groups) vs all-full, planner
vs a live engine run, on a tiny random Gemma-shaped model (every ``--full-every``-th layer full
attention, the others a sliding window: 2 is Gemma-2's alternation, 6 Gemma-3's 5:1 mix).

The model is built with transformers (random weights, ``--layers`` layers, window
``--window``) and served by the engine; one request of ``--context`` tokens (a prompt of
``context - 1`` tokens, chunked prefill of ``--chunk`` tokens, then one decode step computing
the last position) is stepped and its held blocks read from the KV manager after every step:
``end`` after the step that computed position ``context - 1``, ``peak`` over the run. The
planner (``KVCacheSpec.blocks_per_request``) predicts both; the same model with every layer
full is run too. Bytes per block id: ``page x max_layers`` (hybrid) vs ``page x layers``.

Results: ``hybrid_blocks.{json,md}``, one variant per layer mix (``1in2``, ``1in6``: the value
of ``--full-every``; :mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from pagedkv.bench.common import int_at_least, machine_info, pin_threads
from pagedkv.bench.report import markdown_table, publish
from pagedkv.bench.variants import add_variant_option


def layer_windows(layers: int, window: int, full_every: int) -> list[int | None]:
    """Per layer: ``None`` (full attention) for every ``full_every``-th layer, else ``window``
    (``full_every`` 2: Gemma-2's alternation; 6: Gemma-3's five local layers per global one)."""
    return [None if (i + 1) % full_every == 0 else window for i in range(layers)]


def _tiny_gemma2(path: Path, windows: list[int | None], max_pos: int) -> None:
    import torch
    import transformers as tf

    layers, window = len(windows), next((w for w in windows if w), None)
    types = ["sliding_attention" if w else "full_attention" for w in windows]
    cfg = tf.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=window or 4096,
                          layer_types=types, max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0)
    torch.manual_seed(0)
    tf.Gemma2ForCausalLM(cfg).save_pretrained(path)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                               pad_token="t0").save_pretrained(path)


def _live(args: argparse.Namespace, spec: Any) -> dict[str, Any]:
    import random

    from pagedkv.engine.llm import LLM
    from pagedkv.engine.request import SamplingParams
    from pagedkv.model.loader import load_model

    T, bs = args.context, args.block_size
    with tempfile.TemporaryDirectory() as d:
        _tiny_gemma2(Path(d), spec.layer_windows or [None] * args.layers, T + 64)
        lm = load_model(d)
    need = spec.blocks_per_request(T, bs, chunk=args.chunk) + 16
    llm = LLM(lm, block_size=bs, num_blocks=need, max_num_batched_tokens=args.chunk, max_model_len=T + 8,
              debug_invariants=False)
    eng, kv = llm.engine, llm.engine.kv
    prompt = [random.Random(0).randrange(3, 128) for _ in range(T - 1)]
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    peak, end = 0, None
    while kv.num_tokens("r") < T or end is None:
        eng.step()
        held = sum(kv.held_blocks("r"))
        peak = max(peak, held)
        if kv.num_tokens("r") >= T:
            end = {"per_group": kv.held_blocks("r"), "total": held,
                   "window_freed_blocks": kv.stats.window_freed_blocks}
    eng.abort_request("r")
    while eng.has_unfinished_requests():
        eng.step()
    caches = eng.runner.shared_caches  # what the runner really allocated, per block id
    allocated = sum(t.numel() * t.element_size() for c in caches for t in (c.key, c.value)) // need
    return {"end": end, "peak": peak, "block_bytes": allocated, "leaked": kv.num_used_blocks}


def run_blocks(args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv.kv.spec import KVCacheSpec

    T, bs, W = args.context, args.block_size, args.window
    spec = KVCacheSpec(num_layers=args.layers, num_kv_heads=1, head_dim=16, dtype="fp32",
                       layer_windows=layer_windows(args.layers, W, args.full_every))
    full = replace(spec, layer_windows=None)
    rows = []
    for label, s in (("hybrid", spec), ("all-full", full)):
        live = _live(args, s)
        rows.append({
            "layout": label, "plan_block_bytes": s.block_bytes(bs), "live_block_bytes": live["block_bytes"],
            "plan_blocks_end": s.blocks_per_request(T, bs), "live_blocks_end": live["end"]["total"],
            "live_blocks_per_group": live["end"]["per_group"],
            "plan_blocks_peak": s.blocks_per_request(T, bs, chunk=args.chunk), "live_blocks_peak": live["peak"],
            "bytes_end": live["end"]["total"] * live["block_bytes"],
            "window_freed_blocks": live["end"]["window_freed_blocks"], "leaked_blocks": live["leaked"],
        })
    h, f = rows
    return {
        "benchmark": "hybrid_blocks",
        "config": {"layers": args.layers, "full_every": args.full_every, "window": W, "context": T,
                   "block_size": bs, "chunk": args.chunk, "groups": spec.groups.describe()},
        "results": rows,
        "bytes_ratio_end": h["bytes_end"] / f["bytes_end"],
        "plan_bytes_ratio_end": spec.bytes_per_request(T, bs) / full.bytes_per_request(T, bs),
        "planner_agrees": all(r["plan_blocks_end"] == r["live_blocks_end"] for r in rows),
    }


def _floor(c: dict[str, Any]) -> float:
    full = 1 / c["full_every"]
    return full + (1 - full) * c["window"] / c["context"]


def render(data: dict[str, Any], plots: dict[str, str]) -> str:
    c = data["config"]
    return "\n".join([
        "# KV blocks one request holds: hybrid vs all-full, planner vs live",
        "",
        f"Tiny random Gemma-shaped model: {c['layers']} layers, every {c['full_every']}th full attention, the "
        f"others window {c['window']} ({len(c['groups'])} layer groups of "
        f"{max(len(g['layers']) for g in c['groups'])} layers), "
        f"one request of {c['context']} tokens, block size {c['block_size']}, prefill chunks of {c['chunk']}.",
        "",
        markdown_table(data["results"]),
        "",
        f"Bytes held at the end, hybrid / all-full: live {data['bytes_ratio_end']:.4f}, planner "
        f"{data['plan_bytes_ratio_end']:.4f}; planner == live block counts: {data['planner_agrees']}.",
        f"With 1/{c['full_every']} of the layers full the ratio cannot go below 1/{c['full_every']} + "
        f"(1 - 1/{c['full_every']}) W / context (= {_floor(c):.4f} here) plus one block.",
        "",
        f"Reproduce: `pagedkv bench hybrid_blocks --threads 1 --layers {c['layers']} --full-every {c['full_every']} "
        f"--window {c['window']}`.",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    p.add_argument("--full-every", type=int_at_least(2), default=2,
                   help="every K-th layer has full attention, the others the window (default 2, Gemma-2; Gemma-3: 6); "
                        "results: the variant 1in<K> of hybrid_blocks.*")
    p.add_argument("--window", type=int, default=4096, help="sliding window in tokens (default 4096)")
    p.add_argument("--context", type=int, default=32768, help="tokens of the request (default 32768)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk, tokens (default 2048)")
    add_variant_option(p, "1in<K>, K the value of --full-every")


def run(args: argparse.Namespace) -> int:
    threads = pin_threads(args.threads)
    data = run_blocks(args)
    data["machine"] = machine_info(threads)
    publish("hybrid_blocks", data, render, args.out_dir, variant=args.variant or f"1in{args.full_every}",
            as_json=args.json)
    return 0
