#!/usr/bin/env python3
"""Install the optional benchmark peers (``make peers``); neither is a test dependency.

* **llama-cpp-python** (``pagedkv bench peers``: llama.cpp one request at a time), built from
  source into the running interpreter's environment with :data:`CMAKE_FLAGS` (a native build,
  ``-march=native``, crashes on some of these machines: the CPU the wheel is built on is not
  always the CPU it runs on);
* **guidellm** (the serving benchmark client of ``pagedkv bench serve --peer llama-server``),
  installed under a constraints file that pins the torch and transformers already installed,
  so its dependencies cannot replace them;
* **llama-server** (llama.cpp's own server: continuous batching, parallel slots), built from
  the llama.cpp sources that the llama-cpp-python sdist carries (``vendor/llama.cpp``), with
  the same flags, into ``$PAGEDKV_CACHE_DIR/peers`` (default ``~/.cache/pagedkv/peers``):
  ``bin/llama-server`` plus ``bin/llama-server.json`` saying what it was built from.

Idempotent: a step whose result is already there (same version, same flags) is skipped.
Afterwards ``pip check`` may report nothing that was not already reported before.
Network: PyPI only (pip). The build never downloads llama.cpp's web UI (it is switched off).

Usage: ``python scripts/install_peers.py [--dry-run] [--only STEP,...] [--jobs N]``
(steps: llama-cpp-python, guidellm, llama-server). Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
GUIDELLM_VERSION = "0.8.1"
#: The CPU flags of every llama.cpp build here: no -march=native; AVX2/FMA/F16C explicitly.
CMAKE_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")
#: llama-server only: static, Release, no tests/examples, no web UI (its build would fetch
#: prebuilt assets from the Hugging Face hub), no OpenSSL (the benchmark talks plain HTTP).
SERVER_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
)
#: Packages the peers must leave exactly as they are.
PINNED = ("torch", "transformers")
STEPS = ("llama-cpp-python", "guidellm", "llama-server")


def cache_dir() -> Path:
    """``$PAGEDKV_CACHE_DIR/peers`` or ``~/.cache/pagedkv/peers`` (pagedkv's cache root, as in
    ``pagedkv.model.weight_cache.cache_root``; ``pagedkv bench serve --peer`` looks here)."""
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv"
    return root / "peers"


def installed_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@dataclass
class Step:
    """One command: ``argv`` run in ``cwd`` with ``env`` added to the environment."""

    what: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Optional[Path] = None

    def show(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cd = f"(cd {shlex.quote(str(self.cwd))} && " if self.cwd else ""
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return f"{cd}{env + ' ' if env else ''}{cmd}{')' if cd else ''}"


def constraints_text(versions: dict[str, Optional[str]]) -> str:
    """A pip constraints file pinning every installed package of :data:`PINNED` (local
    version labels such as ``+cpu`` dropped: ``torch==2.13.0`` matches ``2.13.0+cpu``)."""
    lines = [f"{name}=={v.split('+')[0]}" for name, v in versions.items() if v]
    return "\n".join(lines) + "\n"


def pip_steps(python: str, constraints: Path, jobs: int) -> dict[str, Step]:
    """The two pip installs, by step name."""
    pip = [python, "-m", "pip", "install", "-q", "-c", str(constraints)]
    return {
        "llama-cpp-python": Step(
            "llama-cpp-python from source",
            # --no-cache-dir: a wheel pip cached from an earlier build would skip CMAKE_ARGS
            pip + ["--no-cache-dir", "--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
            env={"CMAKE_ARGS": " ".join(CMAKE_FLAGS), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)},
        ),
        "guidellm": Step("guidellm", pip + [f"guidellm=={GUIDELLM_VERSION}"]),
    }


def server_steps(python: str, cache: Path, jobs: int) -> list[Step]:
    """Download the llama-cpp-python sdist, unpack it, configure and build ``llama-server``,
    copy the binary to ``cache/bin``. The unpacking is done by :func:`unpack` (no command)."""
    src = llama_cpp_source(cache)
    build = cache / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    return [
        Step("download the llama-cpp-python sdist",
             [python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(cache / "src")]),
        Step("configure llama.cpp", ["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS, *SERVER_FLAGS]),
        Step("build llama-server", ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]),
    ]


def sdist_path(cache: Path) -> Path:
    return cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"


def llama_cpp_source(cache: Path) -> Path:
    """Where the sdist's llama.cpp sources are unpacked."""
    return cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"


def unpack(cache: Path) -> Path:
    """Unpack the sdist under ``cache/src`` (once); returns the llama.cpp source dir.
    Raises ``FileNotFoundError`` if the sdist or its ``vendor/llama.cpp`` is missing."""
    src = llama_cpp_source(cache)
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist_path(cache)) as tar:
            tar.extractall(cache / "src", filter="data")
    if not (src / "tools" / "server").is_dir():
        raise FileNotFoundError(f"no llama.cpp server sources under {src}")
    return src


def server_stamp() -> dict[str, object]:
    """What ``bin/llama-server.json`` records; a build with a different stamp is redone."""
    return {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "cmake_flags": list(CMAKE_FLAGS),
            "server_flags": list(SERVER_FLAGS)}


def server_is_current(cache: Path) -> bool:
    binary, stamp = cache / "bin" / "llama-server", cache / "bin" / "llama-server.json"
    if not (binary.is_file() and stamp.is_file()):
        return False
    try:
        return json.loads(stamp.read_text()) == server_stamp()
    except ValueError:
        return False


def new_problems(before: str, after: str) -> list[str]:
    """Lines of ``pip check``'s output ``after`` that were not in its output ``before``."""
    old = {line.strip() for line in before.splitlines()}
    return [line.strip() for line in after.splitlines() if line.strip() and line.strip() not in old
            and not line.startswith("No broken requirements")]


def _run(step: Step, dry_run: bool) -> None:
    print(f"[peers] {step.what}: {step.show()}", flush=True)
    if dry_run:
        return
    subprocess.run(step.argv, check=True, cwd=step.cwd, env={**os.environ, **step.env})


def _pip_check(python: str) -> str:
    r = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    return r.stdout + r.stderr


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    p.add_argument("--only", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    p.add_argument("--force", action="store_true", help="redo steps whose result is already there")
    args = p.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(STEPS)
    if unknown:
        p.error(f"unknown step(s): {', '.join(sorted(unknown))}")
    python, cache = sys.executable, cache_dir()
    pinned = {name: installed_version(name) for name in PINNED}
    constraints = cache / "constraints.txt"
    if not args.dry_run:
        cache.mkdir(parents=True, exist_ok=True)
        constraints.write_text(constraints_text(pinned))
    print(f"[peers] constraints ({constraints}): {constraints_text(pinned).strip().replace(chr(10), ', ')}")
    before = "" if args.dry_run else _pip_check(python)
    pips = pip_steps(python, constraints, args.jobs)
    wanted = {"llama-cpp-python": ("llama-cpp-python", LLAMA_CPP_PYTHON_VERSION), "guidellm": ("guidellm", GUIDELLM_VERSION)}
    for name in ("llama-cpp-python", "guidellm"):
        if name not in only:
            continue
        if not args.force and installed_version(wanted[name][0]) == wanted[name][1]:
            print(f"[peers] {name} {wanted[name][1]} is already installed")
            continue
        _run(pips[name], args.dry_run)
    if "llama-server" in only:
        if not args.force and server_is_current(cache):
            print(f"[peers] {cache / 'bin' / 'llama-server'} is already built")
        else:
            download, configure, build = server_steps(python, cache, args.jobs)
            if not sdist_path(cache).is_file():
                _run(download, args.dry_run)
            if not args.dry_run:
                unpack(cache)
            _run(configure, args.dry_run)
            _run(build, args.dry_run)
            if not args.dry_run:
                (cache / "bin").mkdir(exist_ok=True)
                shutil.copy2(cache / "build" / "bin" / "llama-server", cache / "bin" / "llama-server")
                (cache / "bin" / "llama-server.json").write_text(json.dumps(server_stamp(), indent=1) + "\n")
                print(f"[peers] built {cache / 'bin' / 'llama-server'}")
    if args.dry_run:
        return 0
    changed = {n: (v, installed_version(n)) for n, v in pinned.items() if installed_version(n) != v}
    problems = new_problems(before, _pip_check(python))
    for n, (old, new) in changed.items():
        print(f"[peers] ERROR: {n} changed from {old} to {new}", file=sys.stderr)
    for line in problems:
        print(f"[peers] ERROR: pip check: {line}", file=sys.stderr)
    if changed or problems:
        return 1
    print("[peers] done: " + ", ".join(f"{n} {installed_version(n)}" for n in ("llama-cpp-python", "guidellm", *PINNED)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
