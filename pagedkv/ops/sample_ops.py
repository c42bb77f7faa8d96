"""The sampler's picks in C (``pagedkv/csrc/sample_ops.c`` through ctypes): the greedy first maximum and
the inverse-CDF pick of :func:`pagedkv.engine.sampler._inverse_cdf_pick`, one row per thread
(OpenMP, the libgomp torch uses, from 4 rows on; one thread below).

At batch 1 the torch versions of these two cost more in op and thread-pool overhead than in
work: ``max(dim)`` over a 49,152-token row took 0.12 ms and the pick's dozen small ops 0.47 ms
with 2 threads (0.16 ms with 1), where the C loops take tens of microseconds
(docs/performance.md, "Sampling in C"). They return the torch code's tokens (the pick's fp64
sums add in another order, so a target within an fp64 rounding of a token boundary, about one
draw in 2^52, may land on the neighbour); the torch code stays the reference and the fallback: ``get()`` returns ``None`` when there is no C compiler,
the build fails, or ``PAGEDKV_FUSED=0`` (the switch of the other fused CPU ops too);
``build_error()`` says why.
"""

from __future__ import annotations

import ctypes

import torch

from pagedkv.ops.build import BuiltOnce, compile_c, source
from pagedkv.cpu_isa import march_flags

_ARGMAX_BLOCK = 1024  # tokens per block maximum of the greedy pick
# plain IEEE arithmetic (no reassociation beyond the explicit lanes of the C code)
_FLAGS = ["-O3", *march_flags(), "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


class SampleOps:
    """Callable wrappers of the compiled picks. Inputs are checked for what the C code
    assumes; a violation raises ``ValueError``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._argmax = lib.pagedkv_argmax_rows
        self._argmax.argtypes = [i64, i64, ptr, i64, i64, ptr]
        self._argmax.restype = None
        self._pick = lib.pagedkv_inverse_cdf_pick
        self._pick.argtypes = [i64, i64, ptr, i64, ptr, i64, ptr]
        self._pick.restype = ctypes.c_int

    @staticmethod
    def _rows(t: torch.Tensor, name: str) -> None:
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1 or t.shape[1] < 1:
            raise ValueError(f"{name}: need a CPU float32 [rows, vocab >= 1] tensor with unit column stride, "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")

    def argmax_rows(self, x: torch.Tensor) -> list[int]:
        """The first index of the largest value of each row of ``x`` float32 ``[R, V]``, as
        ``x.max(dim=-1).indices.tolist()`` (rows must hold no NaN: the sampler checks first; a
        NaN row gives some index in range)."""
        self._rows(x, "x")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), _ARGMAX_BLOCK, out.data_ptr())
        return out.tolist()

    def inverse_cdf_pick(self, probs: torch.Tensor, u: torch.Tensor, block: int) -> list[int]:
        """:func:`pagedkv.engine.sampler._inverse_cdf_pick` of ``probs`` float32 ``[R, V]``
        (non-negative, each row with a positive entry) for ``u`` float64 ``[R]`` in ``[0, 1)``,
        ``block`` (>= 1) tokens per block of the two-level search. Raises ``ValueError`` for
        inputs the C code does not take, ``MemoryError`` when its scratch (``R x V / block``
        doubles) cannot be allocated."""
        self._rows(probs, "probs")
        if (u.dtype != torch.float64 or u.device.type != "cpu" or u.shape != (probs.shape[0],)
                or not u.is_contiguous()):
            raise ValueError(f"u: need a contiguous CPU float64 [{probs.shape[0]}] tensor, got {u.dtype} "
                             f"{tuple(u.shape)} on {u.device}")
        if block < 1:
            raise ValueError(f"block must be >= 1 token, got {block}")
        out = torch.empty(probs.shape[0], dtype=torch.int64)
        if self._pick(probs.shape[0], probs.shape[1], probs.data_ptr(), probs.stride(0), u.data_ptr(), block,
                      out.data_ptr()) != 0:
            raise MemoryError("inverse_cdf_pick: no memory for the block sums")
        return out.tolist()


_OPS = BuiltOnce("PAGEDKV_FUSED", lambda: SampleOps(compile_c(source("sample_ops.c"), "pagedkv_sample_ops", _FLAGS)))


def get() -> SampleOps | None:
    """The ops (built on first call), or ``None`` when unavailable."""
    return _OPS.get()


def build_error() -> str | None:
    """Why ``get()`` returned ``None`` (``None`` if it did not, or was not called yet)."""
    return _OPS.error()
