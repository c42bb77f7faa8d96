"""``pagedkv check-backend NAME [NAME ...] | --all``: run the conformance kit.

Prints one ``PASS``/``FAIL``/``SKIP`` line per backend (``-v``: one line per case too) and
exits 1 if any backend fails (a backend that cannot run here, e.g. Triton not installed, is
``SKIP`` and does not fail the run unless ``--strict``).
"""

from __future__ import annotations

import argparse
import sys
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check-backend", help="run the attention-backend conformance kit",
                              description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="backend names (see --list)")
    p.add_argument("--all", action="store_true", help="every registered backend and layout")
    p.add_argument("--list", action="store_true", help="list registered backends and exit")
    p.add_argument("--device", default=None, help="device (default: cuda if available for triton, else cpu)")
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated dtypes (default float32,bfloat16)")
    p.add_argument("--small", action="store_true", help="small cases only (default for triton on cpu)")
    p.add_argument("--strict", action="store_true", help="a backend that cannot run here is a failure")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per case")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedkv.attention.registry import backend_info, get_backend, list_backends
    from pagedkv.errors import BackendError, ConfigError
    from pagedkv.testing.conformance import check_backend, is_small_backend

    if args.list:
        for name in list_backends():
            info = backend_info(name)
            print(f"{name:18s} layout={info['layout']:7s} {info['description']}")
        return 0
    names = list_backends() if args.all else list(args.names)
    if not names:
        raise ConfigError("name a backend (see `pagedkv check-backend --list`) or pass --all")
    dtypes = []
    for d in args.dtype.split(","):
        dt = getattr(torch, d.strip(), None)
        if not isinstance(dt, torch.dtype):
            raise ConfigError(f"--dtype: unknown dtype {d!r}")
        dtypes.append(dt)
    failed = 0
    for name in names:
        backend_info(name)  # ConfigError for an unknown name, listing the valid ones
        device = args.device or ("cuda" if name.startswith("triton") and torch.cuda.is_available() else "cpu")
        t0 = time.perf_counter()
        try:
            be = get_backend(name)
        except (BackendError, ImportError) as exc:
            print(f"SKIP {name}: cannot run here ({exc})")
            failed += bool(args.strict)
            continue
        small = args.small or is_small_backend(name, device)
        report = check_backend(be, device=device, dtypes=dtypes, small=small)
        n_ok = sum(r.ok for r in report.results)
        status = "PASS" if report.ok else "FAIL"
        print(f"{status} {name} (layout {backend_info(name)['layout']}, {device}{', small' if small else ''}): "
              f"{n_ok}/{len(report.results)} cases in {time.perf_counter() - t0:.1f}s", flush=True)
        for r in report.results:
            if args.verbose or not r.ok:
                print("    " + r.line())
        failed += not report.ok
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv-check-backend")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["check-backend", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
