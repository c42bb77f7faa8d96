"""Small helpers every layer may import (it imports nothing of pagedkv but ``errors``).

* :func:`cdiv` — ceiling division (tokens -> blocks).
* the one dtype table: names and aliases -> a canonical short name, its bytes per element
  and its torch dtype (:func:`canonical_dtype`, :func:`torch_dtype`, :func:`dtype_name`);
  the KV-cache formats (:func:`kv_cache_dtype`: ``auto``, float32, bfloat16, int8, fp8_e4m3, ...).
* :func:`linear_layer` — ``nn.Linear`` without its random init on the meta device (model skeletons).
* :func:`free_port` — a free TCP port on 127.0.0.1 (servers in tests, benchmarks, workers).
* :func:`release_openmp_pool` — give back the calling thread's OpenMP threads (servers step the
  engine in another thread than the one that built it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from typing import Any

from pagedkv.errors import ConfigError


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b`` (e.g. tokens -> blocks)."""
    return -(-a // b)


#: canonical dtype name -> (torch attribute name or None, bytes per element). int4 packs two
#: values per byte; fp8 and int4 exist only as KV-cache storage formats (sizing, seed §01).
DTYPES: dict[str, tuple[Any, float]] = {
    "fp32": ("float32", 4),
    "bf16": ("bfloat16", 2),
    "fp16": ("float16", 2),
    "fp8": (None, 1),
    "int8": ("int8", 1),
    "int4": (None, 0.5),
}
#: other spellings users and configs write (lower case, without a ``torch.`` prefix).
DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32", "float": "fp32", "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "float8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8_e4m3fn": "fp8",
}
#: dtypes the model (weights, activations, a plain KV cache) computes in.
MODEL_DTYPES = ("fp32", "bf16", "fp16")

#: KV-cache storage formats the engine runs (``kv_cache_dtype``, vLLM's names): ``auto`` = the
#: model dtype; int8 and the fp8 formats store codes plus one bf16 scale per group of each
#: head vector (pagedkv.attention.quant). Value: the torch dtype the format needs (fp8 only).
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None, "float32": None, "bfloat16": None, "float16": None,
    "int8": None, "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}
#: other spellings of the same formats (``fp8`` is e4m3, as in vLLM).
KV_CACHE_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
    "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
}


def canonical_dtype(dtype: Any, allowed: tuple[str, ...] | None = None) -> str:
    """Canonical short name (``"bfloat16"``, ``torch.bfloat16`` -> ``"bf16"``) of a dtype name
    or torch dtype. ``allowed`` restricts the result (default: every name of ``DTYPES``).
    Raises ``ConfigError`` naming the valid values."""
    valid = allowed or tuple(DTYPES)
    key = str(dtype).strip().lower().removeprefix("torch.") if not isinstance(dtype, bool) else ""
    key = DTYPE_ALIASES.get(key, key)
    if key not in valid:
        names = sorted(set(valid) | {a for a, c in DTYPE_ALIASES.items() if c in valid})
        raise ConfigError(f"dtype: unsupported {dtype!r} (one of {', '.join(names)})")
    return key


def kv_cache_dtype(name: Any, model_dtype: Any = "fp32") -> str:
    """The KV-cache format of ``kv_cache_dtype=name``: one of ``float32``, ``bfloat16``,
    ``float16``, ``int8``, ``fp8_e4m3``, ``fp8_e5m2`` (``auto`` resolves to ``model_dtype``).
    Raises ``ConfigError`` naming the valid values for an unknown name, or the formats this
    torch has when it lacks the fp8 dtype asked for. A torch dtype names its format too
    (``torch.bfloat16``, ``torch.int8``, ``torch.float8_e4m3fn``), as it does for ``dtype``."""
    import torch

    if isinstance(name, torch.dtype):
        name = str(name)
    key = name.strip().lower().removeprefix("torch.") if isinstance(name, str) else ""
    key = KV_CACHE_DTYPE_ALIASES.get(key, key)
    have = [n for n, t in KV_CACHE_DTYPES.items() if t is None or hasattr(torch, t)]
    if key not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype: unknown {name!r} (valid: {', '.join(KV_CACHE_DTYPES)})")
    if key not in have:
        raise ConfigError(f"kv_cache_dtype: {key} needs torch.{KV_CACHE_DTYPES[key]}, which torch "
                          f"{torch.__version__} lacks (valid here: {', '.join(have)})")
    if key == "auto":
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[canonical_dtype(model_dtype, MODEL_DTYPES)]
    return key


def torch_dtype(dtype: Any):
    """The ``torch.dtype`` of a model dtype (name, alias or torch dtype): float32, bfloat16
    or float16. Raises ``ConfigError`` for anything else."""
    import torch

    return getattr(torch, DTYPES[canonical_dtype(dtype, MODEL_DTYPES)][0])


def linear_layer(in_features: int, out_features: int, bias: bool, dtype: Any, device: Any) -> Any:
    """An ``nn.Linear`` (exactly that type) ``[out_features, in_features]``. On the meta device
    its random init is skipped: a loader assigns every weight, and ``kaiming_uniform_`` on meta
    tensors runs through torch's decompositions (~0.9 s of a warm start for a 24-layer,
    128-expert model's 6,217 expert matrices on an AMD EPYC Zen 3). Elsewhere it is
    ``nn.Linear(...)``."""
    import torch
    from torch import nn

    if str(device) != "meta":
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    m = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(m)
    m.in_features, m.out_features = in_features, out_features
    m.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device="meta"))
    if bias:
        m.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta"))
    else:
        m.register_parameter("bias", None)
    return m


def dtype_bytes(dtype: Any) -> float:
    """Bytes per element of a dtype (``int4``: 0.5). Raises ``ConfigError``."""
    return DTYPES[canonical_dtype(dtype)][1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair(tries: int = 50) -> int:
    """A TCP port ``p`` on 127.0.0.1 with ``p`` and ``p + 1`` both free a moment ago (a KV-event
    endpoint and its default replay endpoint, ``port + 1``); ``OSError`` after ``tries``."""
    for _ in range(tries):
        p = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b:
            try:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise OSError("no two adjacent free TCP ports on 127.0.0.1")


_NULL_SCOPE = contextlib.nullcontext()


def profile_scope(name: str):
    """A ``torch.profiler.record_function(name)`` region while a profiler runs, else a no-op
    (a disabled ``record_function`` still costs ~7 us; this check ~0.1 us). The engine labels
    its phases with it (``pagedkv.schedule``, ``.prepare``, ``.attention``, ``.logits``,
    ``.sample``, ``.update``, ``.output``); ``pagedkv bench step`` reads them."""
    import torch

    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NULL_SCOPE


def passive_wait_warning(num_threads: int) -> str | None:
    """A warning when ``OMP_WAIT_POLICY=PASSIVE`` is set and ``num_threads`` > 1, else ``None``.
    With it every parallel torch op (and the C kernels) puts its helper threads to sleep and
    wakes them again: batch-1 int4 decode measured 37.6 vs 20.0 ms per step here (2 threads),
    and llama.cpp's OpenMP build slows alike. Right for a test suite sharing two cores with
    other processes, wrong for serving or benchmarking (docs/performance.md)."""
    if num_threads > 1 and os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        return ("OMP_WAIT_POLICY=PASSIVE with %d threads: every parallel op wakes sleeping threads "
                "(batch-1 decode about 1.9x slower); unset it to serve or benchmark" % num_threads)
    return None


def _loaded_libgomps() -> list[str]:
    """Paths of the GNU OpenMP runtimes mapped into this process (torch's ``libgomp.so.1``; the
    C kernels and inductor's graphs share it; a wheel may also bring its own), or [] (not Linux,
    or another runtime)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libgomp") and ".so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def release_openmp_pool() -> bool:
    """Give back the OpenMP threads the calling thread holds (libgomp's
    ``omp_pause_resource_all(omp_pause_soft)``, OpenMP 5.0 §3.2.44, in every libgomp mapped);
    the next parallel op in this thread starts new ones. Returns True if a GNU OpenMP runtime
    released them, False where there is none (or it refused: called inside a parallel region).

    Why (docs/performance.md, "One OpenMP pool"): libgomp keeps a pool of helper threads for
    every thread that ever ran a parallel region, for that thread's lifetime, and once it
    manages more threads than there are cores its waiting threads spin only 100 turns
    (``gomp_throttled_spin_count_var``) instead of ~300,000 before they sleep. A server builds
    its engine (load, warm-up, compiled graphs) in the main thread and steps it in the engine
    loop's thread: with 2 torch threads on 2 cores that was one pool too many, so every one of
    a step's hundreds of parallel ops woke sleeping threads (served batch-1 inter-token latency
    p50 69-94 ms against 23-26 ms with the builder's pool given back, side by side)."""
    ok = False
    for path in _loaded_libgomps():
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        ok = (fn(1) == 0) or ok  # 1 = omp_pause_soft
    return ok


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim(0)``). Tensors below
    glibc's mmap threshold (up to 32 MB once it has adapted) come from malloc's arena, and
    freeing them returns them to the arena, not the OS: the bundled model in ``weights=bf16``
    kept 941 MB resident after its layers' plain weights were freed for their prepacked copies,
    681 MB after this (736 MB unpacked). Returns False where the C library has no such call."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    fn(0)
    return True
