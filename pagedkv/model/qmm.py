"""Quantised matmuls with integer dot products (``pagedkv/csrc/qmm.c`` through ctypes): int4 (Q4_1
blocks) or per-channel int8 weights times activations quantised on the fly to 8-bit blocks
of 32 (the way llama.cpp multiplies its Q4/Q8 weights).

On a CPU without VNNI or AMX, oneDNN's and ATen's int8 kernels either emulate bf16 (the
weight-only int4/int8 kernels take bf16 activations) or add u8 x s8 products in saturating
int16 pairs; these kernels choose code ranges for which that pairwise step is exact (4-bit
codes; int8 with the sign moved onto the activation), so they run at AVX2 speed with exact
integer block sums, and with VNNI (``vpdpbusd``) where the build targets it. Activations
keep one float scale per 32 values (an outlier costs its own block only) and, for int4's
minimum, the exact float sum of each block.

Used by ``pagedkv.model.quant`` (``QuantLinear.kernel`` ``"q8"``) for every row count on CPUs
without AMX (``max_rows``), and by ``pagedkv.model.native_step``. ``get()`` returns ``None``
when there is no C compiler, the build fails, or ``PAGEDKV_QMM=0``; ``build_error()`` says
why. Measured in docs/performance.md ("Integer matmuls").
"""

from __future__ import annotations

import ctypes

import torch

from pagedkv.csrc import BuiltOnce, compile_c, source
from pagedkv.cpu_isa import march_flags

_FLAGS = ["-O3", *march_flags(), "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
          "-fPIC", "-shared", "-std=c11"]
QK = 32  # values per activation / weight block
#: ``max_rows`` where the integer kernels take every input (no other kernel of the format is built)
ALL_ROWS = 1 << 62


def max_rows(amx: bool, int8_rows: int) -> int:
    """The first input row count the integer kernels no longer run on a CPU: every count
    (``ALL_ROWS``) unless it has AMX, whose oneDNN int8/bf16 tile kernels multiply decode
    batches from ``int8_rows`` rows (dynamic int8; ``KERNEL_ROWS + 1`` = 65, the wide bf16
    matmul, when that is off) and prefill chunks faster than vector code can; ``0`` when
    ``$PAGEDKV_QMM`` is ``0``."""
    import os

    if os.environ.get("PAGEDKV_QMM", "1") == "0":
        return 0
    if not amx:
        return ALL_ROWS
    return int8_rows if int8_rows > 0 else 65


class QWeights(ctypes.Structure):
    """``qweights_t`` of ``qmm.c``: one layer's packed weights, handed to the kernel by
    pointer (built once per layer: a call converts only the activation arguments)."""

    _fields_ = [("n", ctypes.c_int64), ("k", ctypes.c_int64), ("fmt", ctypes.c_int32), ("codes", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class Packed:
    """A layer's weights in the kernels' layout (8 output columns interleaved; ``qmm.c``
    describes it): ``fmt`` 4 (int4: ``codes`` uint8 ``[N / 8 * K / 32 * 160]``: per 8 columns x
    32 inputs their 4-bit codes, then their float16 ``d`` and ``m``, ``w = d c + m``) or 8 (int8: ``codes`` int8 ``[N * K]``, ``scale``
    float32 ``[N]``, ``w = scale[o] c``); ``bias`` float32 ``[N]`` or ``None``. Holds the
    tensors its ``QWeights`` points into. Build with :func:`pack_int4` / :func:`pack_int8`."""

    def __init__(self, fmt: int, n: int, k: int, codes: torch.Tensor, scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> None:
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
            raise ValueError(f"bias: need float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
        self.fmt, self.n, self.k = fmt, n, k
        self.codes, self.scale = codes, scale
        self.bias = None if bias is None else bias.contiguous()

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        self.struct = QWeights(n, k, fmt, codes.data_ptr(), ptr(scale), ptr(self.bias))
        self.ref = ctypes.byref(self.struct)


def _check_nk(n: int, k: int) -> None:
    if n % 8 or k % QK or n < 8 or k < QK:
        raise ValueError(f"weights [{n}, {k}]: need out features a multiple of 8 and in features a multiple of {QK}")


def pack_int4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None) -> Packed:
    """Unpacked codes ``[N, K]`` (values 0..15, any integer dtype) with ``d``, ``m``
    ``[N, K / 32]`` (stored as float16, exact for GGUF's Q4_1 and ``Int4Linear.from_float``)
    and an optional ``bias`` ``[N]`` -> :class:`Packed`. Raises ``ValueError`` unless
    N % 8 == 0 and K % 32 == 0 (the caller keeps its other kernels then)."""
    n, k = codes.shape
    _check_nk(n, k)
    c = codes.to(torch.uint8).reshape(n // 8, 8, k // QK, 4, 2, 4)  # g, i, b, t, lo/hi, e
    packed = (c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # g, b, t, i, e

    def cols(t: torch.Tensor) -> torch.Tensor:  # [N, K/32] -> fp16 bytes [g, b, 16]
        return t.to(torch.float16).reshape(n // 8, 8, k // QK).permute(0, 2, 1).contiguous().view(torch.uint8)

    blocks = torch.cat([packed.reshape(n // 8, k // QK, 128), cols(d), cols(m)], dim=2)  # [g, b, 160]
    return Packed(4, n, k, blocks.contiguous().reshape(-1), bias=bias)


def pack_int8(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Packed:
    """int8 codes ``[N, K]`` (-127..127) with per-row ``scale`` ``[N]`` -> :class:`Packed`.
    Raises ``ValueError`` for shapes the kernel does not take or a code of -128."""
    n, k = codes.shape
    _check_nk(n, k)
    if codes.dtype != torch.int8 or bool((codes == -128).any()):
        raise ValueError("int8 codes must be int8 in -127..127")
    c = codes.reshape(n // 8, 8, k // QK, 8, 4).permute(0, 2, 3, 1, 4)  # g, b, t, i, e
    return Packed(8, n, k, c.contiguous().reshape(-1), scale=scale.float().contiguous(), bias=bias)


class QmmOps:
    """Callable wrappers of the compiled kernels on :class:`Packed` weights."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._qmm = lib.pagedkv_qmm
        self._qmm.argtypes = [ptr, i64, ptr, i64, ptr, ctypes.c_int]
        self._qmm.restype = ctypes.c_int
        self._q4_deq = lib.pagedkv_q4_dequant
        self._q4_deq.argtypes = [i64, i64, ptr, ptr]
        self._q4_deq.restype = None
        self._q8_deq = lib.pagedkv_q8_dequant
        self._q8_deq.argtypes = [i64, i64, ptr, ptr, ptr]
        self._q8_deq.restype = None
        isa = lib.pagedkv_qmm_isa
        isa.restype = ctypes.c_char_p
        #: the integer dot product of this build: ``avx512-vnni``, ``avx-vnni``, ``avx2`` or ``scalar``
        self.isa: str = isa().decode()

    def linear(self, x: torch.Tensor, w: Packed) -> torch.Tensor:
        """``x`` float32 ``[R, K]`` (CPU, unit column stride) times the packed weights, plus
        their bias -> float32 ``[R, N]``: ``x``'s rows quantised to int8 blocks of 32, exact
        integer block sums. Raises ``ValueError`` for another ``x``, ``MemoryError`` when the
        quantised activations cannot be allocated."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.k or x.stride(1) != 1 or x.is_cuda:
            raise ValueError(f"x: need a CPU float32 [rows, {w.k}] tensor with unit column stride, got {x.dtype} "
                             f"{tuple(x.shape)} strides {x.stride()} on {x.device}")
        y = torch.empty(x.shape[0], w.n)
        if self._qmm(w.ref, x.shape[0], x.data_ptr(), x.stride(0), y.data_ptr(), torch.get_num_threads()):
            raise MemoryError("qmm: no memory for the quantised activations")
        return y

    def dequantize(self, w: Packed) -> torch.Tensor:
        """The packed weights as float32 ``[N, K]`` (one pass, OpenMP)."""
        out = torch.empty(w.n, w.k)
        if w.fmt == 4:
            self._q4_deq(w.k, w.n, w.codes.data_ptr(), out.data_ptr())
        else:
            self._q8_deq(w.k, w.n, w.codes.data_ptr(), w.scale.data_ptr(), out.data_ptr())
        return out


def build(march: str | None = None) -> QmmOps:
    """Compile (or load from the cache) and wrap the kernels; ``march``: a ``-march=`` target
    other than the default (tests build ``x86-64-v3``, the AVX2 code, and ``x86-64``, the
    plain C code, on any x86 host). Raises ``RuntimeError`` when the build fails."""
    flags = list(_FLAGS) if march is None else [f"-march={march}" if f.startswith("-march=") else f for f in _FLAGS]
    return QmmOps(compile_c(source("qmm.c"), "pagedkv_qmm", flags))


_OPS = BuiltOnce("PAGEDKV_QMM", build)


def get() -> QmmOps | None:
    """The kernels (built on first call), or ``None`` when unavailable."""
    return _OPS.get()


def build_error() -> str | None:
    """Why ``get()`` returned ``None`` (``None`` if it did not, or was not called yet)."""
    return _OPS.error()
