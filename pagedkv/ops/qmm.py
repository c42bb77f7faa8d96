"""Quantised matmuls with integer dot products (``pagedkv/csrc/qmm.c`` through ctypes): int4 (Q4_1
blocks) or per-channel int8 weights, or GGUF's Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 blocks as stored
(:func:`pack_gguf`), times activations quantised on the fly to 8-bit blocks of 32 (the way
llama.cpp multiplies its Q4/Q8 weights).

On a CPU without VNNI or AMX, oneDNN's and ATen's int8 kernels either emulate bf16 (the
weight-only int4/int8 kernels take bf16 activations) or add u8 x s8 products in saturating
int16 pairs; these kernels choose code ranges for which that pairwise step is exact (4-bit
codes; int8 with the sign moved onto the activation), so they run at AVX2 speed with exact
integer block sums, and with VNNI (``vpdpbusd``) where the build targets it. Activations
keep one float scale per 32 values (an outlier costs its own block only) and, for int4's
minimum, the exact float sum of each block.

GGUF weights (:func:`pack_gguf`, at model load, per tensor) are not dequantised: their stored
blocks are only reordered, 8 output columns interleaved, so the packed bytes are the file's
and a batch-1 step reads each of them once. The kernels decode the K-quants' 6-bit (Q4_K,
Q5_K) or int8 (Q6_K) sub-block scales from those bytes; a sub-block's minimum multiplies the
activation block's float sum; the signed codes of Q8_0 and Q6_K take the sign trick (AVX2) or,
for Q6_K with VNNI, an offset by the activation codes' sums of 16; MXFP4's 4-bit codes become
their values (``kvalues_mxfp4``, plus 16: unsigned, the offset taken off by those sums) by a
table lookup, times the block's e8m0 power of two. Q4_1 goes to the int4 layout (the same
bytes). A fused layer whose parts a file stores in different types is a :func:`concat_packed`:
one call, activations quantised once.

Used by ``pagedkv.model.quant`` (``QuantLinear.kernel`` ``"q8"``) for every row count on CPUs
without AMX (``max_rows``), and by ``pagedkv.model.native_step``. ``get()`` returns ``None``
when there is no C compiler, the build fails, or ``PAGEDKV_QMM=0``; ``build_error()`` says
why. Measured in docs/performance.md ("Weight formats and routes", "Integer matmuls on batches").
"""

from __future__ import annotations

import ctypes
from typing import Callable, Sequence

import numpy as np
import torch

from pagedkv.ops import hugepages
from pagedkv.ops.build import BuiltOnce, compile_c, source
from pagedkv.cpu_isa import march_flags

_FLAGS = ["-O3", *march_flags(), "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
          "-fPIC", "-shared", "-std=c11"]
QK = 32  # values per activation / weight block
#: bytes of one int4 block of 8 columns x 32 values: 128 of codes, then 8 fp16 d and 8 fp16 m (csrc/qmm.c)
Q4_BLOCK = 160
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
                ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("parts", ctypes.c_void_p),
                ("nparts", ctypes.c_int64)]


#: ``Packed.fmt`` of a concatenation of other packed weights (:func:`concat_packed`)
FMT_CONCAT = 1
#: the GGML types :func:`pack_gguf` takes: name -> (GGML type id, values per block, bytes per block)
GGUF_BLOCKS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "MXFP4": (39, 32, 17),
    "F16": (1, 32, 64),  # IEEE half values, kept row-major (fmt FMT_F16); "blocks" of 32 for the kernel's loops
}
#: the GGML type names :func:`pack_gguf` takes
GGUF_TYPES: tuple[str, ...] = tuple(GGUF_BLOCKS)


class Packed:
    """A layer's weights in the kernels' layout (8 output columns interleaved; ``qmm.c`` describes
    it): ``fmt`` 4 (int4: ``codes`` uint8 ``[N / 8 * K / 32 * 160]``: per 8 columns x 32 inputs
    their 4-bit codes, then their float16 ``d`` and ``m``, ``w = d c + m``) or 8 (int8: ``codes``
    int8 ``[N * K]``, ``scale`` float32 ``[N]``, ``w = scale[o] c``); 102 / 106 / 107 / 108 / 112 /
    113 / 114 / 139 (GGUF Q4_0 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 blocks as stored,
    their bytes reordered per 8 columns: ``codes`` uint8 of the file's size for the tensor, ``N / 8
    * K / 32 * 144 / 176 / 192 / 272 / 136`` or ``N / 8 * K / 256 * 1152 / 1408 / 1680``); 101 (GGUF
    F16: ``codes`` uint8 ``[N * K * 2]``, the half values row-major as stored); 130 (bf16,
    :func:`pack_bf16`); or ``FMT_CONCAT`` (1: ``parts``, other :class:`Packed` of the same ``K``
    side by side, ``N`` their sum; ``codes`` ``None``). ``bias`` float32 ``[N]`` or ``None`` (a
    concat's, when set, is added to all its columns in place of the parts' own). Holds the tensors
    (and parts) its ``QWeights`` points into. Build with :func:`pack_int4` / :func:`pack_int8` /
    :func:`pack_gguf` / :func:`concat_packed`."""

    def __init__(self, fmt: int, n: int, k: int, codes: torch.Tensor | None, scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, parts: Sequence["Packed"] = ()) -> None:
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
            raise ValueError(f"bias: need float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
        self.fmt, self.n, self.k = fmt, n, k
        self.codes, self.scale = codes, scale
        self.bias = None if bias is None else bias.contiguous()
        self.parts = tuple(parts)

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        # a concat's C array of its parts' struct pointers, kept alive with it
        self._part_ptrs = (ctypes.c_void_p * len(self.parts))(*(ctypes.addressof(p.struct) for p in self.parts))
        self.struct = QWeights(n, k, fmt, ptr(codes), ptr(scale), ptr(self.bias),
                               ctypes.addressof(self._part_ptrs) if self.parts else None, len(self.parts))
        self.ref = ctypes.byref(self.struct)

    @property
    def nbytes(self) -> int:
        """Bytes this holds: its codes, scales and bias, and its parts' (a concat's)."""
        own = sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.bias) if t is not None)
        return own + sum(p.nbytes for p in self.parts)


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

    out = hugepages.empty(n // 8 * (k // QK) * Q4_BLOCK)  # where the kernels stream it (2 MiB pages)
    torch.cat([packed.reshape(n // 8, k // QK, 128), cols(d), cols(m)], dim=2,
              out=out.view(n // 8, k // QK, Q4_BLOCK))  # [g, b, 160]
    return Packed(4, n, k, out, bias=bias)


def pack_int8(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Packed:
    """int8 codes ``[N, K]`` (-127..127) with per-row ``scale`` ``[N]`` -> :class:`Packed`.
    Raises ``ValueError`` for shapes the kernel does not take or a code of -128."""
    n, k = codes.shape
    _check_nk(n, k)
    if codes.dtype != torch.int8 or bool((codes == -128).any()):
        raise ValueError("int8 codes must be int8 in -127..127")
    c = codes.reshape(n // 8, 8, k // QK, 8, 4).permute(0, 2, 3, 1, 4)  # g, b, t, i, e
    out = hugepages.empty(n * k).view(torch.int8)  # where the kernels stream it (2 MiB pages)
    out.view(n // 8, k // QK, 8, 8, 4).copy_(c)
    return Packed(8, n, k, out, scale=scale.float().contiguous(), bias=bias)


#: ``Packed.fmt`` of bf16 weights (100 + GGML's BF16 type id): the layer's own row-major tensor
FMT_BF16 = 130
#: ``Packed.fmt`` of a GGUF's F16 weights (100 + GGML's F16 type id): its rows as stored, row-major
#: ``[N, K]`` half values, times float32 activations as given (``qmm.c``, "f16 weights")
FMT_F16 = 101
#: bf16 layers run the bf16 kernel below this many rows (decode batches; wider inputs, prefill
#: chunks, a plain bf16 oneDNN matmul). Measured on a Zen 4 (AVX512-BF16), 2 threads, weights
#: streamed from memory: 1.1-1.8x a plain ``F.linear`` up to 32 rows, 0.94-0.98x at 64, 0.7-0.8x at 512
BF16_ROWS = 64


def pack_bf16(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Packed:
    """bf16 weights ``[N, K]`` -> :class:`Packed` (``fmt`` :data:`FMT_BF16`) over ``weight``'s own
    memory, no copy (the layer's tensor: keep it unchanged while the result is used). The
    kernel rounds the activations to bf16 and adds the exact products in float32 in
    vdpbf16ps's order (``qmm.c``, "bf16 weights"), the same sums on AVX512-BF16, AVX-512,
    AVX2 and plain C builds (denormals aside: vdpbf16ps flushes them). Raises ``ValueError`` for another dtype or device, a
    non-contiguous tensor, or unless N % 8 == 0 and K % 32 == 0."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack_bf16: need a CPU bfloat16 [N, K] tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if not weight.is_contiguous():
        raise ValueError("pack_bf16: need a contiguous (row-major) tensor")
    n, k = weight.shape
    _check_nk(n, k)
    return Packed(FMT_BF16, n, k, weight, bias=bias)


def unpack_int8(w: Packed) -> torch.Tensor:
    """The int8 codes ``[N, K]`` a :func:`pack_int8` result holds (its inverse, a copy).
    Raises ``ValueError`` for another format."""
    if w.fmt != 8:
        raise ValueError(f"unpack_int8: format {w.fmt} is not int8")
    return w.codes.reshape(w.n // 8, w.k // QK, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(w.n, w.k)


def unpack_int4(w: Packed) -> torch.Tensor:
    """The codes ``[N, K]`` uint8 (0..15) a :func:`pack_int4` result holds (its inverse, a
    copy; ``d`` and ``m`` stay with the caller). Raises ``ValueError`` for another format."""
    if w.fmt != 4:
        raise ValueError(f"unpack_int4: format {w.fmt} is not int4")
    n, k = w.n, w.k
    c = w.codes.reshape(n // 8, k // QK, 160)[:, :, :128].reshape(n // 8, k // QK, 4, 8, 4).permute(0, 3, 1, 2, 4)
    return torch.stack([c & 15, c >> 4], dim=4).reshape(n, k)  # g, i, b, t, lo/hi, e


def _gguf_block(qtype: str) -> tuple[int, int, int]:
    try:
        return GGUF_BLOCKS[qtype]
    except KeyError:
        raise ValueError(f"GGML type {qtype!r}: the kernels take {', '.join(GGUF_TYPES)}") from None


def _raw_args(qtype: str, raw: np.ndarray | torch.Tensor, k: int) -> tuple[int, int, int]:
    """:func:`pack_gguf`'s checks: ``(N, address of raw, bytes between rows)``, or ``ValueError``."""
    ggml_id, per, bs = _gguf_block(qtype)
    if isinstance(raw, torch.Tensor):
        if raw.dtype != torch.uint8 or raw.device.type != "cpu":
            raise ValueError(f"raw: need a CPU uint8 tensor, got {raw.dtype} on {raw.device}")
        shape, strides, addr = tuple(raw.shape), tuple(raw.stride()), raw.data_ptr()
    elif isinstance(raw, np.ndarray):
        if raw.dtype != np.uint8:
            raise ValueError(f"raw: need a uint8 array, got {raw.dtype}")
        shape, strides, addr = raw.shape, raw.strides, raw.__array_interface__["data"][0]
    else:
        raise ValueError(f"raw: need a uint8 numpy array or torch tensor, got {type(raw).__name__}")
    if k <= 0 or k % per:
        raise ValueError(f"{qtype} weights: need in features (k = {k}) a positive multiple of {per}")
    if len(shape) != 2 or shape[1] != k // per * bs:
        raise ValueError(f"raw: need [N, {k // per * bs}] ({k // per} {qtype} blocks of {bs} bytes per row), "
                         f"got {tuple(shape)}")
    n = shape[0]
    if n < 8 or n % 8:
        raise ValueError(f"{qtype} weights [{n}, {k}]: need out features a multiple of 8")
    if strides[1] != 1:
        raise ValueError("raw: need each row's bytes contiguous (unit column stride)")
    return n, addr, strides[0]


def pack_gguf(qtype: str, raw: np.ndarray | torch.Tensor, k: int, bias: torch.Tensor | None = None) -> Packed:
    """One GGUF tensor's stored blocks -> :class:`Packed`, without dequantising: ``qtype`` a name of
    ``GGUF_TYPES``; ``raw`` uint8 ``[N, K / block * block_bytes]`` (a numpy array, e.g. the reader's
    memory map, or a CPU tensor; each row's bytes contiguous, rows at any stride), row ``o`` the
    blocks of output feature ``o`` as in the file; ``k`` the values per row (K); ``bias`` float32
    ``[N]`` or ``None``. Every type keeps its bytes (``codes`` uint8 of exactly ``raw``'s size):
    Q4_1 in the int4 layout (``fmt`` 4), Q4_0 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 as
    ``fmt`` 100 + the GGML type id, F16 (``fmt`` :data:`FMT_F16`) row-major as stored. One pass in C
    (OpenMP over groups of 8 rows: the calling thread's OpenMP count, torch's in the thread that set
    it) into one new uint8 tensor; no float copy of the weights. Raises ``ValueError`` for another
    type, ``N`` not a positive multiple of 8, ``K`` not a positive multiple of the type's block (32;
    256 for the K-quants), a ``raw`` of another dtype, shape or layout, or a ``bias`` of another
    dtype or shape; ``RuntimeError`` when the kernels cannot be built (:func:`build_error` says
    why)."""
    ops = get()
    if ops is None:
        _raw_args(qtype, raw, k)  # bad arguments are still ValueErrors
        raise RuntimeError(f"qmm kernels unavailable: {build_error()}")
    return ops.pack_gguf(qtype, raw, k, bias)


def pack_gguf_rows(qtype: str, n: int, k: int, read: Callable[[int, int], np.ndarray],
                   bias: torch.Tensor | None = None, chunk_rows: int = 4096) -> Packed:
    """:func:`pack_gguf` of an ``[N, row bytes]`` tensor handed over ``chunk_rows`` rows at a
    time (a multiple of 8): ``read(r0, r1)`` returns rows ``r0 .. r1 - 1`` as stored (uint8
    ``[r1 - r0, row bytes]``), each packed into its place of one output, so the stored bytes
    are in memory one chunk at a time beside the packed ones (a 431 MB LM head: 2 x 14 MB
    chunks, not a second 431 MB). Raises as :func:`pack_gguf`."""
    ops = get()
    if ops is None:
        raise RuntimeError(f"qmm kernels unavailable: {build_error()}")
    ggml_id, per, bs = _gguf_block(qtype)
    if chunk_rows <= 0 or chunk_rows % 8:
        raise ValueError(f"chunk_rows: need a positive multiple of 8, got {chunk_rows}")
    if n < 8 or n % 8:
        raise ValueError(f"{qtype} weights [{n}, {k}]: need out features a multiple of 8")
    if k <= 0 or k % per:
        raise ValueError(f"{qtype} weights: need in features (k = {k}) a positive multiple of {per}")
    row = k // per * bs
    out = hugepages.empty(n * row)
    for r0 in range(0, n, chunk_rows):
        r1 = min(n, r0 + chunk_rows)
        ops.pack_gguf(qtype, read(r0, r1), k, out=out[r0 * row:r1 * row])
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
        raise ValueError(f"bias: need float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
    return Packed(4 if qtype == "Q4_1" else 100 + ggml_id, n, k, out, bias=bias)


#: formats whose packed codes (and int8 scales) hold each group of 8 rows contiguously, in row order
_ROW_GROUPED = frozenset({4, 8} | {100 + ggml_id for ggml_id, _, _ in GGUF_BLOCKS.values()})  # int4, int8, GGUF


def row_blocks(packed: Packed, rows: int) -> list[Packed]:
    """``packed`` ``[N, K]`` cut into ``N / rows`` :class:`Packed` of ``rows`` rows each, views of
    its memory (no copy; each keeps ``packed``'s tensors alive): block ``i`` holds rows ``i rows ..
    (i + 1) rows - 1`` (a multi-head matrix stored head after head, one block per head). Raises
    ``ValueError`` for ``rows`` not a positive multiple of 8 dividing ``N``, a bias, or a format
    whose codes are not grouped by rows (bf16, a concatenation)."""
    n = packed.n
    if rows <= 0 or rows % 8 or n % rows or packed.bias is not None or packed.fmt not in _ROW_GROUPED \
            or packed.codes is None:
        raise ValueError(f"row_blocks: cannot cut {n} rows of format {packed.fmt} into blocks of {rows}")
    per = packed.codes.numel() // n  # code elements per row
    codes = packed.codes.reshape(-1)
    out = []
    for i in range(n // rows):
        scale = None if packed.scale is None else packed.scale[i * rows:(i + 1) * rows]
        out.append(Packed(packed.fmt, rows, packed.k, codes[i * rows * per:(i + 1) * rows * per], scale))
        out[-1].owner = packed
    return out


def concat_packed(parts: Sequence[Packed]) -> Packed:
    """Packed weights side by side: ``y[:, off_i : off_i + N_i]`` = part ``i``'s output, one
    call quantising the activations once (e.g. a fused q/k/v whose parts a GGUF stores in
    different types). ``parts``: :class:`Packed` of any format but concat, all with the same
    ``K``. The result's ``N`` is the sum; its bias the parts' biases concatenated (zeros for
    a part without one), ``None`` when none has one. Keeps the parts alive (``.parts``).
    Raises ``ValueError`` for no parts, a concat part or different ``K``."""
    parts = list(parts)
    if not parts:
        raise ValueError("concat_packed: need at least one part")
    k = parts[0].k
    for p in parts:
        if p.fmt == FMT_CONCAT:
            raise ValueError("concat_packed: a part is itself a concatenation (pass its parts)")
        if p.k != k:
            raise ValueError(f"concat_packed: parts of in features {k} and {p.k}")
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.n) for p in parts])
    return Packed(FMT_CONCAT, sum(p.n for p in parts), k, None, bias=bias, parts=parts)


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
        self._pack = lib.pagedkv_pack_gguf
        self._pack.argtypes = [ctypes.c_int, i64, i64, ptr, i64, ptr]
        self._pack.restype = ctypes.c_int
        self._gguf_deq = lib.pagedkv_gguf_dequant
        self._gguf_deq.argtypes = [ctypes.c_int, i64, i64, ptr, ptr]
        self._gguf_deq.restype = ctypes.c_int
        isa = lib.pagedkv_qmm_isa
        isa.restype = ctypes.c_char_p
        #: the integer dot product of this build: ``avx512-vnni``, ``avx-vnni``, ``avx2`` or ``scalar``
        self.isa: str = isa().decode()

    def linear(self, x: torch.Tensor, w: Packed) -> torch.Tensor:
        """``x`` float32 ``[R, K]`` (CPU, unit column stride) times the packed weights, plus
        their bias -> float32 ``[R, N]``: ``x``'s rows quantised to int8 blocks of 32, exact
        integer block sums. Raises ``ValueError`` for another ``x`` (or weights of an unknown
        format), ``MemoryError`` when the quantised activations cannot be allocated."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.k or x.stride(1) != 1 or x.is_cuda:
            raise ValueError(f"x: need a CPU float32 [rows, {w.k}] tensor with unit column stride, got {x.dtype} "
                             f"{tuple(x.shape)} strides {x.stride()} on {x.device}")
        y = torch.empty(x.shape[0], w.n)
        rc = self._qmm(w.ref, x.shape[0], x.data_ptr(), x.stride(0), y.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"qmm: weights of format {w.fmt} this build does not take")
        if rc:
            raise MemoryError("qmm: no memory for the quantised activations")
        return y

    def dequantize(self, w: Packed) -> torch.Tensor:
        """The packed weights as float32 ``[N, K]`` (one pass, OpenMP; a concat's parts stacked
        by rows): for the GGUF formats GGUF's own float formulas, equal to gguf-py's
        ``dequantize`` of the stored blocks."""
        if w.fmt == FMT_CONCAT:
            return torch.cat([self.dequantize(p) for p in w.parts])
        if w.fmt == FMT_BF16:
            return w.codes.float()
        out = torch.empty(w.n, w.k)
        if w.fmt == 4:
            self._q4_deq(w.k, w.n, w.codes.data_ptr(), out.data_ptr())
        elif w.fmt == 8:
            self._q8_deq(w.k, w.n, w.codes.data_ptr(), w.scale.data_ptr(), out.data_ptr())
        elif self._gguf_deq(w.fmt, w.n, w.k, w.codes.data_ptr(), out.data_ptr()):
            raise ValueError(f"dequantize: unknown format {w.fmt}")
        return out

    def pack_gguf(self, qtype: str, raw: np.ndarray | torch.Tensor, k: int,
                  bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> Packed:
        """:func:`pack_gguf` with this build's packer (the layouts do not depend on the build);
        ``out``: the uint8 tensor to pack into (exactly ``raw``'s bytes, contiguous), else new."""
        n, addr, row_stride = _raw_args(qtype, raw, k)
        ggml_id, per, bs = _gguf_block(qtype)
        q4 = qtype == "Q4_1"  # the int4 layout (fmt 4): its bytes are Q4_1's
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
            raise ValueError(f"bias: need float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
        size = n * (k // per * bs)
        if out is None:
            out = hugepages.empty(size)
        elif out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"out: need a contiguous CPU uint8 tensor of {size} bytes")
        rc = self._pack(ggml_id, n, k, addr, row_stride, out.data_ptr())
        if rc:
            raise ValueError(f"{qtype} [{n}, {k}]: the packer refused it (code {rc})")
        return Packed(4 if q4 else 100 + ggml_id, n, k, out, bias=bias)


def build(march: str | None = None, defines: Sequence[str] = ()) -> QmmOps:
    """Compile (or load from the cache) and wrap the kernels; ``march``: a ``-march=`` target
    other than the default (tests build ``x86-64-v3``, the AVX2 code, and ``x86-64``, the
    plain C code, on any x86 host); ``defines``: ``-D`` macros (tests: ``QMM_TILE_YMM``, the
    8-column tiles of AVX-VNNI CPUs on an AVX-512 host). Raises ``RuntimeError`` when the
    build fails."""
    flags = list(_FLAGS) if march is None else [f"-march={march}" if f.startswith("-march=") else f for f in _FLAGS]
    return QmmOps(compile_c(source("qmm.c"), "pagedkv_qmm", flags + [f"-D{d}" for d in defines]))


_OPS = BuiltOnce("PAGEDKV_QMM", build)


def get() -> QmmOps | None:
    """The kernels (built on first call), or ``None`` when unavailable."""
    return _OPS.get()


def build_error() -> str | None:
    """Why ``get()`` returned ``None`` (``None`` if it did not, or was not called yet)."""
    return _OPS.error()


def layout_tag() -> str:
    """12 hex digits of the sha256 of ``csrc/qmm.c``, whose packers (``pack_gguf``) define the
    packed layout: a key under which packed weights stored on disk stay valid
    (``pagedkv.model.packed_cache``)."""
    import hashlib

    return hashlib.sha256(source("qmm.c").read_bytes()).hexdigest()[:12]
