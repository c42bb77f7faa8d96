"""``pagedkv::step_layer_attention``: a compiled decode step's per-layer attention in C++
(``pagedkv/csrc/step_op.cpp``), so that the layers of a step reach the C kernel without Python.

A compiled step (``pagedkv.model.compiled``) calls one attention op per layer from inductor's
generated C++. Through the Python op (``pagedkv::layer_attention``) each call goes back into
the interpreter (wrap three tensors, take the GIL, run the backend's ``attend``): about 25 us
a layer in a step's cold caches, 0.7 ms of a 30-layer batch-1 step (docs/performance.md,
"Attention without Python"). This op, built against torch's headers with the system C++
compiler on first use (about 15 s, then cached under ``$PAGEDKV_CACHE_DIR``), keeps a table
per calling thread: for every layer of the step its cache buffers and options
(:meth:`StepTable.begin`, one call a step), and for every cache geometry the C kernel's
prepared arguments once the backend has built them for the step's first layer of that
geometry (:meth:`StepTable.prepare`). A layer with prepared arguments whose q/k/v match them
goes straight to ``pagedkv_write_attend``; every other call (and a kernel error) goes to the
Python op, which takes the checked path and raises the library's errors. The table is emptied
when the step ends (:meth:`StepTable.end`): its arguments point into that step's tensors.

``get()`` returns ``None`` (compiled steps then call the Python op) when there is no C++
compiler or torch's headers are missing, the build fails, the C kernel is unavailable, or
``PAGEDKV_STEP_OP=0``; ``build_error()`` says why.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
import threading
from typing import Sequence

import torch

from pagedkv.ops import cpu_kernel
from pagedkv.ops.build import BuiltOnce, compile_c, compiler, source


class LayerEntry(ctypes.Structure):
    """``Layer`` of ``step_op.cpp``: one layer's cache buffers, options and geometry group."""

    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("scale", ctypes.c_float),
                ("window", ctypes.c_int32), ("cap", ctypes.c_float), ("group", ctypes.c_int32)]


class StepTable:
    """This thread's table of the op (see the module docstring); one instance per process."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._begin, self._prepare = lib.pagedkv_step_begin, lib.pagedkv_step_prepare
        self._begin.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32]
        self._prepare.argtypes = [ctypes.c_int32, ctypes.c_void_p] + [ctypes.c_int32] * 5
        self._prepare.restype = ctypes.c_int32
        self._end = lib.pagedkv_step_end
        self._direct = lib.pagedkv_step_direct_calls
        self._direct.restype = ctypes.c_int64
        self.op = torch.ops.pagedkv.step_layer_attention
        self._held = threading.local()  # .args: this thread's prepared LayerArgs, until end()

    def begin(self, layers: ctypes.Array, n_groups: int) -> None:
        """Start this thread's step: ``layers`` (a ``LayerEntry`` array, one per layer, copied),
        ``n_groups`` cache geometries, none prepared."""
        self._begin(len(layers), ctypes.addressof(layers), n_groups)

    def prepare(self, group: int, args) -> None:
        """Geometry ``group``'s layers run in C++ from now until :meth:`end` with ``args`` (a
        ``cpu_kernel.LayerArgs``, kept alive by the caller until then), for q ``[n_tokens, hq,
        d]`` and k/v ``[n_tokens, hkv, d]`` in its query dtype (its fields). Raises
        ``IndexError`` for a group :meth:`begin` did not announce."""
        if self._prepare(group, ctypes.byref(args), args.qdt, args.hq, args.hkv, args.d, args.n_tokens) != 0:
            raise IndexError(f"step table: no geometry group {group} in this step")
        held = getattr(self._held, "args", None)
        self._held.args = (held or []) + [args]  # the C++ table points into it until end()

    def end(self) -> None:
        """End this thread's step: nothing prepared stays."""
        self._end()
        self._held.args = None

    def direct_calls(self) -> int:
        """Layers this thread ran in C++ since the last call (the count restarts)."""
        return int(self._direct())


def _build() -> StepTable:
    kernel = cpu_kernel.get()
    if kernel is None:
        raise RuntimeError(f"the C kernel is unavailable ({cpu_kernel.build_error()})")
    cxx = compiler("CXX", ("c++", "g++", "clang++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX)")
    root = Path(torch.__file__).parent
    include = root / "include"
    if not (include / "torch" / "library.h").exists():
        raise RuntimeError(f"torch's C++ headers are missing ({include})")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # the torch version goes into the flags, and so into the build's cache key
    flags = ["-O2", "-std=c++17", "-fPIC", "-shared", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-DPAGEDKV_TORCH_VERSION=\"{torch.__version__}\"", f"-I{include}",
             f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}"]
    lib_dir = root / "lib"
    lib = compile_c(source("step_op.cpp"), "pagedkv_step_op", flags, cc=cxx,
                    libs=[f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"])
    torch.ops.load_library(lib._name)  # registers pagedkv::step_layer_attention (same handle)
    torch.library.register_fake("pagedkv::step_layer_attention")(_fake)
    lib.pagedkv_step_set_kernel.argtypes = [ctypes.c_void_p]
    lib.pagedkv_step_set_kernel(ctypes.cast(kernel._write_attend, ctypes.c_void_p))
    return StepTable(lib)


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


_TABLE = BuiltOnce("PAGEDKV_STEP_OP", _build)


def get() -> StepTable | None:
    """The op's table (built on first call), or ``None`` when unavailable."""
    return _TABLE.get()


def build_error() -> str | None:
    """Why ``get()`` returned ``None`` (``None`` if it did not, or was not called yet)."""
    return _TABLE.error()


def layer_entries(kv_caches: Sequence, options: Sequence[tuple[float, int, float]], geometry) -> tuple:
    """``(LayerEntry array, groups)`` for ``kv_caches`` with per-layer ``(scale, window,
    cap)`` (already checked: window/cap 0 = off): ``groups`` maps each cache geometry
    (``geometry(cache)``) to its index."""
    groups: dict = {}
    arr = (LayerEntry * len(kv_caches))()
    for i, (cache, (scale, window, cap)) in enumerate(zip(kv_caches, options)):
        g = groups.setdefault(geometry(cache), len(groups))
        arr[i] = LayerEntry(cache.key.data_ptr(), cache.value.data_ptr(), scale, window, cap, g)
    return arr, groups
