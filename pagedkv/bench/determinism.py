"""What batch invariance costs: throughput with deterministic=True vs False (and vs a baseline checkout).

``pagedkv bench determinism`` runs the same offline workloads through ``pagedkv.LLM`` in one
child process per (system, weight format, round), systems interleaved round by round, and
reports the median and interquartile range of each measurement per system:

* ``prefill_512`` / ``prefill_2048``: one prompt of that many tokens, 1 output token (tok/s);
* ``decode_b1``: one 32-token prompt, 128 output tokens, the prefill's time taken out (tok/s);
* ``offline_256_64``: 16 requests of 256 prompt + 64 output tokens submitted at once (output tok/s);
* ``offline_32_256``: 8 requests of 32 prompt + 256 output tokens (decode-heavy; output tok/s).

Systems: this tree with ``deterministic=True`` (the default) and ``False``; with
``--baseline PATH`` also another checkout of pagedkv (e.g. the commit before the single
attention kernel: ``git worktree add /tmp/base <commit>``) run with its own defaults. Prompts
are fixed random token ids, greedy, ``ignore_eos``. Results: ``docs/benchmarks/determinism.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pagedkv.bench.common import RunFacts, log
from pagedkv.bench.report import markdown_table, publish

WORKLOADS = ("prefill_512", "prefill_2048", "decode_b1", "offline_256_64", "offline_32_256")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="model (default the bundled SmolLM2)")
    p.add_argument("--weights", default="auto,fp32", help="comma-separated weight formats (default auto,fp32)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--baseline", default=None, metavar="PATH", help="another pagedkv checkout to measure beside")
    p.add_argument("--tiny", action="store_true", help="test-sized run: short prompts and outputs, 1 round")
    p.add_argument("--note", default=None, help="free text recorded in the results")


def _quartiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    if len(s) == 1:
        return {"median": s[0], "q1": s[0], "q3": s[0]}
    q = statistics.quantiles(s, n=4, method="inclusive")
    return {"median": statistics.median(s), "q1": q[0], "q3": q[2]}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One system's measurements (``spec``: model, engine kwargs, threads, sizes)."""
    import random

    import torch

    torch.set_num_threads(spec["threads"])
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.request import SamplingParams

    sz = spec["sizes"]
    llm = LLM(spec["model"], kv_cache_memory="512MiB", max_model_len=sz["prefill_2048"] + 16, **spec["engine"])
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    def timed(prompts: list[list[int]], out: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t

    timed([ids(16)], 4)  # warm-up
    res: dict[str, float] = {}
    for name in ("prefill_512", "prefill_2048"):
        n = sz[name]
        res[name] = n / min(timed([ids(n)], 1) for _ in range(2))
    p = ids(32)
    first, whole = timed([p], 1), timed([p], sz["decode"])
    res["decode_b1"] = (sz["decode"] - 1) / max(whole - first, 1e-9)
    for name, (n, pl, ol) in (("offline_256_64", sz["offline_256_64"]), ("offline_32_256", sz["offline_32_256"])):
        res[name] = n * ol / timed([ids(pl) for _ in range(n)], ol)
    res["weights"] = str(llm.engine.loaded.weights)
    return res


def _sizes(tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"prefill_512": 64, "prefill_2048": 128, "decode": 8,
                "offline_256_64": (4, 32, 4), "offline_32_256": (2, 8, 8)}
    return {"prefill_512": 512, "prefill_2048": 2048, "decode": 128,
            "offline_256_64": (16, 256, 64), "offline_32_256": (8, 32, 256)}


def run(args: argparse.Namespace) -> int:
    facts = RunFacts.start(args.threads)
    sizes = _sizes(args.tiny)
    systems: list[tuple[str, str | None, dict[str, Any]]] = [
        ("deterministic", None, {"deterministic": True}), ("not deterministic", None, {"deterministic": False})]
    if args.baseline:
        systems.append((f"baseline {Path(args.baseline).name}", str(Path(args.baseline).resolve()), {}))
    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    runs: list[dict[str, Any]] = []
    for r in range(1 if args.tiny else args.rounds):
        for w in formats:
            for label, tree, kw in systems:
                spec = {"model": args.model, "threads": args.threads, "sizes": sizes,
                        "engine": dict(kw, **({} if w == "auto" else {"weights": w}))}
                env = dict(os.environ)
                if tree:
                    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
                log(f"[determinism] round {r + 1}: {label}, weights {w}")
                t = time.perf_counter()
                # this file run by path (runpy: sys.path keeps the working directory, not this
                # package's folder): under --baseline, ``pagedkv`` imports from that tree
                code = f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
                proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)],
                                      env=env, cwd=tree or None, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"{label} ({w}) failed:\n{proc.stderr[-3000:]}")
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                runs.append({"round": r, "system": label, "weights_asked": w, "wall_s": time.perf_counter() - t, **res})
    summary = []
    for w in formats:
        for label, _, _ in systems:
            mine = [x for x in runs if x["system"] == label and x["weights_asked"] == w]
            row: dict[str, Any] = {"weights": f"{w} ({mine[0]['weights']})", "system": label}
            for k in WORKLOADS:
                row[k] = _quartiles([x[k] for x in mine])
            summary.append(row)
    data = {"benchmark": "determinism", "description": __doc__.strip().splitlines()[0], "model": args.model,
            "sizes": sizes, "rounds": 1 if args.tiny else args.rounds, "note": args.note, "summary": summary,
            "runs": runs, **facts.finish()}
    publish("determinism", data, render, args.out_dir, as_json=args.json)
    return 0


def render(data: dict[str, Any], plots: dict[str, str]) -> str:
    rows = []
    for s in data["summary"]:
        base = next(x for x in data["summary"] if x["weights"] == s["weights"] and x["system"] == "not deterministic")
        row = {"weights": s["weights"], "system": s["system"]}
        for k in WORKLOADS:
            q, ref = s[k], base[k]["median"]
            row[k] = f"{q['median']:.1f} [{q['q1']:.1f}-{q['q3']:.1f}] ({q['median'] / ref:.3f}x)"
        rows.append(row)
    lines = [f"# {data['description']}", "", f"Model {data['model']}; {data['rounds']} interleaved rounds, one "
             "process per system, format and round. Each cell: median [IQR] tok/s (ratio of medians to "
             "`deterministic=False` of the same format). Workloads: prefill of one 512- and one 2048-token "
             "prompt; batch-1 decode of 128 tokens; 16 requests 256/64 and 8 requests 32/256 at once "
             "(output tok/s).", "", markdown_table(rows, ["weights", "system", *WORKLOADS])]
    if data.get("note"):
        lines += ["", data["note"]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
