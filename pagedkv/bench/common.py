"""Shared plumbing for benchmarks: machine facts, result files, thread pinning."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

RESULTS_DIR = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"

_PACKAGES = ["torch", "transformers", "gguf", "numpy", "triton", "fastapi", "uvicorn"]


def pin_threads(num_threads: int) -> int:
    """Pin torch's intra-op thread count (benchmarks say what they pinned). Returns it."""
    import torch

    torch.set_num_threads(num_threads)
    return num_threads


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=RESULTS_DIR.parents[1], capture_output=True, text=True, timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - no git is not an error for a benchmark
        return "unknown"


def machine_info(num_threads: int | None = None) -> dict[str, Any]:
    """Machine, thread count, package versions and commit, recorded in every result file."""
    import torch

    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    mem_bytes = None
    try:
        mem_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem_bytes,
        "python": platform.python_version(),
        "torch_threads": num_threads if num_threads is not None else torch.get_num_threads(),
        "packages": versions,
        "commit": git_commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub Markdown table of ``rows`` (floats shown with 4 significant digits)."""
    if not rows:
        return "(no rows)\n"
    cols = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(
    name: str,
    data: dict[str, Any],
    markdown: str,
    out_dir: Path | str | None = None,
) -> dict[str, Path]:
    """Write ``<name>.json`` and ``<name>.md`` under ``out_dir`` (default docs/benchmarks/).

    ``data`` gets a ``"machine"`` entry if it has none. Returns the written paths.
    """
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    data.setdefault("machine", machine_info())
    jpath = out / f"{name}.json"
    mpath = out / f"{name}.md"
    jpath.write_text(json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")
    m = data["machine"]
    footer = (
        f"\n_Machine: {m['machine']}, {m['cpu_count']} CPUs, torch threads {m['torch_threads']}, "
        f"torch {m['packages'].get('torch')}, commit {m['commit']}, {m['time_utc']}._\n"
    )
    mpath.write_text(markdown.rstrip() + "\n" + footer)
    return {"json": jpath, "md": mpath}


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj)}")


def default_workload() -> Path:
    """``../shared/workloads/azure_llm_2023_conv.csv`` beside the repository."""
    return RESULTS_DIR.parents[2] / "shared" / "workloads" / "azure_llm_2023_conv.csv"
