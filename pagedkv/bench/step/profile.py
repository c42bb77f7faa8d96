"""Where one engine step's time goes, measured with ``torch.profiler`` (no hand timers).

The engine labels its phases with ``pagedkv.utils.profile_scope`` (``pagedkv.schedule``,
``.prepare``, ``.forward``, ``.attention``, ``.logits``, ``.sample``, ``.update``, ``.output``);
this module runs steps under the profiler and splits each step into:

* ``linear``: self time of the matmul ops inside ``pagedkv.forward`` but outside attention
  (the decoder's projections: weight bytes dominate at small batch). In a compiled step
  (``compile_decode``, inductor's C++ wrapper) a matmul is an extern call that the profiler
  sees only as ``aoti_torch_cpu_<op>_out``, and only when the graph was generated with
  ``torch._inductor.config.cpp.enable_kernel_profile`` (:func:`recording_compiled_kernels`);
  without it the whole graph is one event and its matmuls land in ``other_ops``;
* ``attention``: the ``pagedkv.attention`` regions (K/V write + paged attention);
* ``other_ops``: the rest of the forward pass (norms, RoPE, activations, residual adds, the
  per-layer Python between them);
* ``logits_sampling``: the LM head on the sampled rows plus the sampler;
* ``host``: scheduler, KV manager, input preparation, update and output processing, and the
  wall time no region covers.

Times are milliseconds per step; profiled steps run slower than plain ones, so the plain
step time is measured too (same steps, no profiler).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch

#: aten ops counted as "linear" (plain and quantised matmul kernels).
LINEAR_OPS = {
    "aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
    "aten::_int_mm", "aten::_weight_int4pack_mm", "quantized::linear_dynamic", "aten::mkldnn_linear",
    "mkldnn::_linear_pointwise", "aten::_mkl_linear", "aten::bmm",
    "onednn::qlinear_pointwise", "pagedkv::int8_linear", "pagedkv::qmm_linear",  # dynamic int8 (pagedkv.model.quant)
}
#: how inductor's C++ wrapper names an extern call of ``aten::<op>`` in the profiler
AOTI_PREFIX, AOTI_SUFFIX = "aoti_torch_cpu_", "_out"
REGIONS = ("pagedkv.schedule", "pagedkv.prepare", "pagedkv.forward", "pagedkv.attention",
           "pagedkv.logits", "pagedkv.sample", "pagedkv.update", "pagedkv.output")
CATEGORIES = ("linear", "attention", "other_ops", "logits_sampling", "host")


def is_linear_op(name: str) -> bool:
    """Whether a profiler event ``name`` is a matmul kernel: an aten op of :data:`LINEAR_OPS`,
    or its extern call in a compiled graph (``aoti_torch_cpu__int_mm_out`` is
    ``aten::_int_mm``)."""
    if name.startswith(AOTI_PREFIX):
        op = name[len(AOTI_PREFIX):]
        name = "aten::" + (op[: -len(AOTI_SUFFIX)] if op.endswith(AOTI_SUFFIX) else op)
    return name in LINEAR_OPS


@contextlib.contextmanager
def recording_compiled_kernels() -> Iterator[None]:
    """Graphs compiled inside this block record each generated kernel and extern call under
    the profiler (``torch._inductor.config.cpp.enable_kernel_profile``), so :func:`breakdown`
    can find the matmuls inside a compiled step. Not for timing: the records cost ~0.7 ms
    per batch-1 step even with no profiler running (measured: 9.3 vs 8.5 ms), so the plain
    steps run the uninstrumented graphs (:func:`profile_steps`' ``profiled``)."""
    import torch._inductor.config as inductor_config

    before = inductor_config.cpp.enable_kernel_profile
    inductor_config.cpp.enable_kernel_profile = True
    try:
        yield
    finally:
        inductor_config.cpp.enable_kernel_profile = before


def copy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best measured copy bandwidth (bytes/s, read + write) of one fp32 tensor copy."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * num_bytes / best


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """Best measured fp32 matmul rate (FLOP/s) of an ``n x n`` by ``n x n`` product."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    best = min(_timed(lambda: torch.mm(a, b, out=out)) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def linear_params(model: torch.nn.Module) -> tuple[int, int]:
    """``(decoder linear weight elements, LM head elements)`` of a pagedkv Llama-family model,
    from its config (the same whatever format the weights are stored in)."""
    c = model.config
    h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    dec = c.num_layers * (h * (q + 2 * kv) + q * h + 2 * i * h + i * h)
    head = c.vocab_size * h
    return dec, head


def weight_bytes(dec: int, head: int, group_size: int = 32) -> dict[str, int]:
    """Bytes read per step by the linear layers and the LM head, per weight format: fp32,
    bf16; int8 with one fp32 scale per output row (nominal, rows ~ elements / 576); int4 with
    a 2-byte scale and a 2-byte minimum per ``group_size`` values (the Q4_1 layout)."""
    total = dec + head
    return {
        "fp32": 4 * total,
        "bf16": 2 * total,
        "int8": total + 4 * (total // 576),
        "int4": total // 2 + 4 * (total // group_size),
    }


def _region_of(ev: Any) -> str | None:
    """Innermost pagedkv region enclosing ``ev`` (itself excluded)."""
    p = ev.cpu_parent
    while p is not None:
        if p.name in REGIONS:
            return p.name
        p = p.cpu_parent
    return None


def breakdown(events: Iterable[Any], wall_s: float, num_steps: int) -> dict[str, float]:
    """Milliseconds per step in each of :data:`CATEGORIES` from profiler ``events`` of
    ``num_steps`` steps that took ``wall_s`` seconds in all (under the profiler)."""
    region_total = {r: 0.0 for r in REGIONS}
    linear = 0.0
    for ev in events:
        if ev.name in REGIONS and _region_of(ev) != ev.name:
            region_total[ev.name] += ev.cpu_time_total
        elif is_linear_op(ev.name) and _region_of(ev) == "pagedkv.forward":
            linear += ev.self_cpu_time_total
    us = 1e3 * num_steps  # microseconds -> ms per step
    fwd, att = region_total["pagedkv.forward"] / us, region_total["pagedkv.attention"] / us
    out = {
        "linear": linear / us,
        "attention": att,
        "other_ops": max(fwd - att - linear / us, 0.0),
        "logits_sampling": (region_total["pagedkv.logits"] + region_total["pagedkv.sample"]) / us,
    }
    covered = sum(region_total[r] for r in REGIONS if r != "pagedkv.attention") / us
    named_host = sum(region_total[r] for r in ("pagedkv.schedule", "pagedkv.prepare",
                                                "pagedkv.update", "pagedkv.output")) / us
    out["host"] = named_host + max(wall_s * 1e3 / num_steps - covered, 0.0)
    return out


def profile_steps(step: Callable[[], Any], num_steps: int, warmup: int = 2,
                  profiled: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                  ) -> tuple[float, dict[str, float]]:
    """Run ``step`` ``warmup`` times untimed (first calls of a batch shape pay one-off costs),
    ``num_steps`` times plainly, then (inside ``profiled()``, say one that swaps in
    instrumented compiled graphs) ``warmup`` + ``num_steps`` times, the last ``num_steps``
    under the profiler. Returns ``(median plain ms per step, breakdown ms per step)``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    times = []
    for _ in range(num_steps):
        times.append(_timed(step))
    plain = statistics.median(times) * 1e3
    with profiled():
        for _ in range(warmup):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(num_steps):
                step()
            wall = time.perf_counter() - t
    return plain, breakdown(prof.events(), wall, num_steps)


def step_limit(bytes_moved: float, flops: float, bandwidth: float, peak: float) -> dict[str, float]:
    """The step's lower bound (ms): the larger of bytes / bandwidth and FLOPs / peak."""
    mem, comp = bytes_moved / bandwidth * 1e3, flops / peak * 1e3
    return {"memory_ms": mem, "compute_ms": comp, "limit_ms": max(mem, comp),
            "bound": "memory" if mem >= comp else "compute"}
