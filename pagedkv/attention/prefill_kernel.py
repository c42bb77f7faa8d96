"""Load and call the CPU causal prefill-attention kernel (``pagedkv/csrc/prefill_attn.c``).

The CPU backend's prefill chunks (query rows beyond the decode kernel's few) gather their
sequence's K/V from the paged cache into a contiguous workspace and attend over it; this
kernel does that attention for float32 with score tiles computed as outer products against K
transposed once per call (the C file says how), in place of torch's
``scaled_dot_product_attention``. Measured in docs/performance.md ("Prefill attention").

Built like the other kernels (``pagedkv.csrc.compile_c``, cached under ``$PAGEDKV_CACHE_DIR``,
``-march`` from ``pagedkv.cpu_isa.march_flags()``). ``get()`` returns ``None`` (the backend
keeps SDPA) when there is no compiler, the build fails, or ``PAGEDKV_PREFILL_KERNEL=0``;
``build_error()`` says why.
"""

from __future__ import annotations

import ctypes

import torch

from pagedkv.cpu_isa import march_flags
from pagedkv.csrc import BuiltOnce, compile_c, source

_FLAGS = ["-O3", *march_flags(), "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


class PrefillKernel:
    """Callable wrapper of ``pagedkv_prefill_attention``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        self._f = lib.pagedkv_prefill_attention
        self._f.argtypes = [i32, i32, i32, i32, i32, ctypes.c_float, ptr, i64, i64, ptr, ptr, i64, i64,
                            ptr, i64, i64, i32]
        self._f.restype = ctypes.c_int
        #: the largest head dimension it takes
        self.max_head_dim: int = lib.pagedkv_prefill_max_head_dim()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
        """Causal attention of a chunk's ``q`` float32 ``[ql, hq, d]`` over ``k``/``v`` float32
        ``[n, hkv, d]`` (``n >= ql`` context tokens; query row ``j`` sits at position
        ``n - ql + j`` and sees keys ``0 .. n - ql + j``), GQA by ``hq / hkv``. Any strides
        with a unit last one (``k`` and ``v`` sharing theirs). Returns float32 ``[ql, hq, d]``,
        or ``None`` for shapes the kernel does not take (``d`` not a multiple of 8 or over
        ``max_head_dim``, ``hq`` not a multiple of ``hkv``), which the caller computes its
        other way. Raises ``MemoryError`` when the kernel's K buffer cannot be allocated."""
        ql, hq, d = q.shape
        n, hkv, _ = k.shape
        tensors = (q, k, v)
        if (any(t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1 for t in tensors)
                or k.stride() != v.stride() or v.shape != k.shape or k.shape[2] != d):
            return None
        out = torch.empty(ql, hq, d)
        rc = self._f(ql, n, hq, hkv, d, scale, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
                     k.stride(0), k.stride(1), out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("prefill attention: no memory for the transposed K buffer")
        return out if rc == 0 else None


_KERNEL = BuiltOnce("PAGEDKV_PREFILL_KERNEL",
                    lambda: PrefillKernel(compile_c(source("prefill_attn.c"), "pagedkv_prefill_attn", _FLAGS)))


def get() -> PrefillKernel | None:
    """The kernel (built on first call), or ``None`` when unavailable."""
    return _KERNEL.get()


def build_error() -> str | None:
    """Why ``get()`` returned ``None`` (``None`` if it did not, or was not called yet)."""
    return _KERNEL.error()
