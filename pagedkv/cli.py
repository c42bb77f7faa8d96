"""``pagedkv`` command line: example | plan | generate | chat | serve | bench | check-backend | export-hf.

Each area registers its own sub-commands (``register(subparsers)`` in its ``cli`` module), so
this file stays a list.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that define ``register(subparsers)``; each adds its sub-commands.
COMMAND_MODULES = [
    "pagedkv.examples.cli",  # example | plan
    "pagedkv.engine.cli",
    "pagedkv.bench.cli",
    "pagedkv.serving.cli",  # serve (one engine, or --data-parallel-size N replicas)
    "pagedkv.testing.cli",
    "pagedkv.model.export_hf",  # export-hf (a GGUF as a Hugging Face directory)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedkv.errors import PagedKVError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except PagedKVError as exc:
        print(f"pagedkv: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
