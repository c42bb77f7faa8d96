"""Batch-invariant dense matmuls: a row's result must not depend on how many rows share the call
(docs/determinism.md).

pagedkv's own kernels are batch-invariant by construction: the integer matmuls (``qmm``:
per-row int8 activation scales, exact int32 block sums, one fixed order per output column)
and the paged attention kernel (``pagedkv/csrc/cpu_kernel.c``: tiles at absolute key
positions). The dense float32/bf16 layers go to the BLAS library under ``F.linear`` (MKL /
oneDNN), which picks its kernel, and with it the order of each dot product's sums, by the
row count: measured on x86 hosts (AVX2, AVX-512), float32 has three classes, 1 row, 2-3 rows
and 4 or more rows (the same results for every row count >= 4 and any thread count), and
bfloat16 two (1 row, >= 2 rows). ``linear`` therefore pads an input of fewer than
``ROW_FLOOR`` rows with zero rows, so every call runs the >= 4-row kernel.
``tests/engine/test_determinism.py`` checks the classes on the host running it.

Padding is not free: float32 batch-1 decode runs ~0.69x as fast (a 4-row GEMM instead of a
GEMV; docs/benchmarks/determinism.md), so the engine does it only with ``deterministic=True``,
which also keeps the int8/int4 formats on ``qmm`` at every row count on AMX hosts (their oneDNN
dynamic-int8 and wide bf16 routes, chosen by row count, sum differently).
:func:`batch_invariant` says whether a loaded model is invariant as it stands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: inputs of fewer rows than this are padded to it (see the module doc)
ROW_FLOOR = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[T, in]`` whose rows are bit-identical for any
    ``T``: fewer than ``ROW_FLOOR`` rows are padded with zero rows (dropped from the result).
    Other ranks, and graphs being traced by ``torch.compile`` (``compile_decode``: its graphs
    are specialised to row counts, docs/determinism.md), go straight to ``F.linear``."""
    if torch.compiler.is_compiling():  # first: a shape test here would be a guard of the graph
        return F.linear(x, weight, bias)
    n = x.shape[0]
    if x.dim() != 2 or n >= ROW_FLOOR or n == 0:
        return F.linear(x, weight, bias)
    xp = x.new_zeros((ROW_FLOOR, x.shape[1]))
    xp[:n] = x
    return F.linear(xp, weight, bias)[:n]


class RowFloorLinear(nn.Linear):
    """``nn.Linear`` through :func:`linear` (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def batch_invariant(model: nn.Module) -> tuple[bool, str]:
    """``(True, "")`` when every linear layer of ``model`` is batch-invariant as prepared:
    ``qmm`` at every row count, or padded dense layers; else ``(False, what is not)``."""
    from pagedkv.ops.qmm import ALL_ROWS

    from pagedkv.model.mla import MLAttention

    bad: list[str] = []
    for m in model.modules():
        if isinstance(m, MLAttention):
            bad.append("multi-head latent attention (its absorbed or expanded form, and the native step, "
                       "chosen by a chunk's rows)")
        if type(m) is nn.Linear:
            bad.append("dense layers (F.linear)")
        elif callable(getattr(m, "set_deterministic", None)) and not m.deterministic \
                and getattr(m, "qmm_rows", 0) < ALL_ROWS:
            bad.append(f"{m.fmt} layers (kernels by row count)")
    if getattr(model, "lm_head", 1) is None and not getattr(model, "deterministic", False):
        bad.append("the tied LM head (F.linear)")
    return (not bad, ", ".join(dict.fromkeys(bad)))


def set_deterministic(model: nn.Module, on: bool) -> None:
    """Make ``model``'s dense layers batch-invariant (``on``) or the BLAS's fastest (``off``):
    ``nn.Linear`` modules become :class:`RowFloorLinear` and back, quantised layers
    (``pagedkv.model.quant.QuantLinear``) get ``deterministic`` (re-prepared where that
    changes their route: int8/int4 on AMX hosts), and the model's tied LM head follows
    ``model.deterministic``."""
    for m in model.modules():
        if type(m) is nn.Linear and on:
            m.__class__ = RowFloorLinear
        elif type(m) is RowFloorLinear and not on:
            m.__class__ = nn.Linear
        elif callable(getattr(m, "set_deterministic", None)):  # a QuantLinear
            m.set_deterministic(on)
    model.deterministic = on
