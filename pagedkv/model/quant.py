"""Weight formats of the linear layers (``weights=``): fp32 | bf16 | int8 | int4, and the CPU
kernel ("route") each one runs on this machine.

A format changes only how the linear layers (q/k/v, o, gate/up, down and the LM head) store
their weights and multiply; embeddings, norms, RoPE, attention and the KV cache keep the model
dtype. Every module has ``nn.Linear``'s forward: ``x [T, in]`` -> ``[T, out]``, in ``x``'s dtype.

* ``fp32``: ``nn.Linear`` as loaded (exact; the transformers comparisons run on it).
* ``bf16``: bfloat16 weights: ``qmm``'s bf16 kernel below ``BF16_QMM_ROWS`` rows, oneDNN's bf16
  matmul above (``pagedkv.ops.onednn_bf16``; fp32 where bf16 is emulated), output cast back.
* ``int8``: symmetric per-output-channel int8 weights (scale = max|w| / 127 per row).
* ``int4``: 4-bit codes in groups of 32 along the input, ``w = scale * q + min`` (q in 0..15):
  exactly GGUF's Q4_1 block (Q4_0: ``min = -8 * scale``), so a Q4 source keeps its stored codes.
  A tied LM head whose source is 8-bit (the bundled Q8_0 embeddings) is int8 in this format.

Routes: ``fast`` runs ``pagedkv.ops.qmm`` (kernel ``"q8"``) for int8/int4 at every row count
on CPUs without AMX (int8 activation blocks of 32, exact integer block sums, weights packed
once; docs/weights.md; the stored codes then freed, ``QuantLinear._drop_codes``). On AMX hosts
``qmm`` takes inputs below ``int8_rows()`` rows; from there *dynamic int8* (each row of ``x``
as two int8 rows, ``dynamic_int8_mm``: oneDNN's u8s8 linear on prepacked weights, exact with
VNNI or AMX-INT8, ``CpuFeatures.int8_exact``), else ATen's weight-only kernels on bf16
activations (``torch._weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``) up to
``KERNEL_ROWS`` and ``wide`` above (dequantise, one bf16 (AMX) or fp32 matmul); those also run
where ``qmm`` cannot build or ``PAGEDKV_QMM=0``. ``fallback`` dequantises to the activation
dtype and calls ``F.linear``: correct on any CPU, slow (``PAGEDKV_WEIGHT_ROUTE=fallback``
forces it; ``pagedkv bench quality --part routes`` measures the routes).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.model import invariant
from pagedkv.ops import onednn_bf16, qmm
from pagedkv.ops.qmm import BF16_ROWS as BF16_QMM_ROWS  # bf16 layers: qmm below it, a plain matmul from it
from pagedkv.ops.int8_mm import dynamic_int8_mm, onednn_int8, register_int8
from pagedkv.model.weight_choice import (  # noqa: F401 - part of this module's interface
    INT8_ROWS, INT8_ROWS_ENV, KERNEL_ROWS, ROUTE_ENV, ROUTES, WEIGHT_CHOICES, WEIGHT_FORMATS, CpuFeatures,
    auto_route, check_weights, cpu_features, int8_rows, resolve_weights)

GROUP_SIZE = 32

_QMM: qmm.QmmOps | None = None  # the integer kernels, once a layer has packed weights for them
_SHAPES_ONLY = threading.local()  # .on: this thread's state_dict() gives dropped codes as meta tensors


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Inside: ``state_dict()`` gives dropped codes (``QuantLinear._drop_codes``) as meta tensors."""
    _SHAPES_ONLY.on = True
    try:
        yield
    finally:
        _SHAPES_ONLY.on = False


#: counts ``QuantLinear.prepare`` calls in this process: a change means some layer's buffers were rebuilt
PREPARED = 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 64-byte aligned (a copy if needed) for the AVX-512 int8 kernel."""
    t = t.contiguous()
    return t if t.data_ptr() % 64 == 0 else t.clone()


class QuantLinear(nn.Module):
    """Base of the quantised linear layers: ``forward(x [T, in]) -> [T, out]`` in ``x``'s
    dtype. Subclasses keep a portable form in their state dict (what the weight cache stores)
    and build kernel-specific buffers in :meth:`prepare` (not saved)."""

    fmt = ""
    #: batch-invariant kernels only (``pagedkv.model.invariant``; set by ``set_deterministic``)
    deterministic = False
    #: the buffer of stored codes the packed copy can give back (``_drop_codes``); "" for none
    codes_buffer = ""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None)
        self.route = "fallback"
        self.int8_rows = 0  # dynamic int8 from this many rows (0: off); set by prepare
        self._qmm, self.qmm_rows = None, 0  # the integer kernels' packed weights; set by prepare
        self._w8_t = self._w8_scale = self._w8_packed = self._w8_zero = None

    def _set_bias(self, bias: torch.Tensor | None) -> None:
        if bias is not None:
            self.bias = bias.detach().float().contiguous()

    def dequantize(self) -> torch.Tensor:
        """The weights the format represents, ``[out, in]`` float32."""
        raise NotImplementedError

    def prepare(self, route: str | None = None) -> "QuantLinear":
        """Pick the route (``None``: ``auto_route``) and build its buffers; returns self."""
        self._restore_codes()  # the packed copy below is rebuilt: the codes back first
        self.route = route or auto_route(self.fmt)
        if self.route not in ROUTES:
            raise ConfigError(f"weight route: unsupported {self.route!r} (one of {', '.join(ROUTES)})")
        self._wide_bf16 = cpu_features().bf16_fast
        self.int8_rows = 0
        global PREPARED
        PREPARED += 1  # what holds pointers into prepared buffers (native_step) rebuilds
        self._prepare_qmm()
        return self

    def _pack_qmm(self) -> qmm.Packed:
        """The weights in the integer kernels' layout (``pagedkv.ops.qmm``); ``ValueError``
        for shapes they do not take."""
        raise ValueError("no integer kernel for this format")

    def _drop_codes(self) -> None:
        """Free the stored codes when the packed copy is all that runs (``qmm`` at every row
        count: CPUs without AMX), half an int8 layer's bytes; they come back from the packed
        copy on demand (:meth:`stored_codes`, ``state_dict``, a re-prepare)."""
        if (self.codes_buffer and self._qmm is not None and self.qmm_rows >= qmm.ALL_ROWS and self.int8_rows == 0
                and getattr(self, "_packed", None) is None):
            self._codes_meta = getattr(self, self.codes_buffer).to("meta")  # shape and dtype, no bytes
            setattr(self, self.codes_buffer, None)

    def stored_codes(self) -> torch.Tensor:
        """The stored codes (``codes_buffer``), from the packed copy (``_unpack_codes``) when dropped."""
        t = self._buffers[self.codes_buffer]
        return t if t is not None else self._unpack_codes()

    def _unpack_codes(self) -> torch.Tensor:  # defined by the formats with a ``codes_buffer``
        raise NotImplementedError

    def _restore_codes(self) -> None:
        if self.codes_buffer and self._buffers.get(self.codes_buffer) is None and self._qmm is not None:
            setattr(self, self.codes_buffer, _aligned(self._unpack_codes()))

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """``state_dict`` keeps the portable form: dropped codes come back from the packed copy."""
        if not (self.codes_buffer and self._buffers.get(self.codes_buffer) is None and self._qmm is not None):
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        # for this call only, in its place among the buffers
        self._buffers[self.codes_buffer] = self._codes_meta if getattr(_SHAPES_ONLY, "on", False) else self._unpack_codes()
        try:
            super()._save_to_state_dict(destination, prefix, keep_vars)
        finally:
            self._buffers[self.codes_buffer] = None

    def _load_from_state_dict(self, state: dict, prefix: str, *args: Any) -> None:
        """Dropped codes come back first and load like any buffer (packed again by ``prepare``)."""
        self._restore_codes()
        super()._load_from_state_dict(state, prefix, *args)

    def set_deterministic(self, on: bool) -> None:
        """Batch-invariant kernels only (``on``): ``qmm`` at every row count (re-prepared on
        AMX hosts, where it otherwise hands wide inputs to oneDNN), dense ``F.linear`` calls
        through ``pagedkv.model.invariant.linear``."""
        if bool(on) == self.deterministic:
            return
        self.deterministic = bool(on)
        if self.route == "fast" and cpu_features().amx:
            self.prepare(self.route)

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, w)``, batch-invariant when ``deterministic``."""
        return invariant.linear(x, w) if self.deterministic else F.linear(x, w)

    def _prepare_qmm(self) -> None:
        """On the fast route, pack the weights for ``qmm`` (kernel ``"q8"``) when it is built
        and takes the shape; ``qmm_rows`` is the first row count it no longer runs (the rest
        keep the format's other kernels; every count when ``deterministic``)."""
        global _QMM
        self._qmm, self.qmm_rows = None, 0
        rows = qmm.max_rows(cpu_features().amx and not self.deterministic, int8_rows()) if self.route == "fast" else 0
        _QMM = qmm.get() if rows else _QMM
        if rows and _QMM is not None:
            try:
                self._qmm, self.qmm_rows = self._pack_qmm(), rows
            except ValueError:
                pass
        if self._qmm is not None and getattr(self, "int8_key", None) is None:
            self.int8_key = register_int8(self)

    def qmm_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float32 ``[T, in]`` through the integer kernel -> float32 ``[T, out]``, bias
        added. Raises ``RuntimeError`` when the layer has no packed weights."""
        ops = qmm.get()
        if self._qmm is None or ops is None:
            raise RuntimeError("qmm_forward: no integer-kernel weights for this layer")
        return ops.linear(x, self._qmm)

    def _int8_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(int8 [out, in], float32 scale [out])`` for dynamic int8, or ``None`` (no route)."""
        return None

    def _prepare_int8(self) -> None:
        rows = int8_rows() if self.route == "fast" and cpu_features().int8_exact and self.qmm_rows <= KERNEL_ROWS else 0
        w8 = self._int8_weights() if rows else None
        self.release_int8()  # (a re-prepare on another route frees int4's int8 copy)
        self.int8_rows = rows if w8 is not None else 0
        if w8 is None:
            return
        self._w8_scale = w8[1].float().contiguous()
        if onednn_int8():  # prepacked once; int4's plain int8 copy is then dropped
            self._w8_packed = torch.ops.onednn.qlinear_prepack(w8[0], None)
            self._w8_zero = torch.zeros(self.out_features, dtype=torch.int64)
        else:
            self._w8_t = w8[0].t()
        if getattr(self, "int8_key", None) is None:
            self.int8_key = register_int8(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> "QuantLinear":
        """A copy from the portable state, prepared on this route: its own prepacked weights
        (oneDNN's cannot be copied) under its own ``int8_key``."""
        state = {k: v.detach().clone() for k, v in self.state_dict().items()}
        return module_from_state(state, "").prepare(self.route)

    def release_int8(self) -> None:
        """Free the dynamic int8 weights and turn the route off (the layer keeps running on
        its other kernels)."""
        self.int8_rows = 0
        self._w8_t = self._w8_scale = self._w8_packed = self._w8_zero = None

    def int8_matmul(self, qx: torch.Tensor) -> torch.Tensor:
        """``qx`` uint8 ``[R, in]`` offset codes (int8 value + 128) -> float32 ``[R, out]`` =
        ``(qx - 128) @ w8.T * w_scale`` with exact int32 sums: oneDNN's u8 x s8 linear on the
        prepacked weights, else ``torch._int_mm``. Raises ``RuntimeError`` when the int8 route
        is off (``int8_rows == 0``)."""
        if self.int8_rows == 0:
            raise RuntimeError("int8_matmul: the dynamic int8 route is off for this layer")
        if self._w8_packed is not None:
            return torch.ops.onednn.qlinear_pointwise(qx, 1.0, 128, self._w8_packed, self._w8_scale, self._w8_zero,
                                                      None, 1.0, 0, torch.float32, "none", [], "")
        q = (qx.to(torch.int16) - 128).to(torch.int8)
        return torch._int_mm(q, self._w8_t).float().mul_(self._w8_scale)

    def _fast(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dynamic_int8(self, rows: int) -> bool:
        """Whether a ``rows``-row input runs dynamic int8 (``dynamic_int8_mm``): from
        ``int8_rows`` rows up, prefill chunks included (unless the integer kernel takes them)."""
        return 0 < self.int8_rows <= rows and not rows < self.qmm_rows

    def takes_bf16(self, rows: int) -> bool:
        """Whether a ``rows``-row input runs the bf16 kernel (its activations are rounded to
        bf16 and the result comes back in bf16 before any cast): a caller may hand bf16 in."""
        return (self.route == "fast" and (rows <= KERNEL_ROWS or self.fmt == "bf16") and not self.dynamic_int8(rows)
                and not rows < self.qmm_rows and self._has_bf16_kernel())

    def _has_bf16_kernel(self) -> bool:
        return True

    def kernel(self, rows: int) -> str:
        """Which kernel a ``rows``-row input runs: ``"q8"`` (``pagedkv.ops.qmm``'s integer
        kernels), ``"int8"`` (``dynamic_int8_mm``), ``"bf16"`` (the format's bf16 kernel),
        ``"wide"`` (dequantise, one wide matmul) or ``"fallback"``."""
        if rows < self.qmm_rows:
            return "q8"
        if self.dynamic_int8(rows):
            return "int8"
        if self.takes_bf16(rows):
            return "bf16"
        return "wide" if self.route == "fast" else "fallback"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.qmm_rows:  # kernel "q8", the hot path: no other decision
            xf = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
            if torch.compiler.is_compiling() or torch.autograd._profiler_enabled():  # an op graphs/profiles see
                y = torch.ops.pagedkv.qmm_linear(xf, self.int8_key, self.out_features)
            else:
                y = _QMM.linear(xf, self._qmm)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        kernel = self.kernel(x.shape[0])
        if kernel == "int8":
            y = dynamic_int8_mm(x, self)
            if x.dtype != torch.float32:
                y = y.to(x.dtype)
        elif kernel == "bf16":
            y = self._fast(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16))
            if x.dtype != torch.bfloat16:
                y = y.to(x.dtype)
        elif kernel == "wide":  # a prefill chunk: dequantise once, one wide matmul
            wide = torch.bfloat16 if self._wide_bf16 else x.dtype
            y = self._linear(x.to(wide), self.dequantize().to(wide)).to(x.dtype)
        else:
            y = self._linear(x, self.dequantize().to(x.dtype))
        if self.bias is not None:
            y += self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}, route={self.route}"


class BF16Linear(onednn_bf16.PrepackedMixin, QuantLinear):
    """bf16 ``weight`` ``[out, in]``; fast route: ``qmm.pack_bf16`` (no copy; the native step runs it) below
    ``BF16_QMM_ROWS`` rows (deterministic: every count), bf16 ``F.linear`` (emulated bf16: fp32) from there."""

    fmt = "bf16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0])
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())
        self._set_bias(bias)

    def _fast(self, x: torch.Tensor) -> torch.Tensor:
        y = self.onednn_linear(x)
        return y if y is not None else self._linear(x, self.weight)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "weight" and getattr(self, "_qmm", None) is not None and self._qmm.codes is not value:
            self._prepare_qmm()  # a new tensor (not copy_): qmm's pack follows it

    def _pack_qmm(self) -> qmm.Packed:
        return qmm.pack_bf16(self.weight, self.bias)

    def _prepare_qmm(self) -> None:  # deterministic: qmm at every row count (a row's sums never see its batch)
        super()._prepare_qmm()
        if self._qmm is not None:  # AMX too (its integer formats go to oneDNN from int8_rows)
            self.qmm_rows = qmm.ALL_ROWS if self.deterministic else BF16_QMM_ROWS

    def _has_bf16_kernel(self) -> bool:  # emulated bf16 (AVX2): wider inputs run the fp32 "wide" matmul
        return self._wide_bf16

    def prepack_wanted(self) -> bool:  # native bf16, not batch-invariant: not in deterministic mode
        return self.route == "fast" and not self.deterministic and self._wide_bf16 and self._qmm is None


class Int8Linear(QuantLinear):
    """``qweight`` int8 ``[out, in]`` and ``scale`` float32 ``[out]``: ``w = qweight * scale``
    (symmetric, per output channel). Fast route: ``torch._weight_int8pack_mm``."""

    fmt = "int8"
    codes_buffer = "qweight"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(qweight.shape[1], qweight.shape[0])
        self.register_buffer("qweight", _aligned(qweight.to(torch.int8)))
        self.register_buffer("scale", scale.float().contiguous())
        self._set_bias(bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """Round ``weight`` ``[out, in]`` to the nearest of 255 levels per row."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale, bias)

    def dequantize(self) -> torch.Tensor:
        return self.stored_codes().float() * self.scale[:, None]

    def prepare(self, route: str | None = None) -> "Int8Linear":
        super().prepare(route)
        self._scale_bf16 = self.scale.to(torch.bfloat16)
        self._prepare_int8()
        self._drop_codes()
        return self

    def _int8_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stored_codes(), self.scale  # the stored codes themselves: no copy

    def _pack_qmm(self) -> qmm.Packed:
        return qmm.pack_int8(self.stored_codes(), self.scale, self.bias)

    def _unpack_codes(self) -> torch.Tensor:
        return qmm.unpack_int8(self._qmm)

    def _fast(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.qweight, self._scale_bf16)


class Int4Linear(QuantLinear):
    """``qcodes`` uint8 ``[out, in / 2]`` (element ``2i`` in the low nibble of byte ``i``,
    ``2i + 1`` in the high one), ``scale`` and ``min`` float32 ``[out, in / 32]``:
    ``w[o, k] = scale[o, k // 32] * q[o, k] + min[o, k // 32]``. Fast route:
    ``torch._weight_int4pack_mm_for_cpu`` (its zero point is ``min + 8 * scale``)."""

    fmt = "int4"
    codes_buffer = "qcodes"

    def __init__(self, qcodes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(qcodes.shape[1] * 2, qcodes.shape[0])
        if self.in_features % GROUP_SIZE:
            raise ConfigError(f"int4: input size {self.in_features} is not a multiple of {GROUP_SIZE}")
        self._packed = None  # ATen's int4 layout, built by prepare where a row count uses it
        self.register_buffer("qcodes", qcodes.to(torch.uint8).contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("min", mins.float().contiguous())
        self._set_bias(bias)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
                   bias: torch.Tensor | None = None) -> "Int4Linear":
        """From unpacked codes ``[out, in]`` (values 0..15, any integer or float dtype)."""
        q = codes.to(torch.uint8)
        return cls(q[:, 0::2] | (q[:, 1::2] << 4), scale, mins, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int4Linear":
        """Min/max quantisation per group of 32 (GGUF Q4_1's rule): ``min`` = the group's
        minimum, ``scale`` = range / 15, both rounded to float16 as Q4_1 stores them (the
        integer kernels read them so), codes rounded against the rounded values."""
        w = weight.detach().float()
        out, k = w.shape
        if k % GROUP_SIZE:
            raise ConfigError(f"int4: input size {k} is not a multiple of {GROUP_SIZE}")
        g = w.reshape(out, k // GROUP_SIZE, GROUP_SIZE)
        lo = g.amin(-1).half().float()
        scale = ((g.amax(-1) - lo) / 15.0).half().float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15).reshape(out, k)
        return cls.from_codes(q, scale, lo, bias)

    def codes(self) -> torch.Tensor:
        """Unpacked codes ``[out, in]`` uint8 (0..15)."""
        if self.qcodes is None:  # dropped (``_drop_codes``): the packed copy has them
            return qmm.unpack_int4(self._qmm)
        c = self.qcodes
        return torch.stack([c & 15, c >> 4], dim=-1).reshape(self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        g = self.codes().float().reshape(self.out_features, -1, GROUP_SIZE)
        return (g * self.scale[..., None] + self.min[..., None]).reshape(self.out_features, self.in_features)

    def prepare(self, route: str | None = None) -> "Int4Linear":
        super().prepare(route)
        self._packed = None
        if self.route == "fast" and self.out_features % 16 and self._qmm is None:  # ATen packs 16 rows at a time
            self.route = "fallback"
        if self.route == "fast" and self.qmm_rows <= KERNEL_ROWS and self.out_features % 16 == 0:
            self._packed = torch._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32), 1)
            zero = self.min + 8.0 * self.scale
            self._scale_zero = torch.stack([self.scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self._prepare_int8()
        self._drop_codes()
        return self

    def _pack_qmm(self) -> qmm.Packed:
        return qmm.pack_int4(self.codes(), self.scale, self.min, self.bias)

    def _has_bf16_kernel(self) -> bool:
        return self._packed is not None

    def _unpack_codes(self) -> torch.Tensor:
        q = qmm.unpack_int4(self._qmm)
        return q[:, 0::2] | (q[:, 1::2] << 4)

    def _int8_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int4 values rounded to int8 per output channel (scale = max|w| / 127)."""
        w = self.dequantize()
        scale = w.abs().amax(dim=1).clamp_min(1e-30) / 127.0
        return _aligned(torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)), scale

    def _fast(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self._packed, GROUP_SIZE, self._scale_zero)


def module_from_state(state: dict[str, torch.Tensor], prefix: str) -> QuantLinear | None:
    """The quantised module that ``state``'s ``prefix``-keys hold (its portable form, as
    ``state_dict()`` wrote it), or ``None`` if they hold a plain float ``nn.Linear`` (a
    ``weight`` that is not bf16) or nothing."""
    bias = state.get(prefix + "bias")
    if prefix + "qcodes" in state:
        return Int4Linear(state[prefix + "qcodes"], state[prefix + "scale"], state[prefix + "min"], bias)
    if prefix + "qweight" in state:
        return Int8Linear(state[prefix + "qweight"], state[prefix + "scale"], bias)
    w = state.get(prefix + "weight")
    if w is not None and w.dtype == torch.bfloat16:
        return BF16Linear(w, bias)
    return None
