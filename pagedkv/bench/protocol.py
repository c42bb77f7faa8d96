"""The comparison protocol every peer benchmark shares: interleaved rounds, one
estimator (the median) with its spread (the interquartile range), a goal "met" only when the
unfavourable quartile meets it, every run kept with the load it ran under, and the facts a
skeptic asks for (CPU model, ISA, threads, commit, dirty tree, llama.cpp's build).

Used by ``pagedkv bench models`` (:mod:`pagedkv.bench.models.run`), the llama.cpp batch-1
comparison of ``pagedkv bench peers`` (:mod:`pagedkv.bench.peers.native`) and ``pagedkv bench
serve --peer`` (:mod:`pagedkv.bench.serve.peer`).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from pagedkv.bench.common import REPO_ROOT, llama_cpp_env, load_average
from pagedkv.bench.models.guard import GB, run_guarded
from pagedkv.bench.models.make import peers_bin


# ---- the estimator ---------------------------------------------------------------------------
def spread(values: Sequence[Optional[float]]) -> Optional[dict[str, Any]]:
    """``{"median", "q1", "q3", "iqr", "n", "values"}`` of ``values`` (quartiles by the
    inclusive method; one value: all three equal; Nones skipped), None for no values."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    if len(vals) == 1:
        q1 = q3 = vals[0]
    else:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return {"median": statistics.median(vals), "q1": q1, "q3": q3, "iqr": q3 - q1, "n": len(vals), "values": vals}


def paired_ratios(ours: Sequence[Optional[float]], peer: Sequence[Optional[float]]) -> Optional[dict[str, Any]]:
    """:func:`spread` of the per-round ratios ``ours[i] / peer[i]`` (the two measured in the same
    round, minutes apart at most); rounds missing either side are skipped."""
    return spread([a / b for a, b in zip(ours, peer) if a is not None and b])


def goal_check(ratio: Optional[dict[str, Any]], target: Optional[float], higher_is_better: bool = True) -> Optional[bool]:
    """Whether the ratio's unfavourable quartile meets ``target``: ``q1 >= target`` when higher
    is better (throughput), ``q3 <= target`` when lower is (latency). None without a target or
    a ratio."""
    if target is None or ratio is None:
        return None
    return bool(ratio["q1"] >= target) if higher_is_better else bool(ratio["q3"] <= target)


def interleaved(systems: Sequence[str], round_index: int) -> list[str]:
    """The order of ``systems`` in round ``round_index`` (0-based): as given in even rounds,
    reversed in odd ones, so no system always runs first (or right after another)."""
    return list(systems) if round_index % 2 == 0 else list(reversed(systems))


def cell(s: Optional[dict[str, Any]], scale: float = 1.0, digits: int = 1, missing: str = "") -> str:
    """``median [q1-q3]`` of a :func:`spread` (divided by ``scale``), or ``missing`` (default
    "not measured")."""
    if s is None:
        return missing or "not measured"
    fmt = f"{{:.{digits}f}}"
    med = fmt.format(s["median"] / scale)
    if s["n"] < 2:
        return med
    return f"{med} [{fmt.format(s['q1'] / scale)}-{fmt.format(s['q3'] / scale)}]"


def ratio_cell(s: Optional[dict[str, Any]], missing: str = "n/a") -> str:
    """A ratio :func:`spread` as ``1.23x [1.10-1.30]``."""
    if s is None:
        return missing
    return f"{s['median']:.2f}x [{s['q1']:.2f}-{s['q3']:.2f}]" if s["n"] > 1 else f"{s['median']:.2f}x"


# ---- the facts recorded ---------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def dirty_tree() -> Optional[bool]:
    """Whether the checkout measured has uncommitted changes to tracked files (None: no git)."""
    try:
        r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=10)
        return bool(r.stdout.strip()) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def source_digest(package: Optional[Path] = None) -> str:
    """16 hex digits of the sha256 over the package's Python and C sources as they are on disk
    now (``pagedkv/**/*.py`` and ``pagedkv/csrc/*.c|*.cpp|*.h``, names and bytes): what every
    measured pagedkv process imports or compiles, since benchmarks start them from this checkout.
    ``package``: another source folder (tests)."""
    root = package if package is not None else REPO_ROOT / "pagedkv"
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".c", ".cpp", ".h") and p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


class SourcesChanged(RuntimeError):
    """pagedkv's sources changed while a benchmark ran: its later rounds would measure other code."""


def check_sources(at_start: str, where: str, package: Optional[Path] = None) -> None:
    """``SourcesChanged`` (naming ``where``) when :func:`source_digest` is no longer
    ``at_start``: a run stops rather than mix two versions of the code in one result."""
    now = source_digest(package)
    if now != at_start:
        raise SourcesChanged(f"pagedkv's sources changed during the run (before {where}: {at_start} -> {now}); "
                             "later rounds would measure other code: stopped (what finished before is written)")


def llama_cpp_stamp() -> Optional[dict[str, Any]]:
    """What ``make peers`` recorded of its llama.cpp build (variant, why, flags, system info):
    ``peers/bin/llama.cpp.json``; None when absent."""
    try:
        return json.loads((peers_bin() / "llama.cpp.json").read_text())
    except (OSError, ValueError):
        return None


def stamp_run(rec: dict[str, Any], load_start: Optional[float], t_start: float) -> dict[str, Any]:
    """``rec`` with the 1-minute load average at its start and end and its wall seconds."""
    rec.update({"load_1m_start": load_start, "load_1m_end": load_average(), "wall_s": time.time() - t_start})
    return rec


# ---- llama-bench ---------------------------------------------------------------------------------
SYSTEM_INFO_KEYS = ("build_commit", "build_number", "cpu_info", "backends", "n_threads", "model_type", "model_size",
                    "model_n_params", "type_k", "type_v", "use_mmap", "load_mode", "repack", "n_batch", "n_ubatch",
                    "flash_attn", "poll")


def llama_bench_run(bench: str, path: str, args: Any, measure_spec: dict[str, Any]) -> dict[str, Any]:
    """``llama-bench -p P -n N -r R -o json`` on ``path`` (``args``: ``threads``, ``timeout_s``,
    ``rss_limit_gb``; ``measure_spec``: ``prefill_tokens`` P, ``decode_tokens`` N and
    ``repetitions`` R, default 1): prefill and decode tokens/s (llama-bench's mean over its
    repetitions), every repetition's tokens/s (``*_samples``) and its system info fields."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    env = llama_cpp_env()
    cmd = [bench, "-m", path, "-t", str(args.threads), "-p", str(measure_spec["prefill_tokens"]),
           "-n", str(measure_spec["decode_tokens"]), "-r", str(measure_spec.get("repetitions", 1)), "-o", "json"]
    try:
        res = run_guarded(cmd, timeout_s=args.timeout_s, rss_limit_bytes=args.rss_limit_gb * GB, stdout_path=out,
                          env=env)
        text = out.read_text()
    finally:
        out.unlink(missing_ok=True)
    res["command"] = " ".join(cmd[:1] + ["-m", "FILE"] + cmd[3:])
    res["glibc_tunables"] = env["GLIBC_TUNABLES"]
    if res["status"] != "ok":
        return res
    try:
        tests = json.loads(text)
    except ValueError:
        res["status"], res["reason"] = "failed", "llama-bench printed no JSON"
        return res
    for t in tests:
        kind = "prefill" if t.get("n_gen", 0) == 0 and t.get("n_prompt", 0) > 0 else (
            "decode" if t.get("n_prompt", 0) == 0 and t.get("n_gen", 0) > 0 else None)
        if kind:
            res[f"{kind}_tokens_per_s"] = t["avg_ts"]
            res[f"{kind}_samples_tokens_per_s"] = t.get("samples_ts")
    first = tests[0] if tests else {}
    res["system_info"] = {k: first.get(k) for k in SYSTEM_INFO_KEYS}
    return res
