"""The engine's native CPU kernels, built together ahead of the first request, and which of
them are in use.

Their sources live in ``pagedkv/csrc`` (shipped in the wheel) and are compiled on first use
with the system compiler by ``pagedkv.ops.build.compile_c``, cached under ``$PAGEDKV_CACHE_DIR``
(default ``~/.cache/pagedkv``), keyed by source, flags and CPU; a missing compiler leaves the
torch code paths. Building them lazily put 10-17 s of compiling into a fresh install's first
request, so ``make run`` / ``make test`` set-up runs ``python -m pagedkv.ops.native`` once and the
engine calls :func:`status` at start (a cache hit only loads the libraries) and logs it.

* ``attention``: paged attention and K/V writes (``pagedkv.ops.cpu_kernel``)
* ``fused``: RMSNorm, RoPE and activation passes of the decoder layer (``pagedkv.ops.fused_ops``)
* ``sampler``: greedy and inverse-CDF picks (``pagedkv.ops.sample_ops``)
* ``qmm``: integer matmuls of the int4/int8 weights (``pagedkv.ops.qmm``)
* ``decoder``: the native step loop over the decoder layers (``pagedkv.ops.decoder``)
* ``step_op``: a compiled step's attention op in C++ (``pagedkv.ops.step_op``; used by
  ``compile_decode`` engines only, so built only when asked for: about 15 s the first time)
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

logger = logging.getLogger("pagedkv")


#: every native kernel's name, in build order
KERNELS = ("attention", "fused", "sampler", "qmm", "decoder", "step_op")


def _kernels(compiled: bool) -> dict[str, Any]:
    from pagedkv.ops import cpu_kernel, decoder, fused_ops, qmm, sample_ops, step_op

    mods = {"attention": cpu_kernel, "fused": fused_ops, "sampler": sample_ops, "qmm": qmm, "decoder": decoder}
    return {**mods, "step_op": step_op} if compiled else mods


def build_all(compiled: bool = False) -> dict[str, str | None]:
    """Build (or load from the cache) every native kernel of an eager engine, and with
    ``compiled`` the compiled steps' ``step_op`` too; returns ``{name: None}`` for each one
    that loaded and ``{name: reason}`` for each that did not (the engine then runs its torch
    path for that part). Logs once when building took over a second. Never raises."""
    t0 = time.perf_counter()
    status: dict[str, str | None] = {}
    for name, mod in _kernels(compiled).items():
        status[name] = None if mod.get() is not None else (mod.build_error() or "unavailable")
    took = time.perf_counter() - t0
    if took > 1.0:
        logger.info("native kernels built in %.1fs (cached for later starts): %s", took,
                    ", ".join(f"{k} {'ok' if v is None else 'off: ' + v}" for k, v in status.items()))
    return status


def status(compiled: bool = False) -> dict[str, str]:
    """:func:`build_all` as words: ``{kernel: "in use"}`` for each kernel that loaded,
    ``{kernel: "off (reason)"}`` for each that did not (from its loader's ``build_error()``);
    the kernels and ``compiled`` as in :func:`build_all`. Never raises."""
    return {name: "in use" if err is None else f"off ({err})" for name, err in build_all(compiled).items()}


def summary(compiled: bool = False) -> str:
    """:func:`status` on one line (``attention in use, ..., qmm off (reason)``), for the log."""
    return ", ".join(f"{name} {state}" for name, state in status(compiled).items())


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedkv.ops.native``: build every kernel now (set-up step; ``step_op``
    included, so a first ``compile_decode`` start does not compile it), print one line each;
    exit status 0 even when some cannot build (the torch paths still work)."""
    from pagedkv.ops import qmm

    t0 = time.perf_counter()
    built = build_all(compiled=True)
    for name, err in built.items():
        extra = f" ({qmm.get().isa})" if name == "qmm" and err is None else ""
        print(f"[pagedkv] native kernel {name}: {'ok' + extra if err is None else 'off: ' + err}")
    print(f"[pagedkv] native kernels ready in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
