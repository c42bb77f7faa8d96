"""Quantised KV-cache formats: int8 and fp8 (e4m3, e5m2) codes with bf16 scales per group.

Storage (what ``KVCacheSpec(dtype, quant_group_size=G).bytes_per_token`` counts): for every
token and KV head, K and V each hold ``d`` one-byte codes and ``d / G`` bf16 scales (``G``
the group size, default ``d``: one scale per head vector). Codes and scales are separate
tensors in the same layout (the scales' "head_dim" is ``d / G``), so a block id selects the
codes and the scales of its tokens alike; CoW copies, prefix caching and preemption move
them together.

Quantise (in ``write_kv``, through ``slot_mapping``), per group ``x`` of ``G`` elements::

    scale = max|x| / QMAX, rounded up to bf16   QMAX: 127 (int8), 448 (fp8_e4m3), 57344 (fp8_e5m2)
            (at least 2^-126 unless the group is all zeros)
    code  = round(x / scale)    int8: nearest integer; fp8: nearest fp8 value, ties to even
                                (|x / scale| <= QMAX: nothing is clamped)

Dequantise (inside attention, one tile or chunk at a time): ``x' = code * scale``, exact in
float32 (a 1-byte code times a bf16 scale has at most 15 significant bits), so every backend
sees the same values. Per-element error bound (:func:`error_bound`): int8 ``scale / 2``; fp8
``max(|x| 2^-(m+1), scale 2^(emin-m-1))`` (``m`` mantissa bits, ``emin`` the smallest normal
exponent). Scales are bf16 rather than fp16: the same 2 bytes, but fp8_e5m2's ``max|x| /
57344`` (or int8's for a small vector) would fall into fp16's subnormals and lose precision
or flush to 0, while bf16 has float32's exponent range. Rounding the scale up costs at most
2^-7 of the code range and makes the bound hold whatever rounding a kernel's conversion
uses. fp8 codes are kept as ``uint8`` bits: torch has no CPU index ops on its float8 dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.errors import ConfigError
from pagedkv.kv.spec import check_group_size  # noqa: F401 - re-exported: the engine and layouts use it here
from pagedkv.utils import kv_cache_dtype

#: dtype of the per-group scales (2 bytes: KVCacheSpec's default ``scale_bytes``).
SCALE_DTYPE = torch.bfloat16
#: smallest scale of a nonzero group: the smallest normal float32 / bf16, 2^-126.
MIN_SCALE = 2.0 ** -126


@dataclass(frozen=True)
class QuantFormat:
    """One quantised code format. ``kernel_id`` numbers it for the C and Triton kernels
    (0 and 1 are the plain float32 / bfloat16 caches)."""

    name: str  # int8 | fp8_e4m3 | fp8_e5m2
    qmax: float  # largest code magnitude
    storage: torch.dtype  # element dtype of the code tensors
    code_dtype: torch.dtype | None  # fp8: the float8 dtype the uint8 bits are
    mantissa_bits: int  # fp8 only
    min_exp: int  # fp8: exponent of the smallest normal value
    kernel_id: int

    @property
    def spec_dtype(self) -> str:
        """The ``KVCacheSpec`` dtype name that sizes this format."""
        return "int8" if self.name == "int8" else "fp8"


def _formats() -> dict[str, QuantFormat]:
    out = {"int8": QuantFormat("int8", 127.0, torch.int8, None, 0, 0, 2)}
    for name, attr, qmax, m, emin, kid in (("fp8_e4m3", "float8_e4m3fn", 448.0, 3, -6, 3),
                                           ("fp8_e5m2", "float8_e5m2", 57344.0, 2, -14, 4)):
        if hasattr(torch, attr):
            out[name] = QuantFormat(name, qmax, torch.uint8, getattr(torch, attr), m, emin, kid)
    return out


FORMATS: dict[str, QuantFormat] = _formats()


def resolve(dtype: torch.dtype | str) -> tuple[torch.dtype | None, QuantFormat | None]:
    """``(plain torch dtype, None)`` or ``(None, QuantFormat)`` for a cache dtype given as a
    torch dtype or a ``kv_cache_dtype`` name (``"int8"``, ``"fp8_e4m3"``, ``"bfloat16"``; not
    ``"auto"``). Raises ``ConfigError`` naming the valid values."""
    if isinstance(dtype, torch.dtype):
        return dtype, None
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        raise ConfigError("kv_cache_dtype: 'auto' must be resolved against the model dtype first")
    name = kv_cache_dtype(dtype)
    if name in FORMATS:
        return None, FORMATS[name]
    return getattr(torch, name), None


def round_up_bf16(v: torch.Tensor) -> torch.Tensor:
    """``v`` (float32, >= 0 or NaN) rounded up to a bf16 value (NaN stays NaN): the nearest
    bf16, bumped by one ulp (its bit pattern + 1) when that fell below ``v``."""
    s = v.to(SCALE_DTYPE)
    return torch.where(s.float() < v, (s.view(torch.int16) + 1).view(SCALE_DTYPE), s)


def quantize(x: torch.Tensor, fmt: QuantFormat, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[n, H, d]`` (``fmt.storage``) and scales ``[n, H, d / G]`` (bf16) of ``x``
    ``[n, H, d]`` (any float dtype). A NaN in a group makes its scale NaN (tests poison
    slots this way); an all-zero group gets scale 0 and codes 0; any other at least
    ``MIN_SCALE``."""
    n, h, d = x.shape
    xg = x.float().reshape(n, h, d // group_size, group_size)
    amax = xg.abs().amax(dim=-1)  # [n, H, ng]
    # a nonzero group whose max|x| / QMAX is below float32's normal range (or underflows to
    # 0) gets the smallest normal scale: never 0 for a nonzero group, unharmed by flush-to-zero
    scales = torch.where(amax == 0, 0.0, round_up_bf16(amax / fmt.qmax).clamp_min(MIN_SCALE)).to(SCALE_DTYPE)
    s = scales.float()
    y = xg / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
    y = y.clamp_(-fmt.qmax, fmt.qmax)  # a no-op (the scale was rounded up) but for NaN
    if fmt.code_dtype is None:
        codes = y.round_().to(fmt.storage)
    else:
        codes = y.to(fmt.code_dtype).view(torch.uint8)
    return codes.reshape(n, h, d), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``codes * scales`` (``codes`` ``[..., d]``, ``scales`` ``[..., d / G]``, the same
    leading dims); written into ``out`` (float32, same shape as ``codes``) when given."""
    vals = codes.view(fmt.code_dtype) if fmt.code_dtype is not None else codes
    ng = scales.shape[-1]
    shape = codes.shape
    grouped = (shape[:-1] + (ng, shape[-1] // ng))
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=codes.device)
    o = out.view(grouped)
    o.copy_(vals.reshape(grouped))
    o.mul_(scales.unsqueeze(-1))
    return out


def error_bound(x: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Per-element bound (float64, shape of ``x`` ``[..., d]``) on ``|dequantize(quantize(x)) -
    x|`` given the stored ``scales`` ``[..., d / G]``: int8 ``scale/2``; fp8 ``max(|x|
    2^-(m+1), scale 2^(emin-m-1))`` (half an ulp, normal or subnormal). Scales are rounded up,
    so no code is clamped; a relative slack of ``2^-10`` covers the float32 division."""
    x = x.double()
    ng = scales.shape[-1]
    s = scales.double().repeat_interleave(x.shape[-1] // ng, dim=-1)
    if fmt.code_dtype is None:
        b = 0.5 * s
    else:
        b = torch.maximum(x.abs() * 2.0 ** -(fmt.mantissa_bits + 1),
                          s * 2.0 ** (fmt.min_exp - fmt.mantissa_bits - 1))
    return b * (1 + 2.0 ** -10)
