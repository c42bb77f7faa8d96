"""Compiled decode steps: the decoder's torch ops through ``torch.compile`` (inductor's C++ code
generation, with its C++ wrapper), attention kept as one custom op per layer.

On a CPU a batch-1 decode step of a small model is mostly Python: about a hundred torch calls
per layer, each cheap alone (docs/performance.md). Compiled, a step is one call into generated
C++ that runs the matmuls (the same int4/int8/bf16/fp32 kernels as eager), fuses the
element-wise ops between them, and calls one attention op per layer: ``pagedkv::layer_attention``
(Python) writes the layer's K/V through ``slot_mapping`` and attends over its block table with
the engine's backend (``backend.write_kv`` + ``backend.forward``), exactly as the eager path
does. A backend with ``step_attention`` (the CPU one) gives each step one callback that does
the per-step checks once and sends later layers straight to its kernel; where the C++ op
``pagedkv::step_layer_attention`` builds (``pagedkv.ops.step_op``) the graph calls that
instead, and the layers whose kernel arguments the step has prepared reach the C kernel
without Python (the rest go on to the Python op).
The graph never sees the KV cache or the metadata, so one graph serves every batch
composition, block table and context length.

Graphs: one for a single row (batch-1 decode), one with the row count dynamic (2 ..
``max_rows``; the engine passes its step token budget, ``max_num_batched_tokens``, so prefill
chunks and mixed prefill + decode steps run compiled too), split where a quantised linear
changes kernel (int4/int8: 2-7 rows weight-only, 8 rows and more dynamic int8). Steps above
``max_rows`` run eagerly. :meth:`CompiledDecode.warm_up` compiles them all at start-up (about
80 s each the first time on a 2-core machine, seconds once inductor's cache under
``~/.cache/pagedkv/inductor`` holds them). If compilation fails (no C++ compiler, an
unsupported op) the model falls back to eager and says why (``failed``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import threading
import types
from typing import Any, Callable, Sequence

import torch

from pagedkv import cpu_isa
from pagedkv.attention.base import AttentionBackend, AttentionMetadata, backend_capabilities
from pagedkv.errors import BackendError

logger = logging.getLogger(__name__)
_INSTANCES = itertools.count()
_STEP_OPTIONS = {"sliding_window", "logits_soft_cap"}  # the layer options step_attention takes


def route_boundaries(model: torch.nn.Module) -> list[int]:
    """Sorted row counts (2 .. ``KERNEL_ROWS + 1``) at which some prepared quantised linear of
    ``model`` changes kernel (``QuantLinear.kernel``; in int8/int4 on the fast route:
    ``int8_rows`` and ``KERNEL_ROWS + 1``; bf16: ``BF16_QMM_ROWS``). A compiled step branches
    on them, so each range needs a graph of its own (:meth:`CompiledDecode.warm_up_sizes`)."""
    from pagedkv.model.quant import KERNEL_ROWS, QuantLinear

    out: set[int] = set()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            kernels = [m.kernel(r) for r in range(1, KERNEL_ROWS + 2)]
            out.update(r for r in range(2, KERNEL_ROWS + 2) if kernels[r - 1] != kernels[r - 2])
    return sorted(out)


class StepContext(threading.local):
    """The one context through which a compiled step's attention reaches its KV caches and
    metadata. Everywhere else (eager forward, the native one-call step) caches and
    ``AttentionMetadata`` travel as arguments; a compiled graph cannot take them (one graph
    serves every block table and context length), so :meth:`CompiledDecode._run` sets
    ``attend`` for the duration of one step on the calling thread and clears it after, error
    or not. ``attend(layer, q, k, v) -> out`` closes over that step's caches, metadata and
    backend. Its C++ half is the attention backend's ``StepTable`` (``pagedkv.attention.
    step_op``): the same step's prepared kernel arguments, begun by the backend's
    ``step_attention`` and ended by ``CompiledDecode.__call__`` in a ``finally``.
    ``error`` keeps an exception raised inside the graph (inductor's wrapper replaces it)."""

    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    error: BaseException | None = None


#: the per-thread step context (see :class:`StepContext`); the only one in the step path
STEP_CONTEXT = StepContext()


# Defined with the low-level ``torch.library.Library`` API rather than ``torch.library.custom_op``:
# the latter's wrapper (alias checks, autograd plumbing) cost ~9 us per call against ~2.4 us,
# times 30 layers per step. The op's schema says it mutates nothing: the KV cache it writes is
# not a graph input (the graph never sees it).
_LIB = torch.library.Library("pagedkv", "FRAGMENT")
_LIB.define("layer_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")


def layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s paged attention inside a compiled step: ``q`` ``[T, Hq, d]``, ``k``/``v``
    ``[T, Hkv, d]`` -> ``[T, Hq, d]`` (writes k/v into the layer's cache). Raises
    ``RuntimeError`` outside :meth:`CompiledDecode.__call__`."""
    attend = STEP_CONTEXT.attend
    if attend is None:
        raise RuntimeError("pagedkv::layer_attention runs only inside a compiled decode step")
    try:
        out = attend(layer, q, k, v)
    except BaseException as exc:
        # inductor's C++ wrapper turns an error raised in here into a RuntimeError of its own
        # (type and message lost): kept here, re-raised as itself by CompiledDecode._run
        STEP_CONTEXT.error = exc
        raise
    # the graph is compiled without inductor's size asserts (CompiledDecode): it reads the
    # result as a contiguous q-shaped tensor, so that is what it gets, or an error
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        STEP_CONTEXT.error = BackendError(f"layer {layer}: attention returned {out.dtype} {tuple(out.shape)} on "
                                   f"{out.device}, expected {q.dtype} {tuple(q.shape)} on {q.device}")
        raise STEP_CONTEXT.error
    return out if out.is_contiguous() else out.contiguous()


_LIB.impl("layer_attention", layer_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("pagedkv::layer_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


def _attend_for(op) -> Callable[[int], Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    return lambda i: lambda q, k, v: op(q, k, v, i)


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled code: ``$TORCHINDUCTOR_CACHE_DIR`` if set, else
    ``$PAGEDKV_CACHE_DIR/inductor/<cpu profile>`` (default ``~/.cache/pagedkv/...``), set here.

    One folder per CPU profile (:func:`profile_cache_tag`): inductor's graph cache does not
    key its entries by ATen's CPU capability, and a graph compiled under one profile and
    loaded under another computed garbage (native AVX-512 graphs under
    ``PAGEDKV_CPU_ISA=avx2``: zero/NaN hidden states) or corrupted the heap (the reverse), the
    same as a cache directory shared by hosts of two CPU classes would."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        base = os.environ.get("PAGEDKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedkv")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, "inductor", profile_cache_tag())
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def profile_cache_tag(prof: Any = None) -> str:
    """``<class>-<hash>`` of a CPU profile (``pagedkv.cpu_isa.profile()`` by default): the
    class in effect, then 12 hex digits of everything the compiled code depends on (flags,
    cap, ATen's and oneDNN's ISA, the C kernels' -march)."""
    prof = cpu_isa.profile() if prof is None else prof
    digest = hashlib.sha256(json.dumps(prof.as_dict(), sort_keys=True).encode()).hexdigest()[:12]
    return f"{prof.isa}-{digest}"


class CompiledDecode:
    """The compiled forward of ``model`` (a ``LlamaForCausalLM``) for steps of 1 ..
    ``max_rows`` tokens: it traces the model's torch-op body (``forward_with``) once and is
    called in place of ``model.forward`` by its owner, the model runner
    (``pagedkv.worker.runner.ModelRunner.compile_steps``), for the steps :meth:`accepts`."""

    def __init__(self, model: torch.nn.Module, max_rows: int = 64) -> None:
        self.model = model
        self.max_rows = max_rows
        self.failed: str | None = None  # why compiled steps stopped (eager from then on)
        if any(getattr(layer, "mlp", None) is not None for layer in model.layers):
            # data-dependent expert loops (pagedkv.model.moe) are not traced: MoE models run eager
            self.failed = "mixture-of-experts layers run eager"
        self.steps = 0  # steps run compiled
        self._options: list[tuple[float, int | None, float | None]] | None = None  # per layer, for step_attention
        self.cache_dir = inductor_cache_dir()
        from pagedkv.ops import onednn_bf16

        for m in model.modules():  # bf16 layers: plain weights, which freezing prepacks in the graph
            if isinstance(m, onednn_bf16.PrepackedMixin):
                m.keep_plain()
        # the graph's attention op: the C++ one (pagedkv.ops.step_op) where it builds,
        # which runs prepared layers without Python and hands the rest to the Python op
        from pagedkv.ops import step_op

        self._table = step_op.get()
        self._op = self._table.op if self._table is not None else torch.ops.pagedkv.layer_attention
        if self._table is None and not os.environ.get("PAGEDKV_STEP_OP", "1") == "0":
            logger.warning("compiled steps call attention through Python (~0.7 ms a batch-1 step more): %s",
                           step_op.build_error())
        # freezing: the weights are constants of the graph (inference only), which drops them
        # from the per-call inputs and guards (measured 13.5 vs 14.5 ms per batch-1 int4 step)
        # no guards on the model's modules: dynamo otherwise checks ~1,000 module attributes and
        # ~300 weight tensors before every step (measured 0.80 -> 0.05 ms per batch-1 step in
        # torch.profiler's "TorchDynamo Cache Lookup"). So the compiled steps assume the model
        # (its modules, their Python constants such as norm offsets, its weights) is not
        # modified after compile_decode: pagedkv never does. Guards on the inputs' shapes stay.
        # no size asserts: the generated code otherwise checks the sizes and strides of every
        # input (~300 weights) and of every extern kernel's output on each call (in-process A/B,
        # batch-1 int4 graph with attention stubbed: 11.08 -> 10.35 ms). The weights are fixed
        # (above), dynamo guards the inputs' shapes, the attention ops return contiguous
        # q-shaped tensors (checked in layer_attention; the C++ op allocates them itself), and
        # the other extern kernels (int4/int8 matmuls, pagedkv::int8_linear) return contiguous
        # outputs of the shapes their meta functions give (tests compare compiled and eager).
        # (PAGEDKV_SIZE_ASSERTS=1 keeps them, to check a new torch's kernels against the graph)
        opts = {"cpp_wrapper": True, "freezing": True, "size_asserts": os.environ.get("PAGEDKV_SIZE_ASSERTS") == "1",
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        # under a cap below this CPU's class (PAGEDKV_CPU_ISA=avx2 on an AVX-512 host, how the
        # suite runs as an AVX2 host) graphs loaded back from inductor's on-disk graph cache
        # computed zero/NaN hidden states while the same graphs compiled afresh were right:
        # capped processes compile every time (a cap is a test set-up, not a way to serve)
        prof = cpu_isa.profile()
        if prof.isa != prof.native_isa:
            opts["fx_graph_cache"] = False
        # ... and so each CompiledDecode traces a code object of its own: dynamo caches graphs
        # per code object, and without the module guards two models of one shape (say a
        # Llama- and a Gemma-style one, whose constants differ) would share the first's graphs
        code = CompiledDecode._traced.__code__
        code = code.replace(co_name=f"pagedkv_decode_{next(_INSTANCES)}")
        traced = types.MethodType(types.FunctionType(code, CompiledDecode._traced.__globals__, code.co_name), self)
        self._fn = torch.compile(traced, dynamic=None, options=opts)

    def _traced(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.forward_with(input_ids, positions, _attend_for(self._op))

    def accepts(self, rows: int) -> bool:
        """Whether a step of ``rows`` tokens runs compiled (not after a failure, not for tensor
        parallel shards, whose all-reduce stays eager)."""
        return (self.failed is None and 1 <= rows <= self.max_rows
                and all(layer.all_reduce is None for layer in self.model.layers))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[Any],
                 attn_metadata: AttentionMetadata | Sequence[AttentionMetadata],
                 backend: AttentionBackend) -> torch.Tensor | None:
        """``LlamaForCausalLM.forward``'s result, or ``None`` (caller runs eager) when the
        compiler failed; the failure is logged once and kept in ``failed``."""
        per_layer = not isinstance(attn_metadata, AttentionMetadata)
        layers = self.model.layers
        caps = backend_capabilities(backend)  # declared: the per-step fast path, the C++ table
        step_attention = backend.step_attention if caps.step_attention else None
        if step_attention is not None and not per_layer and not torch._C._autograd._profiler_enabled():
            if self._options is None:  # constants of the model (not modified after compile_decode)
                self._options = [] if any(set(layer.attn_options) - _STEP_OPTIONS for layer in layers) else [
                    (layer.scale, layer.attn_options.get("sliding_window"), layer.attn_options.get("logits_soft_cap"))
                    for layer in layers]  # [] (an option step_attention does not take): per-layer calls
            table = self._table if caps.step_table else None
            try:
                if not self._options:
                    fast = None
                elif table is not None:
                    fast = step_attention(kv_caches, attn_metadata, self._options, table=table)
                else:
                    fast = step_attention(kv_caches, attn_metadata, self._options)
                if fast is not None:  # None: the backend has no fast path for this step
                    return self._run(fast, input_ids, positions)
            finally:
                if table is not None:
                    table.end()  # what the step prepared points into its tensors

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return layers[i].attention(q, k, v, kv_caches[i], attn_metadata[i] if per_layer else attn_metadata, backend)

        return self._run(attend, input_ids, positions)

    def _run(self, attend: Callable[..., torch.Tensor], input_ids: torch.Tensor,
             positions: torch.Tensor) -> torch.Tensor | None:
        STEP_CONTEXT.attend, STEP_CONTEXT.error = attend, None
        try:
            out = self._fn(input_ids, positions)
            self.steps += 1
            return out
        except Exception as exc:  # noqa: BLE001 - a compiler failure means "run eager"
            raised = STEP_CONTEXT.error
            if raised is not None:  # attention's own error, which the graph's wrapper replaced
                raise raised from None
            if self._is_compile_error(exc):
                self.failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                logger.warning("compiled decode disabled, running eager: %s", self.failed)
                return None
            raise
        finally:
            STEP_CONTEXT.attend = STEP_CONTEXT.error = None

    @staticmethod
    def _is_compile_error(exc: Exception) -> bool:
        # torch._dynamo.exc.BackendCompilerFailed / InductorError / a C++ build error; an error
        # raised by the model's own code (a BackendError from attention) propagates unchanged
        mod = type(exc).__module__ or ""
        return mod.startswith(("torch._dynamo", "torch._inductor")) or "CppCompileError" in type(exc).__name__

    def warm_up_sizes(self) -> list[int]:
        """Row counts whose steps compile the graphs: 1 (specialised), 2 (the row count turns
        dynamic), and the first row of every range where a quantised linear changes kernel
        (:func:`route_boundaries`: the decode step branches there, and a range never seen
        would compile mid-serving, ~80 s on the bundled model)."""
        extra = [n for n in route_boundaries(self.model) if 2 < n <= self.max_rows]
        return [n for n in (1, 2) if n <= self.max_rows] + extra

    def warm_up(self, progress: bool = True) -> float:
        """Compile every graph now (one step of each of :meth:`warm_up_sizes` through a
        stand-in attention that returns zeros and writes nothing). Returns the seconds it took."""
        import time

        from tqdm import tqdm

        t0 = time.perf_counter()
        dev = self.model.device
        bar = tqdm(self.warm_up_sizes(), desc="compiling decode steps (cached after the first run)", unit="graph",
                   disable=not progress)
        for n in bar:
            # inputs made outside inference mode, as the runner makes them: dynamo guards on a
            # tensor's dispatch keys, and an inference tensor here would compile graphs that
            # the real steps then miss (and recompile)
            ids, positions = torch.zeros(n, dtype=torch.int64, device=dev), torch.zeros(n, dtype=torch.int64, device=dev)
            with torch.inference_mode():
                self._run(lambda i, q, k, v: torch.zeros_like(q), ids, positions)
            if self.failed is not None:
                break
        return time.perf_counter() - t0


def compile_decode(model: torch.nn.Module, max_rows: int = 64, progress: bool = True) -> CompiledDecode:
    """A warmed :class:`CompiledDecode` of ``model`` (what ``LLMEngine(compile_decode=True)``
    gives its runner). Compile failures are logged and leave it eager.

    One per model and ``max_rows``: a later engine over the same model gets the same object
    back. (dynamo keeps one cache per code object, at most ``torch._dynamo.config.
    cache_size_limit`` graphs; a fresh ``CompiledDecode`` per engine added two each time, and a
    process that built a few engines, a benchmark sweep, silently ran eager after the limit.)"""
    cd = getattr(model, "_pagedkv_compiled_decode", None)
    if isinstance(cd, CompiledDecode) and cd.model is model and cd.max_rows == max_rows and cd.failed is None:
        return cd
    cd = CompiledDecode(model, max_rows)
    if getattr(getattr(model, "config", None), "is_mla", False):  # pagedkv.model.mla has no traced form
        cd.failed = "MLA layers run eager"
        logger.info("compiled decode steps: off (%s)", cd.failed)
        return cd
    model._pagedkv_compiled_decode = cd
    if cd.failed is not None:  # a model that never runs compiled (a mixture of experts)
        logger.info("compiled decode steps off: %s", cd.failed)
        return cd
    seconds = cd.warm_up(progress)
    if cd.failed is None:
        logger.info("compiled decode steps of 1..%d tokens in %.1f s (cache %s)", max_rows, seconds, cd.cache_dir)
    return cd
