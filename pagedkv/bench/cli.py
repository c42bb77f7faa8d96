"""``pagedkv bench NAME``: every benchmark registers here (module with ``add_arguments`` and ``run``)."""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedkv.bench.common import int_at_least
from pagedkv.utils import passive_wait_warning

# name -> module defining add_arguments(parser) and run(args) -> int
BENCHES: dict[str, str] = {
    "capacity": "pagedkv.bench.capacity.run",
    "kv_quality": "pagedkv.bench.kv_quality",
    "serve": "pagedkv.bench.serve.run",
    "kv_serving": "pagedkv.bench.kv_serving",
    "peers": "pagedkv.bench.peers.run",
    "attention": "pagedkv.bench.attention.run",
    "block_manager": "pagedkv.bench.block_manager",
    "ablation": "pagedkv.bench.ablation.run",
    "step": "pagedkv.bench.step.run",
    "quality": "pagedkv.bench.quality",
    "offload": "pagedkv.bench.offload.run",
    "hybrid_blocks": "pagedkv.bench.hybrid_blocks",
    "route": "pagedkv.bench.route.run",
    "structured": "pagedkv.bench.structured",
    "spec": "pagedkv.bench.spec.run",
    "models": "pagedkv.bench.models.run",
    "determinism": "pagedkv.bench.determinism",
    "readme": "pagedkv.bench.readme",
}


def _with_wait_check(run):
    """``run`` preceded by a stderr note when OMP_WAIT_POLICY=PASSIVE would slow the run."""
    def checked(args: argparse.Namespace, *rest):
        warning = passive_wait_warning(getattr(args, "threads", 1))
        if warning is not None:
            print(f"note: {warning}; the results record the policy", file=sys.stderr)
        return run(args, *rest)
    return checked


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark (results under docs/benchmarks/)")
    sub = p.add_subparsers(dest="bench", required=True)
    for name, modname in BENCHES.items():
        mod = importlib.import_module(modname)
        bp = sub.add_parser(name, help=(mod.__doc__ or name).strip().splitlines()[0])
        bp.add_argument("--json", action="store_true", help="print results as JSON on stdout")
        bp.add_argument("--out-dir", default=None, help="where to write results (default docs/benchmarks/)")
        bp.add_argument("--threads", type=int_at_least(1), default=2, help="torch threads to pin (default 2)")
        mod.add_arguments(bp)
        bp.set_defaults(func=_with_wait_check(mod.run))
