"""Per-step profile: where a decode or prefill step's time goes, against its limit.

For decode at each ``--batches`` size (64-token prompts, measured once every sequence
decodes) and for one ``--prefill-len``-token prefill, the step is run plainly and under
``torch.profiler`` (:mod:`pagedkv.bench.step.profile`) and split into linear layers,
attention, other tensor ops, logits + sampling and host-side work. The machine's measured
copy bandwidth (read + write) and fp32 matmul peak give each step's limit: the larger of
bytes moved / bandwidth and FLOPs / peak (bytes: every linear weight and the LM head once,
plus the K/V read and written; FLOPs: 2 per weight per token, the LM head on sampled rows,
and attention's QK^T and PV). The goals: batch-32 decode within 1.5x its limit,
batch-1 host + small-op time at most 3 ms, prefill at least 70% of the matmul peak.

Results: ``step.{json,md,png}``, one variant per weight format (+ ``_compiled``, ``_kv_<format>``)
and CPU class (:func:`default_variant`: ``int4_avx512``, ``fp32_avx2_on_avx512`` under
``PAGEDKV_CPU_ISA=avx2``; :mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable

from pagedkv.bench.common import add_options, load_average, load_fp32_model, log, machine_info, pin_threads, weights_of
from pagedkv.bench.report import markdown_table, publish, save_figure, single_plot
from pagedkv.bench.variants import add_variant_option, cpu_class
from pagedkv.bench.step.profile import (
    CATEGORIES,
    copy_bandwidth,
    linear_params,
    matmul_peak,
    profile_steps,
    recording_compiled_kernels,
    step_limit,
    weight_bytes,
)

PROMPT_LEN = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,8,32,128", help="decode batch sizes (default 1,8,32,128)")
    add_options(p, [
        ("--prefill-len", 512, "prompt tokens of the prefill step (default 512)"),
        ("--steps", 6, "steps timed per case, plain and profiled each (default 6)"),
        ("--block-size", 16, "tokens per KV block (default 16)"),
    ])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    p.add_argument("--compile-decode", action="store_true",
                   help="pagedkv decode steps through torch.compile (compiled before timing; docs/performance.md)")
    p.add_argument("--weights", default="fp32",
                   help="linear-layer format: fp32 | bf16 | int8 | int4 | auto (default fp32; see docs/weights.md)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache format (default auto = the model dtype, float32; bfloat16, int8, fp8_e4m3, "
                        "fp8_e5m2; another than auto adds _kv_<format> to the variant)")
    add_variant_option(p, "<weights>[_compiled][_kv_<format>]_<CPU class>, e.g. int4_avx512")


def _engine(loaded: Any, args: Any, max_batch: int) -> Any:
    from pagedkv.engine.engine import LLMEngine

    tokens = max_batch * (PROMPT_LEN + 4 * args.steps + 8) + args.prefill_len + 64
    return LLMEngine(loaded, dtype="float32", block_size=args.block_size,
                     num_blocks=tokens // args.block_size + 64, max_num_seqs=max(max_batch, 1),
                     max_num_batched_tokens=max(args.prefill_len, 512),
                     compile_decode=getattr(args, "compile_decode", False),
                     kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))


def _instrumented(runner: Any) -> Callable[[], Any]:
    """For a runner with compiled steps: a context-manager factory that swaps in a second
    compiled copy of its decode graphs, generated with kernel records (the profiler then sees
    the matmuls inside them; the plain steps keep the uninstrumented graphs, which the records
    slow)."""
    from pagedkv.model.compiled import CompiledDecode

    plain = runner.compiled
    with recording_compiled_kernels():
        log("[step] compiling a profiler-instrumented copy of the decode graphs")
        instrumented = CompiledDecode(runner.model, plain.max_rows)
        instrumented.warm_up()

    @contextlib.contextmanager
    def swapped() -> Any:
        runner.compiled = instrumented
        try:
            yield
        finally:
            runner.compiled = plain

    return swapped


def _costs(model: Any, weights: str, kv_bytes_per_token: int, tokens: int, rows: int,
           ctx: float) -> tuple[float, float]:
    """(bytes, FLOPs) of one step over ``tokens`` new tokens, ``rows`` sampled rows and a mean
    attended context of ``ctx`` tokens per new token, with ``weights``-format linear layers."""
    c = model.config
    dec, head = linear_params(model)
    bytes_moved = weight_bytes(dec, head)[weights] + kv_bytes_per_token * (tokens * ctx + tokens)
    attn = 4 * ctx * c.num_heads * c.head_dim * c.num_layers * tokens
    return bytes_moved, 2 * dec * tokens + 2 * head * rows + attn


def _decode_case(eng: Any, batch: int, steps: int, profiled: Any) -> dict[str, Any]:
    from pagedkv.engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4 * steps + 8, ignore_eos=True)
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, [100 + (i + j) % 1000 for j in range(PROMPT_LEN)], params)
    def requests() -> list[dict[str, Any]]:  # the engine's view: running first, then waiting
        return eng.snapshot()["requests"]

    while any(r["status"] != "running" or r["output_tokens"] == 0 for r in requests()):
        eng.step()
    eng.step()
    ctx = sum(r["num_tokens"] for r in requests() if r["status"] == "running") / batch + steps
    plain, parts = profile_steps(eng.step, steps, profiled=profiled)
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    return {"case": f"decode b={batch}", "kind": "decode", "batch": batch, "tokens": batch,
            "context": ctx, "plain_ms": plain, "parts_ms": parts}


def _prefill_case(eng: Any, length: int, steps: int, profiled: Any) -> dict[str, Any]:
    from pagedkv.engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    counter = iter(range(10**9))

    def step() -> None:
        rid = f"p{next(counter)}"
        eng.add_request(rid, [200 + (j * 7 + len(rid)) % 1000 for j in range(length)], params)
        eng.step()

    step()  # warm
    plain, parts = profile_steps(step, steps, profiled=profiled)
    return {"case": f"prefill {length}", "kind": "prefill", "batch": 1, "tokens": length,
            "context": (length + 1) / 2, "plain_ms": plain, "parts_ms": parts}


def collect(args: argparse.Namespace, loaded: Any = None) -> dict[str, Any]:
    threads = pin_threads(args.threads)
    batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
    from pagedkv.utils import kv_cache_dtype

    kv_cache_dtype(getattr(args, "kv_cache_dtype", "auto"))  # a bad name: ConfigError before measuring
    log("[step] measuring copy bandwidth and matmul peak")
    bw, peak = copy_bandwidth(), matmul_peak()
    loaded = load_fp32_model(loaded, args.model, args.weights)
    model = loaded.model
    dec, head = linear_params(model)
    eng = _engine(loaded, args, max(batches, default=1))
    profiled = _instrumented(eng.runner) if eng.runner.compiled is not None else contextlib.nullcontext
    kvb = eng.kv_spec.bytes_per_token
    cases = []
    for b in batches:
        log(f"[step] decode batch {b}")
        cases.append(_decode_case(eng, b, args.steps, profiled))
    log(f"[step] prefill {args.prefill_len}")
    cases.append(_prefill_case(eng, args.prefill_len, args.steps, profiled))
    for c in cases:
        rows = c["batch"]
        nbytes, flops = _costs(model, weights_of(loaded), kvb, c["tokens"], rows, c["context"])
        c["limit"] = step_limit(nbytes, flops, bw, peak)
        c["bytes"], c["flops"] = nbytes, flops
        c["x_limit"] = c["plain_ms"] / c["limit"]["limit_ms"]
        c["tokens_per_s"] = c["tokens"] / c["plain_ms"] * 1e3
        c["gflops_per_s"] = flops / c["plain_ms"] / 1e6
        c["host_and_small_ops_ms"] = c["parts_ms"]["host"] + c["parts_ms"]["other_ops"]
    return {
        "config": {"batches": batches, "prefill_len": args.prefill_len, "steps": args.steps,
                   "block_size": args.block_size, "prompt_len": PROMPT_LEN, "weights": weights_of(loaded),
                   "compile_decode": bool(getattr(args, "compile_decode", False)),
                   "kv_cache_dtype": eng.kv_cache_dtype},
        "machine_limits": {"copy_bandwidth_gb_s": bw / 1e9, "matmul_peak_gflop_s": peak / 1e9},
        "weight_bytes": weight_bytes(dec, head),
        "cases": cases,
        "load_average_1m": load_average(),
        "machine": machine_info(threads),
    }


def render_markdown(data: dict[str, Any], plots: dict[str, str]) -> str:
    lim = data["machine_limits"]
    rows = []
    for c in data["cases"]:
        row = {"case": c["case"], "step ms": c["plain_ms"], "limit ms": c["limit"]["limit_ms"],
               "x limit": c["x_limit"], "bound": c["limit"]["bound"], "tok/s": c["tokens_per_s"]}
        row.update({f"{k} ms": v for k, v in c["parts_ms"].items()})
        rows.append(row)
    wb = data["weight_bytes"]
    return (
        f"# Per-step profile\n\n`pagedkv bench step --weights {data['config']['weights']}"
        f"{' --compile-decode' if data['config'].get('compile_decode') else ''}"
        f"{_kv_flag(data['config'])}` (KV cache {data['config'].get('kv_cache_dtype', 'float32')}; torch threads pinned to "
        f"{data['machine']['torch_threads']}). Measured here: copy bandwidth "
        f"{lim['copy_bandwidth_gb_s']:.1f} GB/s (read + write), fp32 matmul peak "
        f"{lim['matmul_peak_gflop_s']:.0f} GFLOP/s. Linear + LM head weight bytes per step: "
        + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in wb.items())
        + ". `step ms`: plain steps (no profiler); the part columns come from the profiled steps "
        "(the profiler adds its own cost, so they sum to more). `x limit` = step / max(bytes / "
        "bandwidth, FLOPs / peak). 1-minute load average at the end: "
        f"{data['load_average_1m']}.\n\n" + markdown_table(rows) + "\n"
        + "".join(f"\n![{k}]({v})\n" for k, v in plots.items())
    )


def _kv_flag(config: dict[str, Any]) -> str:
    kv = config.get("kv_cache_dtype")
    return f" --kv-cache-dtype {kv}" if kv and kv != "float32" else ""


def _draw(data: dict[str, Any], path: Any) -> None:
    from pagedkv.bench.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [c["case"] for c in data["cases"]]
    bottom = [0.0] * len(names)
    for cat in CATEGORIES:
        vals = [100 * c["parts_ms"][cat] / (sum(c["parts_ms"].values()) or 1) for c in data["cases"]]
        ax.bar(names, vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, c in enumerate(data["cases"]):
        ax.text(i, 101, f"{c['plain_ms']:.0f} ms\n{c['x_limit']:.1f}x limit", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("share of the profiled step (%)")
    ax.set_ylim(0, 125)
    ax.legend(loc="upper left", ncol=5, fontsize=8)
    ax.set_title(f"Where a step's time goes ({data['config']['weights']} weights)")
    save_figure(fig, path)


def default_variant(args: Any, data: dict[str, Any]) -> str:
    """``<weights>[_compiled][_kv_<format>]_<CPU class>`` of a run (``int4_avx512``)."""
    c = data["config"]
    name = str(c["weights"]) + ("_compiled" if c.get("compile_decode") else "")
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        name += f"_kv_{c['kv_cache_dtype']}"
    return f"{name}_{cpu_class(data['machine'].get('cpu_isa'))}"


def run(args: argparse.Namespace, loaded: Any = None) -> int:
    data = collect(args, loaded)
    variant = getattr(args, "variant", None) or default_variant(args, data)
    publish("step", data, render_markdown, args.out_dir, variant=variant,
            plots=single_plot("step", "step time breakdown", _draw), as_json=args.json)
    return 0
