"""Shared plumbing for benchmarks: machine facts, thread pinning, load average, the model and
engine helpers the serving-style benchmarks share, and JSON clean-up.

Result files (JSON + Markdown + PNG) are written by :mod:`pagedkv.bench.report`; the HTTP
server and client by :mod:`pagedkv.bench.http`; trace workloads by :mod:`pagedkv.bench.workload`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"

_PACKAGES = ["torch", "transformers", "gguf", "numpy", "triton", "fastapi", "uvicorn"]


#: what every llama.cpp process (llama-bench, llama-server) gets on top of this process's
#: environment: glibc's malloc advises its large blocks for 2 MiB pages (glibc 2.35+; older
#: ones ignore it), so llama.cpp's weight buffers (its repacked Q4_0 / Q4_K, every weight
#: without mmap) stream from the huge pages pagedkv's packed weights have
#: (``pagedkv.ops.hugepages``). Its best on a THP-``madvise`` host: SmolLM2-1.7B-shape Q4_0
#: decode 28.1-31.4 -> 31.5-33.9 tok/s (Zen 4, 2 threads, 8 runs each; Q4_K_M the same within noise).
LLAMA_CPP_TUNABLES = "glibc.malloc.hugetlb=1"


def llama_cpp_env() -> dict[str, str]:
    """This process's environment with :data:`LLAMA_CPP_TUNABLES` added to ``GLIBC_TUNABLES``."""
    env = dict(os.environ)
    old = env.get("GLIBC_TUNABLES")
    env["GLIBC_TUNABLES"] = f"{old}:{LLAMA_CPP_TUNABLES}" if old else LLAMA_CPP_TUNABLES
    return env


def default_workload() -> Path:
    """``../shared/workloads/azure_llm_2023_conv.csv`` beside the repository."""
    return REPO_ROOT.parent / "shared" / "workloads" / "azure_llm_2023_conv.csv"


def add_options(p: Any, options: list[tuple[str, Any, str]]) -> None:
    """Add ``(flag, default, help)`` options to a parser or argument group, each typed like its
    default (int, float or str)."""
    for flag, default, text in options:
        p.add_argument(flag, type=type(default), default=default, help=text)


def add_run_options(p: argparse.ArgumentParser, tiny: str, note: bool = False) -> None:
    """``--tiny`` (a test-sized run; ``tiny`` says what it shrinks), ``--no-plot`` and, with
    ``note``, ``--note`` (free text recorded in the results)."""
    p.add_argument("--tiny", action="store_true", help=f"test-sized run: {tiny}")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    if note:
        p.add_argument("--note", default=None, help="free text recorded in the results (e.g. why a run was shrunk)")


def pin_threads(num_threads: int) -> int:
    """Pin torch's intra-op thread count (benchmarks say what they pinned). Returns it."""
    import torch

    torch.set_num_threads(num_threads)
    return num_threads


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=5)
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
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default",
        "cpu_isa": _cpu_isa(),
        "packages": versions,
        "commit": git_commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _cpu_isa() -> dict[str, Any]:
    """The CPU profile the kernels ran under (``pagedkv.cpu_isa``: class, cap, flags, ATen's
    capability, oneDNN's ISA, the C kernels' -march)."""
    from pagedkv import cpu_isa
    from pagedkv.errors import ConfigError

    try:
        return cpu_isa.profile().as_dict()
    except ConfigError as e:
        return {"error": str(e)}


def load_average() -> Optional[float]:
    """The 1-minute load average, or None where the OS has none (the machine is shared: a
    busy machine slows every system measured)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


@dataclass
class RunFacts:
    """The torch threads a run pinned and the machine's load average when it started; the
    results record both, with the load at the end (the machine is shared)."""

    threads: int
    load_start: Optional[float]

    @classmethod
    def start(cls, threads: int) -> "RunFacts":
        """Pin ``threads`` torch threads and note the load average."""
        return cls(pin_threads(threads), load_average())

    def finish(self) -> dict[str, Any]:
        """``{"load_average_1m": {"start", "end"}, "machine": machine_info(threads)}``."""
        return {"load_average_1m": {"start": self.load_start, "end": load_average()},
                "machine": machine_info(self.threads)}


def log(msg: str) -> None:
    """A progress line on stderr (stdout may carry ``--json``)."""
    print(msg, file=sys.stderr, flush=True)


def finite_or_none(x: Any) -> Any:
    """``x`` unless it is a non-finite float (JSON has no NaN): then None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def json_clean(obj: Any) -> Any:
    """``obj`` with every NaN/inf replaced by None, dicts and lists walked (tuples become lists)."""
    if isinstance(obj, dict):
        return {k: json_clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_clean(v) for v in obj]
    return finite_or_none(obj)


# ---- the model and engines (serve, peers, ablation) ----------------------------------------
def int_at_least(lowest: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= lowest``, else a usage error (exit 2) saying so."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lowest}, got {text!r}") from None
        if v < lowest:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lowest}, got {v}")
        return v

    return parse


def load_fp32_model(loaded: Any = None, path: Optional[str] = None, weights: str = "fp32") -> Any:
    """``loaded`` if given (tests pass a shared fixture), else the model at ``path`` (default:
    the bundled SmolLM2-135M) loaded in float32 with ``weights``-format linear layers
    (``fp32 | bf16 | int8 | int4 | auto``, see docs/weights.md; ``ConfigError`` for another
    name)."""
    if loaded is not None:
        return loaded
    from pagedkv.model.loader import load_model

    return load_model(path, dtype="float32", weights=None if weights == "fp32" else weights)


def weights_of(loaded: Any) -> str:
    """The linear-layer format of a loaded model (``fp32`` when unquantised)."""
    return str(getattr(loaded, "weights", None) or "fp32")


def engine_from_args(loaded: Any, args: Any, **overrides: Any) -> Any:
    """A float32 ``LLMEngine`` over ``loaded`` sized by the benchmark's ``--block-size``,
    ``--num-blocks``, ``--max-model-len``, ``--max-num-seqs`` and ``--max-num-batched-tokens``;
    ``overrides`` (any engine option) win."""
    from pagedkv.engine.engine import LLMEngine

    opts = dict(dtype="float32", block_size=args.block_size, num_blocks=args.num_blocks,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens)
    opts.update(overrides)
    return LLMEngine(loaded, **opts)


def greedy(max_tokens: int) -> Any:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored)."""
    from pagedkv.engine.request import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def drain(engine: Any) -> dict[str, Any]:
    """Step ``engine`` until nothing is left; returns the finished outputs by request id."""
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def warm_up(engine: Any, prompt: list[int]) -> None:
    """One short untimed request (first-call allocations, kernels)."""
    engine.add_request("warmup", prompt, greedy(3))
    drain(engine)


def tokens_computed(engine: Any) -> int:
    """Token positions the model computed so far (prompt chunks + decodes; prefix-cache hits
    are not computed): ``EngineStats.num_batched_tokens``."""
    return engine.get_stats().num_batched_tokens
