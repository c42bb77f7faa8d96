"""The CPU's instruction sets as pagedkv's kernels see them: one profile, read once, capped by
``$PAGEDKV_CPU_ISA``.

A profile has a class (``isa``): ``amx`` (AVX-512 with AMX-INT8/BF16 tiles), ``avx512``
(AVX-512 F/BW/VL, with VNNI/BF16 where present), ``avx2`` (AVX2 + FMA + F16C, no AVX-512 or
AMX; AVX-VNNI where the CPU has it, cleared by the avx2 cap) or ``default`` (none of these); the individual flags; and what the kernels run:
ATen's capability (``torch.backends.cpu.get_cpu_capability()``) and oneDNN's highest ISA.

``PAGEDKV_CPU_ISA=avx2|avx512|amx|native`` caps the profile (``native``/unset: no cap), so an
AVX2-only host can be run on any bigger one. The cap also caps torch and oneDNN: ``apply_env``
(run by ``import pagedkv``, before anything imports torch) sets ``ATEN_CPU_CAPABILITY`` and
``ONEDNN_MAX_CPU_ISA`` to match unless the user set them. A cap above what the CPU has, or an
unknown value, is a ``ConfigError`` (raised by ``profile()``; ``apply_env`` never raises, so
``import pagedkv`` always works). ``march_flags()`` gives the C kernels' ``-march`` for the
profile. This module imports nothing heavy: torch only inside ``profile()``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from pagedkv.errors import ConfigError

ENV = "PAGEDKV_CPU_ISA"
CAPS = ("avx2", "avx512", "amx", "native")
CLASSES = ("default", "avx2", "avx512", "amx")  # lowest first
#: the /proc/cpuinfo flags the profile reads
FLAGS = ("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
         "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
#: the same flags in torch's ``torch.cpu.get_capabilities()`` (no /proc/cpuinfo: not Linux)
_TORCH_NAMES = {"fma": "fma3", "avx512f": "avx512_f", "avx512bw": "avx512_bw", "avx512vl": "avx512_vl"}
#: flags each class keeps (a cap to a class clears the others)
_KEEP = {
    "default": (),
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "avx512": ("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
               "avx512_bf16"),
    "amx": FLAGS,
}
#: ``ATEN_CPU_CAPABILITY`` per capped class
ATEN_CAP = {"avx2": "avx2", "avx512": "avx512", "amx": "avx512"}
#: ``MKL_ENABLE_INSTRUCTIONS`` per capped class (amx: MKL's own choice)
MKL_CAP = {"avx2": "AVX2", "avx512": "AVX512"}
#: oneDNN's ISA names (``ONEDNN_MAX_CPU_ISA``), lowest first; AVX10_1_512[_AMX] are newer names
#: of AVX512_CORE_FP16 / AVX512_CORE_AMX
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16")
_ONEDNN_ALIASES = {"AVX10_1_512": "AVX512_CORE_FP16", "AVX10_1_512_AMX": "AVX512_CORE_AMX",
                   "AVX10_1_512_AMX_FP16": "AVX512_CORE_AMX_FP16"}
#: the C kernels' -march under the avx2 cap: AVX2 + FMA + F16C + BMI1/2 + LZCNT + MOVBE
MARCH_AVX2 = "-march=x86-64-v3"


@dataclass(frozen=True)
class CpuProfile:
    """What the kernels may use. ``isa``: the class in effect (after the cap); ``native_isa``:
    the CPU's own; ``cap``: ``$PAGEDKV_CPU_ISA`` (``native`` when unset). The flags are the
    CPU's with everything above the cap cleared. ``aten_capability``: ATen's kernels
    (``AVX512``, ``AVX2``, ``DEFAULT``); ``onednn_isa``: oneDNN's highest ISA (the CPU's, under
    ``onednn_cap`` = ``$ONEDNN_MAX_CPU_ISA`` / ``$DNNL_MAX_CPU_ISA`` when set)."""

    isa: str
    native_isa: str
    cap: str
    avx2: bool = False
    fma: bool = False
    f16c: bool = False
    bmi2: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512_vnni: bool = False
    avx_vnni: bool = False
    avx512_bf16: bool = False
    amx_tile: bool = False
    amx_int8: bool = False
    amx_bf16: bool = False
    aten_capability: str = "DEFAULT"
    onednn_isa: str = "SSE41"
    onednn_cap: str | None = None

    @property
    def vnni(self) -> bool:
        """u8 x s8 dot products summed in int32 (AVX-512 VNNI or AVX-VNNI)."""
        return self.avx512_vnni or self.avx_vnni

    @property
    def amx(self) -> bool:
        return self.amx_tile and self.amx_int8

    def flags(self) -> list[str]:
        """The flags set, in ``FLAGS`` order."""
        return [f for f in FLAGS if getattr(self, f)]

    def as_dict(self) -> dict[str, Any]:
        """For benchmark JSON: class, cap, flags, ATen's and oneDNN's ISA."""
        d = {k: v for k, v in asdict(self).items() if k not in FLAGS}
        d["flags"] = self.flags()
        d["vnni"], d["amx"] = self.vnni, self.amx
        d["march"] = " ".join(march_flags())
        return d

    def summary(self) -> str:
        """One line for the start-up log."""
        capped = f" (capped by {ENV}={self.cap}; CPU: {self.native_isa})" if self.cap != "native" else ""
        if self.cap != "native" and self.aten_capability.lower() != ATEN_CAP[self.isa]:
            capped += (f" - but ATen runs {self.aten_capability} (ATEN_CPU_CAPABILITY set, or torch imported "
                       "before pagedkv)")
        return (f"{self.isa}{capped}; flags {' '.join(self.flags()) or 'none'}; ATen {self.aten_capability}; "
                f"oneDNN {self.onednn_isa}; C kernels {' '.join(march_flags())}")


@functools.lru_cache(maxsize=4)
def read_cpuinfo(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first processor's flags (read once), or ``None`` when the file is not there (not Linux)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def isa_class(flags: Iterable[str]) -> str:
    """The class of a set of flags: ``amx`` > ``avx512`` > ``avx2`` > ``default``."""
    f = set(flags)
    if not {"avx2", "fma", "f16c"} <= f:
        return "default"
    if not {"avx512f", "avx512bw", "avx512vl"} <= f:
        return "avx2"
    return "amx" if {"amx_tile", "amx_int8"} <= f else "avx512"


def parse_cap(raw: str | None) -> str:
    """``$PAGEDKV_CPU_ISA``'s value as one of ``CAPS`` (unset/empty: ``native``); ``ConfigError``
    naming the valid values otherwise."""
    cap = (raw or "").strip().lower() or "native"
    if cap not in CAPS:
        raise ConfigError(f"{ENV}: unsupported {raw!r} (one of {', '.join(CAPS)})")
    return cap


def capped(flags: Iterable[str], cap: str) -> tuple[str, set[str]]:
    """``(class, flags)`` under ``cap`` (a value of ``CAPS``). ``ConfigError`` when the cap is
    above the CPU's class, naming what the CPU has."""
    f = set(flags) & set(FLAGS)
    native = isa_class(f)
    if cap == "native":
        return native, f
    if CLASSES.index(cap) > CLASSES.index(native):
        fits = [c for c in CAPS if c == "native" or CLASSES.index(c) <= CLASSES.index(native)]
        raise ConfigError(f"{ENV}={cap}: this CPU is {native} ({' '.join(x for x in FLAGS if x in f) or 'no AVX2'}); "
                          f"use {', '.join(fits)}")
    return cap, f & set(_KEEP[cap])


def onednn_isa_of(flags: Iterable[str]) -> str:
    """oneDNN's highest ISA for a set of flags."""
    f = set(flags)
    cls = isa_class(f)
    if cls == "amx":
        return "AVX512_CORE_AMX" if "amx_bf16" in f else "AVX512_CORE_BF16"
    if cls == "avx512":
        return "AVX512_CORE_BF16" if "avx512_bf16" in f else "AVX512_CORE_VNNI" if "avx512_vnni" in f else "AVX512_CORE"
    if cls == "avx2":
        return "AVX2_VNNI" if "avx_vnni" in f else "AVX2"
    return "SSE41"


def onednn_min(isa: str, cap: str | None) -> str:
    """``isa`` limited by a ``$ONEDNN_MAX_CPU_ISA`` value (unknown values and ``ALL``/``DEFAULT``:
    no limit)."""
    name = _ONEDNN_ALIASES.get((cap or "").strip().upper(), (cap or "").strip().upper())
    if name not in ONEDNN_ISAS:
        return isa
    return min(isa, name, key=ONEDNN_ISAS.index)


def cap_env(cap: str, flags: Iterable[str]) -> dict[str, str]:
    """The torch/oneDNN/MKL variables a cap sets: ``ATEN_CPU_CAPABILITY``,
    ``ONEDNN_MAX_CPU_ISA`` and, under avx2/avx512, ``MKL_ENABLE_INSTRUCTIONS`` (MKL runs torch's
    float32 matmuls: uncapped, an "AVX2" profile would still multiply with AVX-512); none for
    ``native``."""
    if cap == "native":
        return {}
    klass, f = capped(flags, cap)
    out = {"ATEN_CPU_CAPABILITY": ATEN_CAP[klass], "ONEDNN_MAX_CPU_ISA": onednn_isa_of(f)}
    if klass in MKL_CAP:
        out["MKL_ENABLE_INSTRUCTIONS"] = MKL_CAP[klass]
    return out


def apply_env(environ: Any = None, flags: Iterable[str] | None = None) -> dict[str, str]:
    """Set ``cap_env`` in ``environ`` (default ``os.environ``) where the user did not set the
    variable (``DNNL_MAX_CPU_ISA`` counts for oneDNN); returns what it set. Must run before torch
    is imported (``import pagedkv`` does). Never raises: a bad ``$PAGEDKV_CPU_ISA`` is reported
    by ``profile()``. Without /proc/cpuinfo the cap is applied unchecked (checked by ``profile()``)."""
    env = os.environ if environ is None else environ
    try:
        cap = parse_cap(env.get(ENV))
        if cap == "native":
            return {}
        have = read_cpuinfo() if flags is None else set(flags)
        want = cap_env(cap, have if have is not None else _KEEP[cap])
    except ConfigError:
        return {}
    if env.get("DNNL_MAX_CPU_ISA"):
        want.pop("ONEDNN_MAX_CPU_ISA")
    out = {k: v for k, v in want.items() if not env.get(k)}
    env.update(out)
    return out


def _torch_flags() -> tuple[set[str] | None, dict[str, bool]]:
    """torch's view: its cpuinfo capabilities (``None``: none) and its ``_is_*_supported`` checks."""
    import torch

    caps = getattr(torch.cpu, "get_capabilities", None)
    got = None
    if caps is not None:
        c = caps()
        got = {f for f in FLAGS if c.get(_TORCH_NAMES.get(f, f))}
    checks = {}
    for flag, fn in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_tile", "_is_amx_tile_supported"),
                     ("avx512_vnni", "_is_vnni_supported")):
        if hasattr(torch.cpu, fn):
            checks[flag] = bool(getattr(torch.cpu, fn)())
    return got, checks


def build_profile(cpu_flags: Iterable[str], cap: str, aten_capability: str,
                  environ: Mapping[str, str] | None = None) -> CpuProfile:
    """The profile of ``cpu_flags`` under ``cap``, with ATen's reported capability; oneDNN's
    cap read from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    cpu_flags = set(cpu_flags)
    klass, f = capped(cpu_flags, cap)
    onednn_cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip() or None
    return CpuProfile(isa=klass, native_isa=isa_class(cpu_flags), cap=cap, **{k: k in f for k in FLAGS},
                      aten_capability=aten_capability, onednn_isa=onednn_min(onednn_isa_of(f), onednn_cap),
                      onednn_cap=onednn_cap)


@functools.lru_cache(maxsize=1)
def profile() -> CpuProfile:
    """The running process's profile (read once): /proc/cpuinfo's flags (torch's cpuinfo where
    there is none), less what torch's own checks deny (AMX without the OS's permission), under
    ``$PAGEDKV_CPU_ISA``. Raises ``ConfigError`` for a bad or too-high cap."""
    import torch

    cap = parse_cap(os.environ.get(ENV))
    flags = read_cpuinfo()
    tflags, checks = _torch_flags()
    if flags is None:
        flags = tflags or set()
    flags = {f for f in flags if checks.get(f, True)}
    if not checks.get("amx_tile", True):
        flags -= {"amx_int8", "amx_bf16"}
    return build_profile(flags, cap, str(torch.backends.cpu.get_cpu_capability()))


def march_flags() -> list[str]:
    """The C kernels' ``-march``: ``-march=x86-64-v3`` under ``PAGEDKV_CPU_ISA=avx2``, else
    ``-march=native``. Reads only the environment (no torch)."""
    try:
        cap = parse_cap(os.environ.get(ENV))
    except ConfigError:
        cap = "native"
    return [MARCH_AVX2] if cap == "avx2" else ["-march=native"]
