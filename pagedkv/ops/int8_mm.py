"""Dynamic int8 matmuls of the quantised linear layers (``pagedkv.model.quant``): activation
rows quantised on the fly to two int8 rows, one int8 x int8 matmul with exact int32 sums.

The matmul is oneDNN's u8s8 linear on weights prepacked once per layer, reached through one
opaque op, ``pagedkv::int8_linear(qx, key, out_features)``, that finds the layer by key, so
that compiled steps call it too (measured in docs/performance.md, "Prepacked int8"). The
same registry gives ``pagedkv::qmm_linear``, the integer kernels of ``pagedkv.ops.qmm`` as one
op. The layers register themselves (``register_int8``); this module imports none of them.
"""

from __future__ import annotations

import atexit
import itertools
import weakref
from typing import Any

import torch


def onednn_int8() -> bool:
    """Whether torch's oneDNN int8 linear (``onednn.qlinear_prepack`` / ``qlinear_pointwise``)
    is built in: prepacked weights, no per-call reorder. Its sums are exact only with VNNI or
    AMX-INT8 (``quant.CpuFeatures.int8_exact``, which gates the route)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


# ``pagedkv::int8_linear``: the int8 x int8 matmul of ``dynamic_int8_mm`` as one opaque op, so
# that a compiled step calls oneDNN with the prepacked weights the module holds (inductor keeps
# prepacked weights only for the patterns of its own quantisation flow; it cannot take them as
# inputs). The quantisation around the op stays in the graph (fused by inductor).
_LIB = torch.library.Library("pagedkv", "FRAGMENT")
_LIB.define("int8_linear(Tensor qx, int key, int out_features) -> Tensor")
_INT8_MODULES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_INT8_KEYS = itertools.count()


def register_int8(module: Any) -> int:
    """A new key under which ``pagedkv::int8_linear`` finds ``module`` (a ``QuantLinear``
    with prepared int8 weights; held weakly)."""
    key = next(_INT8_KEYS)
    _INT8_MODULES[key] = module
    return key


@atexit.register
def _release_prepacked() -> None:
    """Drop the prepacked oneDNN weights while the interpreter is whole: freed during final
    teardown instead, after oneDNN's own state may be gone, they can crash the exit (one
    full-suite run segfaulted after its last test)."""
    for module in list(_INT8_MODULES.values()):
        module.release_int8()


def _layer_op(name: str, what: str, call: str) -> None:
    """Register ``pagedkv::{name}(Tensor x, int key, int out_features) -> Tensor`` (defined
    above): the layer registered under ``key`` runs its method ``call`` on ``x``; the fake
    (for tracing) is a float32 ``[rows, out_features]``. An unknown key is a ``RuntimeError``
    naming ``what`` was looked for."""

    def impl(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
        module = _INT8_MODULES.get(key)
        if module is None:
            raise RuntimeError(f"pagedkv::{name}: no prepared {what} under key {key}")
        return getattr(module, call)(x)

    def fake(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features), dtype=torch.float32)

    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"pagedkv::{name}")(fake)


_layer_op("int8_linear", "int8 weights", "int8_matmul")

# ``pagedkv::qmm_linear``: the integer kernels of ``pagedkv.ops.qmm`` on a layer's packed
# weights (``QuantLinear.qmm_forward``), opaque to compiled steps in the same way
_LIB.define("qmm_linear(Tensor x, int key, int out_features) -> Tensor")
_layer_op("qmm_linear", "layer", "qmm_forward")


def dynamic_int8_mm(x: torch.Tensor, module: Any) -> torch.Tensor:
    """``x`` float ``[T, in]`` times ``module``'s int8 weights (per-output-channel scales) ->
    float32 ``[T, out]``. Each row of ``x`` becomes two int8 rows: ``q1 = round(x / s)`` with
    ``s = max|row| / 127`` and the remainder ``q2 = round((x - s * q1) / (s / 254))``, so the
    activations keep ~15 bits (one int8 row per token cost +9% perplexity on the bundled
    model: activation outliers); one int8 matmul of the ``[2T, in]`` rows with exact int32
    sums (``QuantLinear.int8_matmul``, which applies the weight scales), then ``(acc1 +
    acc2 / 254) * s``."""
    x = x.float()
    t = x.shape[0]
    s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0
    q1 = torch.round(x / s)
    q2 = torch.round((x - q1 * s) * (254.0 / s))
    qx = (torch.cat([q1, q2]) + 128.0).to(torch.uint8)  # offset codes: oneDNN's u8 x s8
    acc = torch.ops.pagedkv.int8_linear(qx, module.int8_key, module.out_features)
    out = acc[:t]  # in place from here: fewer passes over [T, out] (eager)
    out.add_(acc[t:], alpha=1.0 / 254.0)
    return out.mul_(s)
