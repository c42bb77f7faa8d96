"""The step strategy: how a model's steps run, chosen once at start and logged.

One eager reference path and the fast path the attention backend declares (its
``capabilities``, a ``pagedkv.attention.base.BackendCapabilities``; nothing is probed):

* ``eager``: torch ops per layer, attention through the backend (its ``write_and_forward``
  where declared, else ``write_kv`` then ``forward``). Always available: the reference.
* ``fused``: the same layers with the fused element-wise CPU ops (``pagedkv.ops.fused_ops``:
  norms, RoPE, activation), for a float32 CPU model whose layers allow them.
* ``native``: every layer of a step in one ``decoder.c`` call (``pagedkv.model.native_step``),
  where the backend declares ``native_step`` and every layer runs on the integer kernels; the
  steps it declines (more rows than those kernels take, per-layer metadata, a profiler) run
  ``fused``.
* ``compiled``: ``torch.compile``'d steps (``compile_decode=True``, ``pagedkv.model.compiled``),
  attention through the backend's ``step_attention`` where declared; the steps it does not
  accept run the model's own path (which the reason names).

``PAGEDKV_STEP_STRATEGY=eager`` forces the reference path for the fused and native steps
(``auto``, the default, takes the fastest that applies). A model with attention sinks (gpt-oss)
needs a backend that declares ``attention_sinks`` (the cpu backend's C kernel takes them, so its
fused layers and the native step do; compiled step attention declines the ``sinks`` option). :func:`choose_step_strategy` runs at
engine start (``pagedkv.engine.engine.LLMEngine``, which logs ``step strategy: <name>
(<reason>)``); a model used without an engine decides at its first forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pagedkv.attention.base import backend_capabilities
from pagedkv.errors import ConfigError

#: the fused ops' and native step's state under the eager step strategy (``model.fused_state``)
EAGER_STEP = "off (eager step strategy)"
#: the strategies, the reference first
STRATEGIES = ("eager", "fused", "native", "compiled")
#: the values of ``$PAGEDKV_STEP_STRATEGY``
OVERRIDES = ("auto", "eager")


@dataclass(frozen=True)
class StepStrategy:
    """How the steps run: ``name`` one of :data:`STRATEGIES`, ``reason`` why, in words."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def requested_override() -> str:
    """``$PAGEDKV_STEP_STRATEGY`` (``auto`` when unset). Raises ``ConfigError`` for a value
    not in :data:`OVERRIDES`."""
    value = os.environ.get("PAGEDKV_STEP_STRATEGY", "").strip().lower() or "auto"
    if value not in OVERRIDES:
        raise ConfigError(f"PAGEDKV_STEP_STRATEGY must be one of {', '.join(OVERRIDES)}, got {value!r}")
    return value


def choose_step_strategy(model: Any, backend: Any, compiled: Any = None, eager: bool | None = None) -> StepStrategy:
    """Choose ``model``'s step strategy once, now: attaches the fused ops and the native step
    (``model.prepare_step``; with ``eager`` neither) and returns what the steps run.
    ``model``: a ``pagedkv.model.llama.LlamaForCausalLM``; ``backend``: its attention backend;
    ``compiled``: the runner's ``CompiledDecode`` or ``None``; sets ``model.step_route`` to the
    path the model's own forward runs (``native``, ``fused`` or ``eager``: the compiled steps are
    the runner's, and the steps they do not take run that path); ``eager``: ``None`` reads
    :func:`requested_override`. Raises ``ConfigError`` for a bad ``$PAGEDKV_STEP_STRATEGY``, or
    a model with attention sinks on a backend that does not declare ``attention_sinks``."""
    if eager is None:
        eager = requested_override() == "eager"
    caps = backend_capabilities(backend)
    if getattr(getattr(model, "config", None), "attention_sinks", False) and not caps.attention_sinks:
        raise ConfigError(f"attention backend {backend.name!r} does not implement attention sinks (gpt-oss): "
                          "use the cpu or reference backend")
    name = backend.name
    model.prepare_step(eager=eager)
    if eager:
        own = StepStrategy("eager", "PAGEDKV_STEP_STRATEGY=eager: torch ops per layer")
    elif model.native_state == "on" and caps.native_step:
        own = StepStrategy("native", f"decoder.c runs a step's layers in one call; backend {name} declares "
                                     "native_step; steps it declines run fused")
    elif model.fused_state == "on" and any(getattr(layer, "fused", None) is not None for layer in model.layers):
        why = f"backend {name} declares no native_step" if not caps.native_step else f"native step {model.native_state}"
        own = StepStrategy("fused", f"fused CPU ops per layer; {why}")
    else:
        why = model.fused_state if model.fused_state != "on" else "on, but no layer takes them"
        own = StepStrategy("eager", f"torch ops per layer; fused ops {why}")
    model.step_route = own.name  # what model.forward dispatches on (the compiled steps' fallback too)
    if compiled is None:
        return own
    if compiled.failed is not None:
        return StepStrategy(own.name, f"compiled steps off: {compiled.failed}; {own.reason}")
    attention = "the backend's step_attention" if caps.step_attention else "per-layer attention"
    return StepStrategy("compiled", f"torch.compile'd steps of up to {compiled.max_rows} rows with {attention}; "
                                    f"other steps {own.name}")
