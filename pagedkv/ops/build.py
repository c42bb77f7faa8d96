"""The one builder of pagedkv's native sources (``pagedkv/csrc``: the ``.c`` / ``.cpp`` files).

The sources ship in the wheel (``pyproject.toml`` package-data lists ``*.c`` and ``*.cpp`` of
``pagedkv.csrc``) and are compiled on first use with the system compiler
(``$CC``, else ``cc``/``gcc``/``clang``; a C++ source with ``$CXX``, else ``c++``/``g++``/
``clang++``) by :func:`compile_c`. The shared object is cached under ``$PAGEDKV_CACHE_DIR``
(default ``~/.cache/pagedkv``), keyed by the source, compiler, flags and the CPU's feature
flags, so an install that keeps the same sources (an editable checkout, a wheel) reuses it.
:class:`BuiltOnce` holds one kernel per process and turns a failed build into "use the torch
path" with a reason.

Each library's ctypes loader is the ``pagedkv.ops`` module named after its source
(``cpu_kernel``, ``step_op``, ``sample_ops``, ``qmm``, ``fused_ops``, ``decoder``);
``pagedkv.ops.native`` builds them all and reports which are in use. This module imports no torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

#: the native sources' directory (the ``pagedkv.csrc`` package)
SRC_DIR = Path(__file__).resolve().parents[1] / "csrc"
#: the file name patterns of the native sources (the same globs as package-data)
SOURCE_GLOBS = ("*.c", "*.cpp")


def source(name: str) -> Path:
    """The path of the native source ``name`` (a file name of this package, e.g.
    ``"qmm.c"``). Raises ``FileNotFoundError`` when the package does not hold it (an install
    that lost its package data)."""
    path = SRC_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"native source {name} is missing from {SRC_DIR} (an install without package data?)")
    return path


def sources() -> list[Path]:
    """Every native source of this package, sorted by name."""
    return sorted({p for g in SOURCE_GLOBS for p in SRC_DIR.glob(g)})


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def compiler(env: str = "CC", names: Sequence[str] = ("cc", "gcc", "clang")) -> str | None:
    """``$env`` if set and found, else the first of ``names`` on the PATH (None: none)."""
    for cand in (os.environ.get(env), *names):
        if cand and shutil.which(cand):
            return cand
    return None


def cache_dir() -> Path:
    """Where built objects are kept: ``$PAGEDKV_CACHE_DIR``, else ``~/.cache/pagedkv``."""
    base = os.environ.get("PAGEDKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedkv")
    return Path(base)


_ANNOUNCED = threading.Event()


def _announce_build(out_dir: Path) -> None:
    """Say once per process that kernels are being compiled: a first start on an empty cache
    spends tens of seconds in the compiler, which looked like a hang."""
    if not _ANNOUNCED.is_set():
        _ANNOUNCED.set()
        logging.getLogger("pagedkv").warning(
            "[pagedkv] compiling the C kernels for this CPU (first use of this version on this machine, "
            "tens of seconds on 2 cores; cached in %s)", out_dir)


def compile_c(src_path: Path, stem: str, flags: Sequence[str], cc: str | None = None,
              libs: Sequence[str] = ("-lm",)) -> ctypes.CDLL:
    """Compile the C file ``src_path`` (or a C++ one with ``cc`` a C++ compiler) into a shared object and
    load it with ``flags`` (e.g. ``-O3 -march=native -fopenmp -fPIC -shared``). The object is cached under ``$PAGEDKV_CACHE_DIR`` (default ``~/.cache/pagedkv``)
    as ``{stem}_{key}.so``, keyed by the source, compiler, flags, ``libs`` (link arguments,
    after the source) and the CPU's feature flags. ``cc``: another compiler (a C++ one for a
    ``.cpp`` source), else the system C compiler.
    Raises ``RuntimeError`` when there is no compiler or the build fails."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC)")
    src = src_path.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *flags, *libs, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    so = out_dir / f"{stem}_{key}.so"
    if not so.exists():
        _announce_build(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            res = subprocess.run([cc, *flags, str(src_path), "-o", tmp, *libs], capture_output=True, text=True,
                                 timeout=300)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
            os.replace(tmp, so)  # atomic: concurrent builders race harmlessly
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(so))


class BuiltOnce:
    """A compiled helper built on first use, shared by the process: ``get()`` returns it, or
    ``None`` (callers use their torch path) when ``env_var`` is ``"0"`` or ``build()`` raised;
    ``error()`` says why."""

    def __init__(self, env_var: str, build) -> None:
        self._env_var, self._build = env_var, build
        self._lock = threading.Lock()
        self._state: dict[str, object] = {}

    def get(self):
        if os.environ.get(self._env_var, "1") == "0":  # read each call, never cached: unset it and
            return None  # the helper is built (a test's monkeypatch must not disable it for the process)
        if "value" in self._state:
            return self._state["value"]
        with self._lock:
            if "value" not in self._state:
                try:
                    self._state["value"] = self._build()
                except Exception as exc:  # noqa: BLE001 - any failure means "use the torch path"
                    self._state.update(value=None, error=f"{type(exc).__name__}: {exc}")
        return self._state["value"]

    def error(self) -> str | None:
        """Why ``get()`` returned ``None`` (``None`` if it did not, or was not called yet)."""
        if os.environ.get(self._env_var, "1") == "0":
            return f"disabled by {self._env_var}=0"
        return self._state.get("error")  # type: ignore[return-value]
