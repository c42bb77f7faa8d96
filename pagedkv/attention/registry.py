"""Attention backends by name: the engine picks one with ``get_backend(name)``.

Names (see ``list_backends()``):

* ``reference``, ``reference-hnd``, ``reference-ascend``: the gather + softmax oracle in each
  layout (slow; for tests).
* ``cpu`` (default, NHD), ``cpu-hnd``, ``cpu-ascend``: the fast CPU path in each layout.
* ``triton``: Triton kernels, NHD layout (an NVIDIA GPU, or ``TRITON_INTERPRET=1`` on CPU).
"""

from __future__ import annotations

from typing import Callable

from pagedkv.attention.base import AttentionBackend
from pagedkv.errors import ConfigError

DEFAULT_BACKEND = "cpu"


def _reference(layout: str) -> Callable[[], AttentionBackend]:
    def make() -> AttentionBackend:
        from pagedkv.attention.reference import ReferenceBackend

        return ReferenceBackend(layout)

    return make


def _cpu(layout: str) -> Callable[[], AttentionBackend]:
    def make() -> AttentionBackend:
        from pagedkv.attention.cpu import CPUBackend

        return CPUBackend(layout)

    return make


def _triton() -> AttentionBackend:
    from pagedkv.attention.triton_backend import TritonBackend

    return TritonBackend()


# name -> (factory, layout, one-line description)
_BACKENDS: dict[str, tuple[Callable[[], AttentionBackend], str, str]] = {
    "reference": (_reference("nhd"), "nhd", "gather + float32 softmax oracle"),
    "reference-hnd": (_reference("hnd"), "hnd", "oracle, HND layout"),
    "reference-ascend": (_reference("ascend"), "ascend", "oracle, Ascend-style flattened layout"),
    "cpu": (_cpu("nhd"), "nhd", "fast CPU path (C decode kernel + matmul prefill)"),
    "cpu-hnd": (_cpu("hnd"), "hnd", "fast CPU path, HND layout"),
    "cpu-ascend": (_cpu("ascend"), "ascend", "fast CPU path, Ascend-style flattened layout"),
    "triton": (_triton, "nhd", "Triton kernels: split-K decode + paged prefill (GPU; interpreter on CPU)"),
}


def register_backend(name: str, factory: Callable[[], AttentionBackend], layout: str, description: str = "") -> None:
    """Add (or replace) a backend so that ``get_backend(name)`` and the conformance kit see it."""
    _BACKENDS[name] = (factory, layout, description)


def list_backends() -> list[str]:
    """Names accepted by ``get_backend``, in registration order."""
    return list(_BACKENDS)


def backend_info(name: str) -> dict[str, str]:
    """``{"name", "layout", "description"}`` of a registered backend (``ConfigError`` if unknown)."""
    _check(name)
    _, layout, desc = _BACKENDS[name]
    return {"name": name, "layout": layout, "description": desc}


def _check(name: str) -> None:
    if name not in _BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; valid: {', '.join(_BACKENDS)}")


def get_backend(name: str = DEFAULT_BACKEND) -> AttentionBackend:
    """A new instance of the backend called ``name``.

    Raises ``ConfigError`` (a ``ValueError``) for an unknown name, listing the valid ones, and
    ``BackendError`` when the backend cannot run here (e.g. Triton missing).
    """
    if not isinstance(name, str):
        raise ConfigError(f"attention backend name must be a str, got {name!r}")
    _check(name)
    return _BACKENDS[name][0]()
