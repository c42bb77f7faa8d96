"""Which weight format and route the quantised linear layers take on this CPU
(``weights="auto"`` and the ``fast``/``fallback`` routes); the layers themselves are
``pagedkv.model.quant``, which re-exports these names.

``CpuFeatures`` is what the running CPU offers the weight kernels, read from the CPU profile
(``pagedkv.cpu_isa``, capped by ``$PAGEDKV_CPU_ISA``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from pagedkv import cpu_isa
from pagedkv.errors import ConfigError
from pagedkv.utils import canonical_dtype

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
#: ``gguf``: a GGUF file's stored blocks on the integer kernels (``pagedkv.model.gguf_native``)
WEIGHT_CHOICES = ("auto", "gguf") + WEIGHT_FORMATS
ROUTES = ("fast", "fallback")
ROUTE_ENV = "PAGEDKV_WEIGHT_ROUTE"


@dataclass(frozen=True)
class CpuFeatures:
    """What the running CPU (as torch sees it) offers the weight kernels. ``capability``:
    ``torch.backends.cpu.get_cpu_capability()`` (``AVX512``, ``AVX2``, ``DEFAULT``, ...; the
    ``ATEN_CPU_CAPABILITY`` environment variable lowers it); the rest from the CPU profile
    (``pagedkv.cpu_isa``, capped by ``$PAGEDKV_CPU_ISA``)."""

    capability: str
    avx512_bf16: bool
    amx: bool
    vnni: bool

    @property
    def int_kernels_fast(self) -> bool:
        """ATen's int8/int4 weight-only kernels run vectorised on bf16 activations (its AVX2
        and AVX-512 builds; measured with ``ATEN_CPU_CAPABILITY=avx2`` too)."""
        return self.capability in ("AVX2", "AVX512")

    @property
    def bf16_fast(self) -> bool:
        """oneDNN multiplies bf16 natively (AVX512-BF16 or AMX) instead of emulating it."""
        return (self.avx512_bf16 or self.amx) and self.capability == "AVX512"

    @property
    def int8_exact(self) -> bool:
        """oneDNN's u8 x s8 kernels (and ``torch._int_mm``) sum exactly in int32: VNNI or
        AMX-INT8, not capped by ``$ONEDNN_MAX_CPU_ISA``. Without VNNI they add pairs of products
        in int16 with saturation (``vpmaddubsw``), which dynamic int8's codes overflow (greedy
        text turned to garbage), so that route needs this."""
        cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
        return (self.vnni or self.amx) and cap not in ("SSE41", "AVX", "AVX2", "AVX512_CORE")

    @property
    def int8_refusal(self) -> str | None:
        """Why dynamic int8 is off on this CPU (``None``: it is on), for messages and tests."""
        if self.int8_exact:
            return None
        if self.vnni or self.amx:
            return "oneDNN is capped below VNNI ($ONEDNN_MAX_CPU_ISA), so its u8 x s8 sums saturate in int16"
        return (f"no VNNI or AMX-INT8 here (capability {self.capability}): u8 x s8 products would be "
                "summed in int16 with saturation, which dynamic int8's codes overflow")

    def as_dict(self) -> dict[str, Any]:
        return {"capability": self.capability, "avx512_bf16": self.avx512_bf16, "amx": self.amx,
                "vnni": self.vnni, "int_kernels_fast": self.int_kernels_fast, "bf16_fast": self.bf16_fast,
                "int8_exact": self.int8_exact}


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """The running CPU's ``CpuFeatures`` (cached for the process), from ``cpu_isa.profile()``:
    under ``PAGEDKV_CPU_ISA=avx2`` no VNNI, AMX or AVX512-BF16. Raises ``ConfigError`` for a
    bad ``$PAGEDKV_CPU_ISA``."""
    p = cpu_isa.profile()
    return CpuFeatures(capability=p.aten_capability, avx512_bf16=p.avx512_bf16, amx=p.amx, vnni=p.vnni)


#: the int8/int4 weight-only kernels multiply at most this many rows; with the dynamic int8
#: route off, a wider input (a prefill chunk) dequantises the weights and runs one bf16 (AMX)
#: or fp32 matmul instead, measured faster above about 64 rows (``bench quality --part routes``)
KERNEL_ROWS = 64
#: inputs of at least this many rows (decode batches and prefill chunks) run dynamic int8
#: (``dynamic_int8_mm``) in the int8/int4 formats on the fast route: the row count where it
#: overtakes the weight-only kernels here (2 AVX2 cores, whole engine steps: equal at 4 rows,
#: 14% faster at 8, 28% at 16, 39% at 32; the LM head gains from 8 rows, the layers from
#: ~16). ``$PAGEDKV_INT8_ROWS`` overrides it; 0 turns the route off.
INT8_ROWS = 8
INT8_ROWS_ENV = "PAGEDKV_INT8_ROWS"


def int8_rows() -> int:
    """The smallest batch (rows) for dynamic int8: ``$PAGEDKV_INT8_ROWS`` or ``INT8_ROWS``;
    0 = never. Raises ``ConfigError`` for a value that is not an integer in 0 .. ``KERNEL_ROWS``."""
    raw = os.environ.get(INT8_ROWS_ENV, "").strip()
    if not raw:
        return INT8_ROWS
    if not (raw.isascii() and raw.isdecimal()):
        raise ConfigError(f"{INT8_ROWS_ENV}: expected a non-negative integer (rows), got {raw!r}")
    rows = int(raw)
    if rows > KERNEL_ROWS:
        raise ConfigError(f"{INT8_ROWS_ENV}: at most {KERNEL_ROWS} (the weight-only kernels' widest input; "
                          f"0 turns the route off), got {rows}")
    return rows


def auto_route(fmt: str, features: CpuFeatures | None = None) -> str:
    """``"fast"`` if this CPU has the fast kernel of ``fmt``, else ``"fallback"`` (and always
    ``"fallback"`` when ``$PAGEDKV_WEIGHT_ROUTE`` is ``fallback``)."""
    forced = os.environ.get(ROUTE_ENV, "").strip().lower()
    if forced == "fallback":
        return "fallback"
    f = features or cpu_features()
    # gguf and bf16 run pagedkv's own kernels (qmm), vectorised or plain C: fast wherever they
    # build (bf16's wider inputs: oneDNN's bf16 matmul where the CPU has it, else one fp32 one)
    fast = {"fp32": True, "bf16": True, "int8": f.int_kernels_fast, "int4": f.int_kernels_fast,
            "gguf": True}[fmt]
    return "fast" if fast else "fallback"


def check_weights(weights: Any) -> str:
    """The lower-cased format name; raises ``ConfigError`` naming the valid values."""
    name = weights.strip().lower() if isinstance(weights, str) else None
    if name not in WEIGHT_CHOICES:
        raise ConfigError(f"weights: unsupported {weights!r} (one of {', '.join(WEIGHT_CHOICES)})")
    return name


def resolve_weights(
    weights: Any, dtype: Any = "fp32", device: Any = "cpu", tensor_parallel_size: int = 1,
    features: CpuFeatures | None = None,
) -> tuple[str, str]:
    """``(format, why)`` for ``weights`` (``"auto"`` or a format), the model ``dtype``, the
    ``device`` and the tensor-parallel size. The format equals the model dtype's name
    (``fp32``/``bf16``/``fp16``) when the linear layers stay unquantised.

    This is the CPU's side of ``auto``; the source's side (a GGUF keeps its stored codes, an
    unquantised checkpoint its own dtype) is ``pagedkv.model.loader.auto_weights``, which the
    loader applies after this. ``gguf`` (a GGUF's stored blocks) needs a float32 model on one
    CPU, as the quantised formats do.

    ``auto`` here is the fastest format within the quality bounds (int8 within 2% of fp32's
    perplexity, int4 within 6%; measured by ``pagedkv bench quality``) that has a fast kernel
    on this CPU: int4 where the int4 kernel is vectorised (AVX2/AVX-512 builds), else bf16
    with AVX512-BF16/AMX, else fp32. (int4 is the fastest at decode batches up to ~8; bf16
    is faster from batch ~32 and in prefill, measured in docs/benchmarks/weights_quality.md#routes.)
    Decided from the CPU's capability, never by timing. A bf16/fp16 model, another device
    than the CPU or tensor parallelism keep the model dtype's weights under ``auto`` (with
    tensor parallelism ``auto_weights`` then keeps a GGUF's stored blocks, sliced per rank), and
    refuse a quantised format with ``ConfigError`` (tensor parallelism takes ``gguf``; also
    raised for an unknown name and for ``fp32`` weights in a 16-bit model)."""
    name = check_weights(weights)
    model = canonical_dtype(dtype, ("fp32", "bf16", "fp16"))
    on_cpu = str(device).split(":")[0] == "cpu"
    if name == "auto":
        if model != "fp32" or not on_cpu or tensor_parallel_size != 1:
            return model, f"auto: the {model} model's own weights (quantised formats: fp32 models on one CPU)"
        f = features or cpu_features()
        if auto_route("int4", f) == "fast":
            plan = ("integer kernels (qmm) below 8 rows, AMX dynamic int8 from 8" if f.amx and f.int8_exact
                    else "integer kernels (qmm) at every batch size")
            return "int4", f"auto: int4 on this CPU (capability {f.capability}; {plan})"
        if f.bf16_fast and auto_route("bf16", f) == "fast":  # a native bf16 matmul (prefill)
            return "bf16", f"auto: native bf16 matmul on this CPU (AVX512-BF16/AMX, capability {f.capability})"
        return "fp32", f"auto: no fast bf16/int8/int4 kernel on this CPU (capability {f.capability})"
    if name == model:
        return name, "requested"
    if name == "fp32":
        raise ConfigError(f"weights: 'fp32' needs dtype float32 (the model is {model})")
    if not on_cpu:
        raise ConfigError(f"weights: {name!r} runs on the CPU only (device {device!r}); use 'auto' or the model dtype")
    if tensor_parallel_size != 1 and name != "gguf":
        raise ConfigError(f"weights: {name!r} is not supported with tensor parallelism; use 'auto', 'gguf' "
                          f"(a GGUF's stored blocks, sliced per rank) or {model!r}")
    if name == "gguf" and model != "fp32":
        raise ConfigError(f"weights: 'gguf' needs dtype float32 (its kernels take float32 activations; the model is {model})")
    return name, "requested"
