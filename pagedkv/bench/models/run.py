"""Models people run on CPUs: load time, peak RSS, cache bytes, decode and prefill beside llama.cpp.

For each Llama-family shape (0.5B, 1.7B, 3B, 8B; :mod:`pagedkv.bench.models.make` makes the
random-weight GGUFs, offline and cached) in each type (Q4_0, Q4_K_M, Q8_0), over ``--rounds``
rounds with the systems interleaved (their order alternating per round), every measurement in
a fresh process under a timeout and an RSS guard (:mod:`pagedkv.bench.models.guard`), from
this checkout (its sources' digest, checked before every pagedkv round, stops a run an edit
would split: ``protocol.check_sources``):

* **pagedkv**: ``pagedkv.LLM(model=<gguf>)`` (:mod:`pagedkv.bench.models.child`). Cold load:
  an empty ``$PAGEDKV_CACHE_DIR`` (a temp dir; the compiled C kernels linked in, so kernel
  compilation is not counted) after dropping the file from the page cache; warm load: a second
  process with the same cache dir, which then times prefill 512 and batch-1 decode (64 tokens
  after a 32-token prompt) with the helper ``pagedkv bench peers`` uses. Cache bytes: the
  files the cold load left in the cache dir.
* **llama.cpp** (same file, same threads): cold and warm load = ``llama-server`` started to
  ``/health`` answering 200 (``--no-warmup``), after dropping the file from the page cache for
  the cold one; prefill 512 and decode 64 = ``llama-bench -p 512 -n 64 -r 1`` (pp512 / tg64).

Load time is process start to ready for both. Peak RSS: ``ru_maxrss`` of the process that
loaded the model and ran prefill and decode. Decode is also shown as a fraction of the
weight-read limit: measured read bandwidth / bytes read per token tokens/s, once with the
run's bandwidth (the best of the start and the end of the whole run) and once per round with
the bandwidth probed just before and after that system's round (their mean,
:func:`probe_bandwidth`; a shared host's bandwidth moves between levels), where the bytes
read per token are the file's tensor bytes, a mixture-of-experts file's stacked experts counted
at their routed share (``expert_used_count / expert_count``; ``models.make.weight_bytes_per_token``).
The ``moe-4b`` shape (``qwen3moe``, Qwen3-30B-A3B's 8-of-128 routing at half its width and
depth) is not in the default sizes: ``--sizes moe-4b``.

Results: ``models.{json,md,png}``, one variant per CPU class (:func:`default_variant`:
``avx512``, ``avx2``; ``avx2_load`` for a ``--load-only`` run there), written after every model
(:mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

from pagedkv.bench.common import json_clean, llama_cpp_env, load_average, log, machine_info
from pagedkv.bench.models.guard import GB, fadvise_dontneed, run_guarded
from pagedkv.bench.models.make import SHAPES, TYPES, ensure_models, find_tool, tensor_types, weight_bytes_per_token
from pagedkv.bench.protocol import (SourcesChanged, check_sources, cpu_model, dirty_tree, interleaved,
                                    llama_bench_run, llama_cpp_stamp, source_digest)
from pagedkv.bench.variants import add_variant_option, cpu_class

NAME = "models"
PAGEDKV, LLAMA_CPP = "pagedkv", "llama.cpp"
NOT_BUILT = "llama.cpp tools not built (make peers)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="0.5b,1.7b,3b,8b", help=f"model shapes, smallest first ({', '.join(SHAPES)})")
    p.add_argument("--types", default="q4_0,q4_k_m,q8_0", help=f"GGUF types ({', '.join(TYPES)}; default q4_0,q4_k_m,q8_0)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; systems interleaved in each (default 3)")
    p.add_argument("--no-llama-cpp", action="store_true", help="pagedkv only (llama.cpp reported as not measured)")
    p.add_argument("--load-only", action="store_true",
                   help="start-up only: each system's cold and warm load, no prefill or decode (llama-bench not run); "
                        "its own variant (<CPU class>_load), beside a full run's")
    p.add_argument("--rss-limit-gb", type=float, default=18.0, help="kill a measured process above this RSS (default 18)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="kill a measured process after this long (default 1800)")
    p.add_argument("--weights", default="auto", help="pagedkv's linear-layer format (default auto)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="pagedkv KV budget (default 1GiB)")
    p.add_argument("--max-model-len", type=int, default=1024, help="pagedkv max_model_len (default 1024)")
    p.add_argument("--keep-f16", action="store_true", help="keep the f16 GGUFs the quantised files are made from")
    p.add_argument("--no-llama-quantize", action="store_true",
                   help="make Q4_0/Q8_0 with gguf-py's numpy quantizer even when llama-quantize is built")
    p.add_argument("--drop-caches", action="store_true",
                   help="before a cold load also `echo 1 > /proc/sys/vm/drop_caches` (whole machine; default: "
                        "posix_fadvise DONTNEED on the model file only)")
    p.add_argument("--out", dest="out_dir", default=None, help="where to write results (default docs/benchmarks/)")
    add_variant_option(p, "the CPU class (avx512, avx2, ...), + _load with --load-only")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--note", default=None, help="free text recorded in the results (with --from-json: replaces the run's)")
    p.add_argument("--from-json", default=None,
                   help="measure nothing: re-summarise and re-render an earlier run's JSON, a result file or a variant "
                        "of one (--variant; e.g. after a report change)")


# ---- machine facts -------------------------------------------------------------------------------
def read_bandwidth(threads: int, num_bytes: int = 1 << 30, repeats: int = 5) -> dict[str, Any]:
    """Best measured read bandwidth (bytes/s): ``torch.amax`` over a ``num_bytes`` int32 buffer
    on 2 MiB pages (``pagedkv.ops.hugepages``, where the kernel gives them: the pages the
    weights are on) with ``threads`` torch threads. The fastest read torch has here: on a Zen 4
    VM, 2 threads, 70-73 GB/s against 36-39 for ``torch.sum`` in float32 on the same pages
    and 36-37 for both on 4 KiB pages (what this measured until 2026-12-07)."""
    import torch

    from pagedkv.ops import hugepages

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        huge0 = hugepages.huge_bytes()
        buf = hugepages.empty(num_bytes).view(torch.int32)
        buf.fill_(1)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            buf.amax()
            times.append(time.perf_counter() - t)
        huge = hugepages.huge_bytes() - huge0
        del buf
    finally:
        torch.set_num_threads(before)
    return {"bytes_per_s": num_bytes / min(times), "method": f"torch.amax over a {num_bytes >> 20} MiB int32 buffer "
            f"({max(0, min(huge, num_bytes)) >> 20} MiB of it on 2 MiB pages), {threads} threads, best of {repeats}",
            "runs_s": times}


def probe_bandwidth(threads: int) -> float:
    """The host's read bandwidth now (bytes/s): :func:`read_bandwidth` over 512 MiB, best of 3
    (~0.1 s). Taken before and after each system's round: on a shared host the bandwidth left
    to a process moves between levels for seconds at a time (a Zen 4 VM: ~28 and ~42 GB/s),
    so each run's decode is set against the bandwidth around it."""
    return float(read_bandwidth(threads, num_bytes=512 << 20, repeats=3)["bytes_per_s"])


def drop_page_cache(path: str, whole_machine: bool) -> dict[str, Any]:
    """Drop ``path`` from the page cache (and, with ``whole_machine``, every clean page)."""
    out = fadvise_dontneed(path)
    if whole_machine:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            out["drop_caches"] = True
        except OSError as exc:
            out["drop_caches"] = f"not permitted: {exc}"
    return out


#: why a --load-only run has no prefill, decode or run peak RSS
LOAD_ONLY = "--load-only (start-up only)"


# ---- pagedkv ---------------------------------------------------------------------------------------
def seed_kernels(cache: Path, source: Optional[Path] = None) -> list[str]:
    """Link the compiled C kernels (``*.so``) of ``source`` (default the cache root) into the
    fresh cache dir ``cache``: a cold load then measures loading, not compiling. Returns the names."""
    from pagedkv.model.weight_cache import cache_root

    src = source or cache_root()
    names = []
    for so in sorted(src.glob("*.so")) if src.is_dir() else []:
        (cache / so.name).symlink_to(so)
        names.append(so.name)
    return names


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks not followed or counted)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = Path(root) / f
            if not p.is_symlink():
                total += p.stat().st_size
    return total


def run_child(model: str, cache: Path, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One :mod:`pagedkv.bench.models.child` process on the GGUF ``model`` with
    ``$PAGEDKV_CACHE_DIR`` = ``cache`` and ``spec`` (threads, engine options, what to measure),
    under ``args.timeout_s`` and ``args.rss_limit_gb``: its status, peak RSS, ``load_s``
    (process start to the model ready, seconds) and ``child`` (its last result line)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({**spec, "model": model}, f)
    out_path = Path(f.name + ".out")
    env = {**os.environ, "PAGEDKV_CACHE_DIR": str(cache), "OMP_NUM_THREADS": str(args.threads)}
    t_spawn = time.time()
    try:
        res = run_guarded([sys.executable, "-m", "pagedkv.bench.models.child", f.name], env=env,
                          timeout_s=args.timeout_s, rss_limit_bytes=args.rss_limit_gb * GB, stdout_path=out_path)
        lines = [json.loads(x) for x in out_path.read_text().splitlines() if x.startswith("{")]
    finally:
        os.unlink(f.name)
        out_path.unlink(missing_ok=True)
    ready = next((x for x in lines if x.get("event") == "ready"), None)
    done = next((x for x in lines if x.get("event") == "done"), None)
    res["load_s"] = ready["t_ready_wall"] - t_spawn if ready else None
    res["child"] = done or ready
    if res["status"] == "ok" and done is None:
        res["status"], res["reason"] = "failed", "the child printed no result"
    return res


def pagedkv_round(path: str, args: argparse.Namespace, measure_spec: dict[str, Any]) -> dict[str, Any]:
    """One round of pagedkv on ``path``: a cold load (empty cache dir) then a warm load that
    times prefill and decode. Returns the round's record."""
    from pagedkv.model.weight_cache import cache_root

    engine = {"max_model_len": args.max_model_len, "kv_cache_memory": args.kv_cache_memory,
              "weights": args.weights, "max_num_batched_tokens": max(512, measure_spec["prefill_tokens"])}
    cache = Path(tempfile.mkdtemp(prefix="pagedkv-models-cache-"))
    try:
        seeded = seed_kernels(cache)
        page_cache = drop_page_cache(path, args.drop_caches)
        cold = run_child(path, cache, {"threads": args.threads, "engine": engine, "measure": False}, args)
        cold["page_cache"] = page_cache
        built = sorted(p.name for p in cache.glob("*.so") if not p.is_symlink())
        for name in built:  # compiled during the load: keep them for the next rounds
            shutil.move(str(cache / name), str(cache_root() / name))
            (cache / name).symlink_to(cache_root() / name)
        rec: dict[str, Any] = {"kernels_linked": len(seeded), "kernels_compiled_during_cold_load": built,
                               "cache_bytes": dir_bytes(cache), "cold": cold}
        if cold["status"] != "ok":
            rec["warm"] = {"status": "not measured", "reason": f"the cold load ended {cold['status']}: {cold['reason']}"}
            return rec
        rec["warm"] = run_child(path, cache, {"threads": args.threads, "engine": engine, "measure": not args.load_only,
                                               "measure_spec": measure_spec}, args)
        if args.load_only:
            rec["skipped"] = LOAD_ONLY
        return rec
    finally:
        shutil.rmtree(cache, ignore_errors=True)


# ---- llama.cpp ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False
    return check


def llama_server_load(server: str, path: str, args: argparse.Namespace, cold: bool) -> dict[str, Any]:
    """``llama-server`` started to ``/health`` 200 (``--no-warmup``), then terminated."""
    page_cache = drop_page_cache(path, args.drop_caches) if cold else None
    port = _free_port()
    cmd = [server, "-m", path, "-t", str(args.threads), "-c", str(args.max_model_len), "--no-warmup",
           "--host", "127.0.0.1", "--port", str(port)]
    res = run_guarded(cmd, timeout_s=args.timeout_s, rss_limit_bytes=args.rss_limit_gb * GB, ready=_healthy(port),
                      poll_s=0.05, env=llama_cpp_env())
    if res["status"] == "ready":
        res["status"], res["load_s"] = "ok", res["ready_s"]
    else:
        res["load_s"] = None
        res["reason"] = res["reason"] or f"exited ({res['status']}) before /health answered"
        res["status"] = "failed" if res["status"] == "ok" else res["status"]
    res["page_cache"] = page_cache
    return res


def llama_cpp_round(path: str, args: argparse.Namespace, measure_spec: dict[str, Any],
                    tools: dict[str, Optional[str]]) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    if tools.get("llama-server"):
        rec["cold"] = llama_server_load(tools["llama-server"], path, args, cold=True)
        rec["warm"] = llama_server_load(tools["llama-server"], path, args, cold=False)
    else:
        rec["cold"] = rec["warm"] = {"status": "not measured", "reason": "llama-server not built (make peers)"}
    if args.load_only:
        rec["bench"], rec["skipped"] = {"status": "not measured", "reason": LOAD_ONLY}, LOAD_ONLY
    elif tools.get("llama-bench"):
        rec["bench"] = llama_bench_run(tools["llama-bench"], path, args, measure_spec)
    else:
        rec["bench"] = {"status": "not measured", "reason": "llama-bench not built (make peers)"}
    return rec


# ---- the run -------------------------------------------------------------------------------------------
def _split(text: str, allowed: Any, what: str) -> list[str]:
    from pagedkv.errors import ConfigError

    items = [x.strip().lower() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ConfigError(f"--{what}: {bad or text!r} not among {', '.join(allowed)}")
    return items


def collect(args: argparse.Namespace, on_model: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Every model measured; after each, ``on_model(partial results)`` (the run writes them, so a
    run cut short still leaves the models it finished)."""
    from pagedkv.bench.models.report import summarize_model

    sizes, types = _split(args.sizes, SHAPES, "sizes"), _split(args.types, TYPES, "types")
    load_start = load_average()
    machine = {**machine_info(args.threads), "dirty": dirty_tree()}  # the commit measured: the one at the start
    tools = {t: find_tool(t) for t in ("llama-quantize", "llama-bench", "llama-server")}
    llama_reason = None
    if args.no_llama_cpp:
        llama_reason = "--no-llama-cpp"
    elif not (tools["llama-bench"] or tools["llama-server"]):
        llama_reason = NOT_BUILT
    bandwidth = read_bandwidth(args.threads)
    log(f"[models] read bandwidth {bandwidth['bytes_per_s'] / GB:.1f} GB/s ({bandwidth['method']})")
    measure_spec = {"threads": args.threads, "prefill_tokens": 512, "decode_prompt": 32, "decode_tokens": 64,
                    "repeats": 1}
    models = []
    sources = source_digest()  # every pagedkv round must run this code (a mid-run edit stops the run)
    for size in sizes:
        made = ensure_models([size], types, use_llama_quantize=not args.no_llama_quantize, keep_f16=args.keep_f16,
                             threads=args.threads, log=log)
        for qtype in types:
            facts = made[(size, qtype)]
            entry: dict[str, Any] = {"size": size, "type": qtype, "shape": SHAPES[size].__dict__,
                                     "params": SHAPES[size].num_params(), "file": facts, "systems": {}}
            models.append(entry)
            if "error" in facts:
                for s in (PAGEDKV, LLAMA_CPP):
                    entry["systems"][s] = {"status": "not measured", "reason": f"no model file: {facts['error']}", "runs": []}
                continue
            path = facts["path"]
            entry["file"]["tensor_types"] = tensor_types(path)
            entry["file"]["weight_bytes"] = weight_bytes_per_token(path)
            spec = {**measure_spec, "vocab_size": SHAPES[size].vocab}
            ours: dict[str, Any] = {"status": "ok", "reason": None, "runs": []}
            peer: dict[str, Any] = {"status": "not measured" if llama_reason else "ok", "reason": llama_reason, "runs": []}
            entry["systems"] = {PAGEDKV: ours, LLAMA_CPP: peer}
            for r in range(args.rounds):
                order = interleaved([PAGEDKV, LLAMA_CPP], r)
                for system in order:
                    if system == PAGEDKV and ours["status"] == "ok":
                        log(f"[models] {size} {qtype} round {r + 1}: pagedkv ...")
                        check_sources(sources, f"{size} {qtype} round {r + 1}")
                        before = probe_bandwidth(args.threads)
                        rec = {"round": r + 1, "sources": sources, **pagedkv_round(path, args, spec)}
                        rec["bandwidth"] = {"before": before, "after": probe_bandwidth(args.threads)}
                        ours["runs"].append(rec)
                        if rec["cold"]["status"] == "killed_rss":  # deterministic: the later rounds would repeat it
                            ours["status"], ours["reason"] = "killed", rec["cold"]["reason"]
                        log(f"[models]   cold {rec['cold']['status']} {rec['cold'].get('load_s')}, "
                            f"warm {rec['warm']['status']} {rec['warm'].get('load_s')}")
                    elif system == LLAMA_CPP and peer["status"] == "ok":
                        log(f"[models] {size} {qtype} round {r + 1}: llama.cpp ...")
                        before = probe_bandwidth(args.threads)
                        rec = {"round": r + 1, **llama_cpp_round(path, args, spec, tools)}
                        rec["bandwidth"] = {"before": before, "after": probe_bandwidth(args.threads)}
                        peer["runs"].append(rec)
                        log(f"[models]   load {rec['cold'].get('load_s')} / {rec['warm'].get('load_s')}, "
                            f"bench {rec['bench']['status']} {rec['bench'].get('decode_tokens_per_s')}")
            entry["summary"] = summarize_model(entry, bandwidth["bytes_per_s"])
            if on_model is not None:
                on_model(_results(args, sizes, types, measure_spec, bandwidth, tools, llama_reason, models, load_start, machine,
                                  partial=True))
    # the machine is shared: measured again at the end, the better of the two is the limit
    again = read_bandwidth(args.threads)
    bandwidth = {**bandwidth, "bytes_per_s": max(bandwidth["bytes_per_s"], again["bytes_per_s"]),
                 "start_bytes_per_s": bandwidth["bytes_per_s"], "end_bytes_per_s": again["bytes_per_s"],
                 "method": bandwidth["method"] + ", at the start and the end of the run, the higher taken"}
    for entry in models:
        entry["summary"] = summarize_model(entry, bandwidth["bytes_per_s"])
    return _results(args, sizes, types, measure_spec, bandwidth, tools, llama_reason, models, load_start, machine, partial=False)


def _results(args: argparse.Namespace, sizes: list[str], types: list[str], measure_spec: dict[str, Any],
             bandwidth: dict[str, Any], tools: dict[str, Optional[str]], llama_reason: Optional[str],
             models: list[dict[str, Any]], load_start: Optional[float], machine: dict[str, Any],
             partial: bool) -> dict[str, Any]:
    return json_clean({
        "benchmark": NAME,
        "partial": partial,
        "description": (__doc__ or "").strip().splitlines()[0],
        "method": " ".join((__doc__ or "").strip().split("\n\n", 1)[1].split()),
        "config": {"sizes": sizes, "types": types, "rounds": args.rounds, "threads": args.threads,
                   "rss_limit_gb": args.rss_limit_gb, "timeout_s": args.timeout_s, "weights": args.weights,
                   "kv_cache_memory": args.kv_cache_memory, "max_model_len": args.max_model_len,
                   "measure_spec": measure_spec, "drop_caches": bool(args.drop_caches), "note": args.note,
                   "load_only": bool(args.load_only),
                   "command": " ".join(["pagedkv bench models", *map(shlex.quote, sys.argv[3:])]) if sys.argv[1:3] == ["bench", NAME]
                   else f"pagedkv bench models --sizes {','.join(sizes)} --types {','.join(types)} --rounds {args.rounds}"},
        "cpu_model": cpu_model(),
        "read_bandwidth": bandwidth,
        "llama_cpp": {"tools": tools, "stamp": llama_cpp_stamp(), "not_measured": llama_reason},
        "models": models,
        "load_average_1m": {"start": load_start, "end": load_average()},
        "machine": {**machine, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    })


def default_variant(data: dict[str, Any]) -> str:
    """The CPU class of the run's machine (:func:`pagedkv.bench.variants.cpu_class`), ``_load``
    appended for a ``--load-only`` run: ``avx512``, ``avx2``, ``avx2_load``."""
    name = cpu_class((data.get("machine") or {}).get("cpu_isa"))
    return name + "_load" if data["config"].get("load_only") else name


def run(args: argparse.Namespace) -> int:
    from pagedkv.bench.models.report import plot, render_markdown
    from pagedkv.bench.report import publish, single_plot
    from pagedkv.bench.variants import read_variant

    def write(d: dict[str, Any], echo: bool = False) -> None:
        publish(NAME, d, render_markdown, args.out_dir, variant=args.variant or default_variant(d),
                as_json=args.json and echo, echo=echo,
                plots=None if args.no_plot else single_plot(
                    NAME, "cold and warm load per model" if d["config"].get("load_only")
                    else "decode, prefill and peak RSS per model", plot))

    import signal

    if args.from_json:
        from pagedkv.bench.models.report import summarize_model

        data = read_variant(args.from_json, args.variant)
        for entry in data["models"]:
            entry["summary"] = summarize_model(entry, data["read_bandwidth"]["bytes_per_s"])
        if args.note:
            data["config"]["note"] = args.note
        write(json_clean(data), echo=True)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a terminated run kills its measured child
    try:
        write(collect(args, on_model=write), echo=True)
    except SourcesChanged as exc:
        log(f"[models] {exc}")
        return 2
    return 0
