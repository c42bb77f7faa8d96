"""Load and call the CPU paged-attention kernel (``pagedkv/csrc/cpu_kernel.c``) through ctypes.

The C file has no Python or torch headers, so it compiles in about a second with the system C
compiler (``$CC``, else ``cc``/``gcc``/``clang``). The shared object is cached under
``$PAGEDKV_CACHE_DIR`` (default ``~/.cache/pagedkv``), keyed by the source, the flags and the
CPU's feature flags (it is built with ``pagedkv.cpu_isa.march_flags()``: ``-march=native``, or
``-march=x86-64-v3`` under ``PAGEDKV_CPU_ISA=avx2``). OpenMP comes from the same
``libgomp.so.1`` torch already loaded, so the kernel shares torch's thread pool runtime.

``get()`` returns ``None`` (and the CPU backend uses its torch path) when there is no compiler,
the build fails, or ``PAGEDKV_CPU_KERNEL=0``. ``build_error()`` says why.
"""

from __future__ import annotations

import ctypes
import os
from typing import Sequence

import torch

from pagedkv.cpu_isa import march_flags
from pagedkv.ops.build import BuiltOnce, compile_c, source

_FLAGS = ["-O3", *march_flags(), "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # query/output; plain caches likewise
# quantised caches: pagedkv.attention.quant.QuantFormat.kernel_id (2 int8, 3 fp8_e4m3, 4 fp8_e5m2)
# split_len (tokens) of the kernel: a row's keys are cut into segments at absolute multiples of it
# (parallel work for long contexts; the same cut whatever the batch, so results stay batch-invariant).
MIN_SPLIT_LEN = 512


def _build() -> ctypes.CDLL:
    lib = compile_c(source("cpu_kernel.c"), "pagedkv_cpu_kernel", _FLAGS)  # _FLAGS read now: a test swaps -march
    f = lib.pagedkv_paged_attention
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [i32, i32, i32, i32, i32, i32, ctypes.c_float,
                  ptr, i64, i64,
                  ptr, ptr, i64, i64, i64,
                  ptr, ptr, i64, i64, i64, i32,
                  ptr, i64,
                  ptr, ptr,
                  ptr, ptr, i32,
                  ptr, i64, i64,
                  i32, i32, i32, i32, ctypes.c_float, ptr]
    f.restype = ctypes.c_int
    g = lib.pagedkv_write_attend
    g.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, i32, ctypes.c_float]
    g.restype = ctypes.c_int
    g = lib.pagedkv_write_attend_sinks
    g.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, i32, ctypes.c_float, ptr]
    g.restype = ctypes.c_int
    return lib


class LayerArgs(ctypes.Structure):
    """``layer_args_t`` of ``cpu_kernel.c``: one step's per-layer-invariant inputs of
    ``pagedkv_write_attend`` (see :meth:`CPUKernel.layer_args`)."""

    _fields_ = [(n, ctypes.c_int32) for n in ("qdt", "kdt", "hq", "hkv", "d", "bs")] + [
        ("s_blk", ctypes.c_int64), ("s_tok", ctypes.c_int64), ("s_head", ctypes.c_int64),
        ("num_slots", ctypes.c_int64),
        ("bt", ctypes.c_void_p), ("bt_s0", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p), ("q_start", ctypes.c_void_p), ("seq_ids", ctypes.c_void_p),
        ("q_lens", ctypes.c_void_p), ("n_seqs", ctypes.c_int32),
        ("slots", ctypes.c_void_p), ("n_tokens", ctypes.c_int32), ("n_real", ctypes.c_int32),
        ("nthreads", ctypes.c_int32), ("min_split_len", ctypes.c_int32), ("prefetch", ctypes.c_int32)]

    def ref(self):
        """``ctypes.byref`` of these arguments: what :meth:`CPUKernel.write_attend` takes."""
        return ctypes.byref(self)


class LatentArgs(LayerArgs):
    """``latent_args_t`` of ``pagedkv/csrc/decoder.c``: :class:`LayerArgs`, then an int8 latent
    cache's bf16 scales' block and token strides (elements) and scales per latent (``kdt`` 2;
    zeros for a float32 cache)."""

    _fields_ = [("sc_blk", ctypes.c_int64), ("sc_tok", ctypes.c_int64), ("groups", ctypes.c_int32)]


class CPUKernel:
    """Callable wrapper of the compiled kernel."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._f = lib.pagedkv_paged_attention
        self._write_attend = lib.pagedkv_write_attend  # (step_op.cpp's entry: no sinks)
        self._write_attend_sinks = lib.pagedkv_write_attend_sinks  # with a sinks pointer (NULL: none)
        self.max_heads = lib.pagedkv_max_heads()
        self.max_head_dim = lib.pagedkv_max_head_dim()
        # software prefetch of the next chunk (on by default; PAGEDKV_CPU_PREFETCH=0 disables)
        self.prefetch = int(os.environ.get("PAGEDKV_CPU_PREFETCH", "1") != "0")
        self.min_split_len = MIN_SPLIT_LEN

    def supports(self, query: torch.Tensor, cache) -> bool:
        """Whether this call can run here (dtypes, head dim, GQA group, strides; a quantised
        cache needs a group size that is a multiple of 8). ``cache``: a
        ``pagedkv.attention.layouts.PagedKVCache`` (the caller checks that)."""
        if cache.quant is not None:
            cache_ok = cache.group_size % 8 == 0
        else:
            cache_ok = cache.dtype in _DTYPES
        return (
            query.dtype in _DTYPES and cache_ok
            and query.device.type == "cpu"
            and cache.head_dim <= self.max_head_dim and cache.head_dim % 8 == 0
            and query.shape[1] <= self.max_heads
            and query.stride(2) == 1
        )

    def run(self, query: torch.Tensor, cache, plan, scale: float, out: torch.Tensor,
            nthreads: int | None = None, window: int = 0, soft_cap: float = 0.0,
            sinks: torch.Tensor | None = None) -> None:
        """Attention of ``plan.kernel_seqs`` into ``out`` (``[num_tokens, Hq, d]``, last dim
        contiguous); ``plan.kernel_inputs`` is a ``KernelInputs``. ``window`` (tokens) and
        ``soft_cap``: 0 = off; ``sinks``: float32 ``[Hq]`` contiguous or ``None`` (see
        ``pagedkv.attention.base``). Raises ``RuntimeError`` for a kernel error code."""
        ki = plan.kernel_inputs
        s_blk, s_tok, s_head, _ = cache.key_nhd().stride()
        if cache.quant is not None:
            kdt, ss, grp = cache.quant.kernel_id, cache.scale_nhd("key").stride()[:3], cache.group_size
            ks, vs = cache.key_scale.data_ptr(), cache.value_scale.data_ptr()
        else:
            kdt, ss, grp, ks, vs = _DTYPES[cache.dtype], (0, 0, 0), 0, None, None
        rc = self._f(
            _DTYPES[query.dtype], kdt, query.shape[1], cache.num_kv_heads, cache.head_dim, cache.block_size,
            scale,
            query.data_ptr(), query.stride(0), query.stride(1),
            cache.key.data_ptr(), cache.value.data_ptr(), s_blk, s_tok, s_head,
            ks, vs, *ss, grp,
            ki.bt_ptr, ki.bt_s0, ki.seq_lens_ptr, ki.qsl_ptr, ki.ids_ptr, ki.qls_ptr, ki.n,
            out.data_ptr(), out.stride(0), out.stride(1),
            nthreads or torch.get_num_threads(), self.min_split_len, self.prefetch, int(window), float(soft_cap),
            None if sinks is None else sinks.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError(f"pagedkv CPU kernel failed with code {rc}")


    def layer_args(self, query: torch.Tensor, cache, plan, slots: torch.Tensor) -> LayerArgs | None:
        """The per-step inputs of :meth:`write_attend` for queries like ``query`` over caches
        like ``cache``, or ``None`` when the fused call does not apply (a quantised or
        float16 cache, unsupported shapes, a chunk for the torch path). ``slots``: int64
        ``[num_tokens]``, contiguous; kept alive by the caller with ``plan``."""
        if (cache.quant is not None or cache.dtype not in _DTYPES or plan.torch_seqs
                or not self.supports(query, cache)):
            return None
        ki = plan.kernel_inputs if plan.kernel_seqs else None
        s_blk, s_tok, s_head, _ = cache.key_nhd().stride()
        a = LayerArgs()
        a.qdt, a.kdt, a.hq, a.hkv, a.d, a.bs = (_DTYPES[query.dtype], _DTYPES[cache.dtype], query.shape[1],
                                                cache.num_kv_heads, cache.head_dim, cache.block_size)
        a.s_blk, a.s_tok, a.s_head, a.num_slots = s_blk, s_tok, s_head, cache.num_blocks * cache.block_size
        if ki is not None:
            a.bt, a.bt_s0, a.seq_lens, a.q_start = ki.bt_ptr, ki.bt_s0, ki.seq_lens_ptr, ki.qsl_ptr
            a.seq_ids, a.q_lens, a.n_seqs = ki.ids_ptr, ki.qls_ptr, ki.n
        a.slots, a.n_tokens, a.n_real = slots.data_ptr(), slots.numel(), plan.num_real
        a.nthreads, a.min_split_len, a.prefetch = torch.get_num_threads(), self.min_split_len, self.prefetch
        a._keep = (ki, slots)  # the tensors its pointers point into live as long as it does
        return a

    def latent_args(self, cache, plan, slots: torch.Tensor) -> LatentArgs:
        """:meth:`layer_args` for a latent (MLA) cache, read by ``pagedkv/csrc/decoder.c`` rather
        than by this kernel: one head of ``cache.head_dim`` float32 values (no head-size limit), or
        of int8 codes with ``cache.num_groups`` bf16 scales per token (``kdt`` 2)."""
        ki = plan.kernel_inputs
        s_blk, s_tok, s_head, _ = cache.key_nhd().stride()
        a = LatentArgs()
        kdt = _DTYPES[cache.dtype] if cache.quant is None else cache.quant.kernel_id
        a.qdt, a.kdt, a.hq, a.hkv, a.d, a.bs = 0, kdt, 1, 1, cache.head_dim, cache.block_size
        if cache.quant is not None:
            a.sc_blk, a.sc_tok = cache.scale_nhd("key").stride()[:2]
            a.groups = cache.num_groups
        a.s_blk, a.s_tok, a.s_head, a.num_slots = s_blk, s_tok, s_head, cache.num_blocks * cache.block_size
        a.bt, a.bt_s0, a.seq_lens, a.q_start = ki.bt_ptr, ki.bt_s0, ki.seq_lens_ptr, ki.qsl_ptr
        a.seq_ids, a.q_lens, a.n_seqs = ki.ids_ptr, ki.qls_ptr, ki.n
        a.slots, a.n_tokens, a.n_real = slots.data_ptr(), slots.numel(), plan.num_real
        a.nthreads, a.min_split_len, a.prefetch = torch.get_num_threads(), self.min_split_len, self.prefetch
        a._keep = (ki, slots)
        return a

    def write_attend(self, args_ref, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cache, out: torch.Tensor, scale: float, window: int, soft_cap: float,
                     sinks: torch.Tensor | None = None) -> int:
        """One layer through ``pagedkv_write_attend_sinks``: ``key``/``value`` ``[T, Hkv, d]``
        written at the step's slots, then ``query`` ``[T, Hq, d]`` attends into ``out``; all
        contiguous in the query dtype; ``sinks`` float32 ``[Hq]`` contiguous or ``None``.
        ``args_ref``: ``ctypes.byref`` of :meth:`layer_args`. Returns the C code (0 ok, -4 a
        slot out of range, nothing written)."""
        return self._write_attend_sinks(args_ref, query.data_ptr(), key.data_ptr(), value.data_ptr(),
                                        cache.key.data_ptr(), cache.value.data_ptr(), out.data_ptr(),
                                        scale, window, soft_cap, None if sinks is None else sinks.data_ptr())


class KernelInputs:
    """The kernel's per-step int32 inputs (block tables, lengths, starts, which sequences),
    converted once per step and kept alive here while their pointers are used."""

    def __init__(self, md, seq_ids: Sequence[int], q_lens: Sequence[int]) -> None:
        bt = md.block_tables
        if bt.dtype != torch.int32 or bt.stride(-1) != 1:
            bt = bt.to(torch.int32).contiguous()
        self.bt = bt
        self.seq_lens = md.seq_lens.to(torch.int32).contiguous()
        self.qsl = md.query_start_loc.to(torch.int32).contiguous()
        self.ids = torch.tensor(list(seq_ids), dtype=torch.int32)
        self.qls = torch.tensor(list(q_lens), dtype=torch.int32)
        self.bt_ptr, self.bt_s0 = bt.data_ptr(), bt.stride(0)
        self.seq_lens_ptr, self.qsl_ptr = self.seq_lens.data_ptr(), self.qsl.data_ptr()
        self.ids_ptr, self.qls_ptr, self.n = self.ids.data_ptr(), self.qls.data_ptr(), len(seq_ids)


_KERNEL = BuiltOnce("PAGEDKV_CPU_KERNEL", lambda: CPUKernel(_build()))


def get() -> CPUKernel | None:
    """The kernel (built on first call), or ``None`` when unavailable."""
    return _KERNEL.get()


def build_error() -> str | None:
    """Why ``get()`` returned ``None`` (``None`` if it did not, or was not called yet)."""
    return _KERNEL.error()
