"""Fused element-wise ops of the decoder layer on the CPU (``pagedkv/csrc/fused_ops.c`` through ctypes).

A decode step at batch 1 spends more time between the matmuls than in them when every norm,
RoPE, activation and dtype conversion is its own torch call (docs/benchmarks/step.md). These
ops do each group in one pass, reading and writing float32 or bfloat16 (the dtype the
neighbouring quantised matmul takes or returns, so no conversion calls remain):

* ``add_rms_norm``: ``residual += delta`` (optional), then RMSNorm of the residual
* ``head_rms_norm``: per-head RMSNorm of q and k in the fused qkv rows (Qwen3), in place
* ``rope_split``: the fused qkv rows -> RoPE'd q and k, and v (float32, contiguous)
* ``act_mul``: ``act(gate) * up`` (SiLU or tanh-GELU) from the fused gate/up rows

They run for float32 models on the CPU (``pagedkv.model.llama`` decides per layer); the
torch path stays the reference and the fallback. ``get()`` returns ``None`` when there is no C
compiler, the build fails, or ``PAGEDKV_FUSED=0``; ``build_error()`` says why.
"""

from __future__ import annotations

import ctypes

import torch

from pagedkv.ops.build import BuiltOnce, compile_c, source
from pagedkv.cpu_isa import march_flags

# unlike the attention kernel's flags, no -ffp-contract=fast / -fassociative-math: the float32
# results should round as torch's element-wise ops do (the tests compare them to 2e-6)
_FLAGS = ["-O3", *march_flags(), "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared",
          "-std=c11"]
_DT = {torch.float32: 0, torch.bfloat16: 1}


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedOps:
    """Callable wrappers of the compiled ops. Inputs are checked for what the C code assumes
    (dtype, device, unit last stride); a violation raises ``ValueError``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._norm = lib.pagedkv_add_rms_norm
        self._norm.argtypes = [i64, i64, ptr, i64, ptr, i64, i32, ptr, f32, f32, ptr, i32]
        self._rope = lib.pagedkv_rope_split
        self._rope.argtypes = [i64, i32, i32, i32, ptr, i64, i32, ptr, ptr, ptr, ptr, ptr]
        self._act = lib.pagedkv_act_mul
        self._act.argtypes = [i64, i64, ptr, i64, i32, i32, ptr, i32]
        self._head_norm = lib.pagedkv_head_rms_norm
        self._head_norm.argtypes = [i64, i32, i32, ptr, i64, i32, ptr, f32, f32]
        for f in (self._norm, self._rope, self._act, self._head_norm):
            f.restype = None

    @staticmethod
    def _rows(t: torch.Tensor, name: str) -> None:
        if t.device.type != "cpu" or t.dtype not in _DT or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name}: need a CPU float32/bfloat16 [rows, cols] tensor with unit column stride, "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     offset: float = 0.0, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``residual`` float32 ``[T, H]`` (updated in place by ``+= delta`` when ``delta``
        ``[T, H]`` float32/bfloat16 is given); returns ``RMSNorm(residual) * (weight + offset)``
        as a new contiguous ``[T, H]`` tensor in ``out_dtype`` (float32 or bfloat16)."""
        self._rows(residual, "residual")
        if residual.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous():
            raise ValueError("add_rms_norm: residual and weight must be float32 (weight contiguous)")
        t, h = residual.shape
        if delta is not None:
            self._rows(delta, "delta")
            if tuple(delta.shape) != (t, h):
                raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} != residual {(t, h)}")
        out = torch.empty(t, h, dtype=out_dtype)
        self._norm(t, h, residual.data_ptr(), residual.stride(0), _ptr(delta), 0 if delta is None else delta.stride(0),
                   _DT[delta.dtype] if delta is not None else 0, weight.data_ptr(), eps, offset, out.data_ptr(),
                   _DT[out_dtype])
        return out

    def head_rms_norm(self, qkv: torch.Tensor, first_head: int, num_heads: int, head_dim: int, weight: torch.Tensor,
                      eps: float, offset: float = 0.0) -> None:
        """Per-head RMSNorm **in place** (Qwen3's q/k norms): heads ``first_head ..
        first_head + num_heads`` of ``qkv`` ``[T, heads * head_dim]`` float32/bfloat16 (unit
        column stride) become ``head / sqrt(mean(head^2) + eps) * (weight + offset)``, ``weight``
        float32 contiguous ``[head_dim]``. Raises ``ValueError`` for other shapes or dtypes."""
        self._rows(qkv, "qkv")
        if weight.dtype != torch.float32 or not weight.is_contiguous() or tuple(weight.shape) != (head_dim,):
            raise ValueError(f"head_rms_norm: weight must be float32 contiguous [{head_dim}], got "
                             f"{weight.dtype} {tuple(weight.shape)}")
        if first_head < 0 or num_heads < 0 or (first_head + num_heads) * head_dim > qkv.shape[1]:
            raise ValueError(f"head_rms_norm: heads {first_head}..{first_head + num_heads} of {head_dim} "
                             f"exceed qkv's {qkv.shape[1]} columns")
        ptr = qkv.data_ptr() + first_head * head_dim * qkv.element_size()
        self._head_norm(qkv.shape[0], num_heads, head_dim, ptr, qkv.stride(0), _DT[qkv.dtype], weight.data_ptr(), eps,
                        offset)

    def rope_split(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv`` ``[T, (num_heads + 2 num_kv_heads) * head_dim]`` float32/bfloat16, ``cos``/
        ``sin`` float32 contiguous ``[T, head_dim / 2]`` (any view of that size) ->
        ``q`` ``[T, num_heads, head_dim]``, ``k`` and ``v`` ``[T, num_kv_heads, head_dim]``,
        float32 contiguous, q and k rotated (rotate-half RoPE)."""
        self._rows(qkv, "qkv")
        t = qkv.shape[0]
        if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
            raise ValueError(f"rope_split: qkv {tuple(qkv.shape)} does not hold {num_heads}+2x{num_kv_heads} heads "
                             f"of {head_dim}")
        for name, x in (("cos", cos), ("sin", sin)):
            if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != t * head_dim // 2:
                raise ValueError(f"rope_split: {name} must be float32 contiguous with {t} x {head_dim // 2} values")
        q = torch.empty(t, num_heads, head_dim)
        k = torch.empty(t, num_kv_heads, head_dim)
        v = torch.empty(t, num_kv_heads, head_dim)
        self._rope(t, num_heads, num_kv_heads, head_dim, qkv.data_ptr(), qkv.stride(0), _DT[qkv.dtype],
                   cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr())
        return q, k, v

    def act_mul(self, gate_up: torch.Tensor, intermediate_size: int, gelu: bool = False,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``gate_up`` ``[T, 2 I]`` float32/bfloat16 (gate columns, then up) -> ``act(gate) *
        up`` ``[T, I]`` in ``out_dtype``; act = SiLU, or tanh-approximated GELU with ``gelu``."""
        self._rows(gate_up, "gate_up")
        t = gate_up.shape[0]
        if gate_up.shape[1] != 2 * intermediate_size:
            raise ValueError(f"act_mul: gate_up {tuple(gate_up.shape)} is not [T, 2 x {intermediate_size}]")
        out = torch.empty(t, intermediate_size, dtype=out_dtype)
        self._act(t, intermediate_size, gate_up.data_ptr(), gate_up.stride(0), _DT[gate_up.dtype], int(gelu),
                  out.data_ptr(), _DT[out_dtype])
        return out


_OPS = BuiltOnce("PAGEDKV_FUSED", lambda: FusedOps(compile_c(source("fused_ops.c"), "pagedkv_fused_ops", _FLAGS)))


def get() -> FusedOps | None:
    """The ops (built on first call), or ``None`` when unavailable."""
    return _OPS.get()


def build_error() -> str | None:
    """Why ``get()`` returned ``None`` (``None`` if it did not, or was not called yet)."""
    return _OPS.error()
