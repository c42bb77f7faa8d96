"""All decoder layers of an eager CPU step in one native call (``pagedkv/csrc/decoder.c``).

``DecoderLayer._forward_fused`` runs each layer as about nine kernel calls (norms, the
quantised matmuls, RoPE, attention, activation), each reached from Python through ctypes: at
batch 1 that interpreter work, ~10 us a call, was about a third of the step on an AVX2 host.
``NativeDecoder`` hands ``decoder.c`` the same kernels' addresses (``pagedkv.ops.qmm``,
``pagedkv.ops.fused_ops`` and the CPU attention kernel) and each layer's weights and caches once;
a step is then one call. Same kernels in the same order as the fused Python path, so the
same results bit for bit (tests/model/test_native_step.py).

It runs only where that path would run those kernels: a float32 Llama-family model on the
CPU whose layers are all fusable (q/k norms as Qwen3's and Gemma-3's; sandwich norms and the
local RoPE table of Gemma-2/3's sliding layers; an MoE layer with softmax routing and no shared experts, ``MoE.native_ok``, whose FFN decoder.c
runs: router, top-k, each routed expert's matmuls, in ``pagedkv.model.moe``'s order; every expert
read, so lazy experts not yet read keep it off) with every linear on the
integer kernels (``QuantLinear.qmm_rows`` above the step's rows), one attention metadata for
all layers or one per KV layer group (hybrid sliding-window caches), a backend that declares ``native_step`` in its capabilities
(``pagedkv.attention.cpu.CPUBackend``) and gives kernel arguments for the step, and no profiler running (profiles keep the per-layer
regions). Otherwise ``run`` returns ``False`` and the model takes its Python path.
``PAGEDKV_NATIVE_STEP=0`` turns it off.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import torch

from pagedkv.attention.base import AttentionMetadata, BackendError, backend_capabilities, check_window
from pagedkv.ops import decoder


class NativeDecoder:
    """The step loop of ``model``'s layers in C. Build with :meth:`create` (``None`` when the
    model cannot use it); :meth:`run` does one step or declines."""

    def __init__(self, model: Any, fn: Any, qmm_ops: Any, fused_ops: Any, attend: Any) -> None:
        from pagedkv.model import quant

        layers = model.layers
        first = layers[0]
        self.model, self._fn = model, fn
        self._prepared = quant.PREPARED  # the weights' buffers this was built on (a re-prepare: stale)
        # what the C structs point into, kept alive (an expert matrix replaced in place stays valid)
        self._alive = _alive(layers)
        self._slots = _slots(model)  # what stale() checks each step: (dict, key, object) identities
        self._lock = threading.Lock()  # one step at a time: the structs hold this step's cache pointers
        self.rows = min(m.qmm_rows for layer in layers for m in _linears(layer) + _experts(layer))
        self.hq, self.hkv, self.d = first.num_heads, first.num_kv_heads, first.head_dim
        self._options = [(float(layer.scale), *check_window(layer.attn_options.get("sliding_window"),
                                                            layer.attn_options.get("logits_soft_cap")))
                         for layer in layers]
        specs = [_layer_spec(layer, *opts) for layer, opts in zip(layers, self._options)]
        self._step = decoder.DecoderStep(
            fn, qmm_ops, fused_ops, attend, specs, first.input_layernorm.weight.shape[0], first.intermediate_size,
            self.hq, self.hkv, self.d, first.gelu, first.eps, first.norm_offset, torch.get_num_threads())
        self.experts = self._step.experts  # index of an MoE layer -> its expert pointer arrays
        self._caches: list[int] = []
        self._one_group = [0] * len(layers)
        self._groups = self._one_group  # each layer's KV layer group, as the structs hold it
        self.local = any(layer.local_rope for layer in layers)  # some layer takes the local RoPE table

    @classmethod
    def create(cls, model: Any) -> "tuple[NativeDecoder | None, str]":
        """``(decoder, "on")``, or ``(None, why not)``."""
        from pagedkv.ops import cpu_kernel, qmm
        from pagedkv.model.quant import QuantLinear

        if os.environ.get("PAGEDKV_NATIVE_STEP", "1") == "0":
            return None, "off (PAGEDKV_NATIVE_STEP=0)"
        layers = list(model.layers)
        if not layers or model.device.type != "cpu" or model.dtype != torch.float32:
            return None, "off (not a float32 CPU model)"
        for layer in layers:
            if layer.fused is None or layer.all_reduce is not None:
                return None, "off (a layer outside the fused path)"
            if set(layer.attn_options) - {"sliding_window", "logits_soft_cap"}:
                return None, "off (attention options beyond window/soft-cap)"
            if layer.mlp is not None and not layer.mlp.native_ok:
                return None, "off (an MoE layer outside the native path: sigmoid/group routing or shared experts)"
            if any(m is None for m in _experts(layer)):
                return None, "off (lazy experts not all read yet)"
            lin = _linears(layer) + _experts(layer)
            if not all(isinstance(m, QuantLinear) and getattr(m, "_qmm", None) is not None and m.qmm_rows > 0
                       for m in lin):
                return None, "off (a linear layer without integer-kernel weights)"
            if not _shapes_fit(layer):
                return None, "off (weights of other shapes than the layer's config)"
        fn, ops, kernel = decoder.get(), qmm.get(), cpu_kernel.get()
        if fn is None or ops is None or kernel is None:
            return None, f"off ({decoder.build_error() or qmm.build_error() or cpu_kernel.build_error() or 'no kernel'})"
        return cls(model, fn, ops, layers[0].fused, decoder.addr(kernel._write_attend)), "on"

    def stale(self) -> bool:
        """Whether some quantised layer was prepared again since this was built (its packed
        weights, which this points into, were replaced), or a module or tensor it points into
        was replaced in its owner's ``_modules`` / ``_parameters`` / ``_buffers`` slot
        (``setattr``, ``torch.func.functional_call``, a new expert list or expert): build a new
        one. Runs every step: one identity compare per slot, dict lookups only (``_slots``;
        about 35 us for SmolLM2's 30 layers, 75 us for 24 layers of 128 experts). A tensor's ``.data`` swapped in
        place is not noticed (reassign the parameter or ``copy_`` into it); its old memory stays
        valid (``_alive`` holds the storages)."""
        from pagedkv.model import quant

        slots, lists = self._slots
        return (quant.PREPARED != self._prepared or not all(d.get(k) is o for d, k, o in slots)
                or any(list(d.values()) != v for d, v in lists))

    def run(self, residual: torch.Tensor, rope: Sequence[tuple[torch.Tensor, torch.Tensor]], kv_caches: Sequence[Any],
            md: Any, backend: Any) -> bool:
        """Every layer over ``residual`` ``[T, hidden]`` (float32, updated in place) with the
        tokens' RoPE rows ``rope`` (``[(cos, sin)]``, each ``[T, 1, d/2]``: the global table's,
        then the local one's when the model has it), writing this step's K/V at the metadata's
        ``slot_mapping``: ``md`` is one ``AttentionMetadata`` for every layer or one per layer
        (KV layer groups: the layers sharing a metadata object are one group). Returns ``False``
        without touching anything when this step needs the Python path. Raises
        ``BackendError`` for a slot past the cache (nothing of the failing layer written, as the
        Python path), ``MemoryError`` when scratch fails, ``RuntimeError`` for a kernel error or
        a routed expert whose weight pointer is NULL."""
        t = residual.shape[0]
        args_of = backend.native_step_args if backend_capabilities(backend).native_step else None
        if (t >= self.rows or args_of is None or torch.autograd._profiler_enabled() or not residual.is_contiguous()
                or residual.dtype != torch.float32 or (self.local and len(rope) < 2)):
            return False
        if not isinstance(md, AttentionMetadata):  # per layer: the layers sharing a metadata object are a group
            if len(md) != len(kv_caches):
                return False
            firsts: dict[int, int] = {}
            groups = [firsts.setdefault(id(m), len(firsts)) for m in md]
            group_md = list({id(m): m for m in md}.values())
            group_caches = [[c for c, gi in zip(kv_caches, groups) if gi == g] for g in range(len(group_md))]
        else:
            groups, group_md, group_caches = self._one_group, [md], [kv_caches]
        q = torch.empty(t, self.hq, self.d)
        kv = torch.empty(t, self.hkv, self.d)
        args = []
        for m, caches in zip(group_md, group_caches):
            a = args_of(q, kv, kv, caches, m)
            if a is None:
                return False
            args.append(a[2])
        ptrs = [p for c in kv_caches for p in (c.key.data_ptr(), c.value.data_ptr())]
        cos, sin = (x.contiguous() for x in rope[0])
        local = [x.contiguous() for x in rope[1]] if self.local else None
        local_ptrs = (local[0].data_ptr(), local[1].data_ptr()) if local else (None, None)
        with self._lock:
            if ptrs != self._caches:
                self._step.set_caches(ptrs)
                self._caches = ptrs
            if groups is not self._groups and groups != self._groups:
                self._step.set_groups(groups)
                self._groups = groups
            rc, failed = self._step(args, t, residual.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                    torch.get_num_threads(), *local_ptrs)
        if rc == -104:
            cache = kv_caches[failed]
            raise BackendError(f"slot_mapping has a slot >= the cache's {cache.num_blocks * cache.block_size} "
                               "slots (nothing written)")
        if rc == -3:
            raise RuntimeError(f"native decoder step: a routed expert of layer {failed} has no weights")
        if rc == -6:
            raise RuntimeError(f"native decoder step: layer {failed} has no attention arguments for its KV group "
                               "or no local RoPE table (nothing written)")
        if rc == -1:
            raise MemoryError("native decoder step: no memory for its scratch or a matmul's activations")
        if rc != 0:
            kind = f"attention kernel code {rc + 100}" if rc <= -100 else f"matmul code {rc}"
            raise RuntimeError(f"native decoder step failed at layer {failed}: {kind}")
        return True



def _layer_spec(layer: Any, scale: float, window: int, cap: float) -> decoder.LayerSpec:
    """``layer``'s weights and options as ``decoder.c`` takes them (checked by ``create``)."""
    moe = None
    if layer.mlp is not None:
        mlp, spec, ex = layer.mlp, layer.mlp.spec, _experts(layer)
        moe = decoder.MoESpec(mlp.router.weight.data_ptr(), [m._qmm for m in ex[0::2]], [m._qmm for m in ex[1::2]],
                              spec.intermediate_size, spec.top_k, bool(spec.norm_topk_prob),
                              spec.hidden_act == "gelu_pytorch_tanh", spec.routed_scaling_factor)
    lin = [m._qmm for m in _linears(layer)]
    gate_up, down = lin[2:] if len(lin) == 4 else (None, None)
    qn, kn = (layer.q_norm.weight.data_ptr(), layer.k_norm.weight.data_ptr()) if layer.q_norm is not None else (None, None)
    post, attn_out, mlp_out = layer.post_attention_layernorm.weight.data_ptr(), None, None
    if layer.pre_feedforward_layernorm is not None:  # sandwich norms (Gemma-2/3)
        post, attn_out = layer.pre_feedforward_layernorm.weight.data_ptr(), post
        mlp_out = layer.post_feedforward_layernorm.weight.data_ptr()
    return decoder.LayerSpec(lin[0], lin[1], gate_up, down, layer.input_layernorm.weight.data_ptr(), post, scale, cap,
                             window, qn, kn, moe, attn_out, mlp_out, bool(layer.local_rope))


def _linears(layer: Any) -> list[Any]:
    """The layer's attention matmuls, and the dense MLP's (an MoE layer's are in ``_experts``)."""
    dense = [layer.gate_up_proj, layer.down_proj] if layer.mlp is None else []
    return [layer.qkv_proj, layer.o_proj, *dense]


def _experts(layer: Any) -> list[Any]:
    """An MoE layer's expert matrices ``[gate_up 0, down 0, gate_up 1, ...]`` (a lazy one's
    linear module; ``None`` for a lazy one not read yet); ``[]`` for a dense layer."""
    if layer.mlp is None:
        return []
    return [getattr(m, "linear", None) if hasattr(m, "materialize") else m
            for e in layer.mlp.experts for m in (e.gate_up_proj, e.down_proj)]


def _slots(model: Any) -> tuple[list[tuple[dict, Any, Any]], list[tuple[dict, list[Any]]]]:
    """What ``stale`` compares: ``(container, key, object)`` for the layer list, each layer's
    linear and norm modules and their weights, an MoE layer's MLP, router, router weight and
    expert list (``container[key] is object`` while nothing was replaced); and per MoE layer
    ``(its experts' _modules, [the experts])`` (a list compare: identities, in C). A matrix
    swapped inside a kept expert is not compared (its memory stays valid: ``_alive``)."""
    slots: list[tuple[dict, Any, Any]] = [(model._modules, "layers", model.layers)]
    lists: list[tuple[dict, list[Any]]] = [(model.layers._modules, list(model.layers._modules.values()))]
    for layer in model.layers:
        names = ["qkv_proj", "o_proj", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
                 "pre_feedforward_layernorm", "post_feedforward_layernorm"]
        names += ["gate_up_proj", "down_proj"] if layer.mlp is None else ["mlp"]
        for name in names:
            m = layer._modules.get(name)
            slots.append((layer._modules, name, m))
            if m is not None and "weight" in m._parameters:
                slots.append((m._parameters, "weight", m._parameters["weight"]))
        if layer.mlp is not None:
            mlp = layer.mlp
            slots += [(mlp._modules, "router", mlp.router), (mlp.router._parameters, "weight", mlp.router.weight),
                      (mlp._modules, "experts", mlp.experts)]
            lists.append((mlp.experts._modules, list(mlp.experts._modules.values())))
    return slots, lists


def _alive(layers: Sequence[Any]) -> list[Any]:
    """The objects the decoder's structs point into, to keep alive: each layer's linear modules
    and expert matrices with their packed weights, the norm weights (with the q/k norms), an MoE
    layer's router weight and expert list, and every such tensor's storage (a tensor whose
    ``.data`` is swapped keeps the old memory valid)."""
    out: list[Any] = []
    for layer in layers:
        for m in _linears(layer) + _experts(layer):
            out += [m, getattr(m, "_qmm", None)]
        if layer.mlp is not None:
            out += [layer.mlp.router.weight, layer.mlp.experts]
        out += [w for w, _ in _norm_weights(layer)]
    return out + [t.untyped_storage() for t in out if isinstance(t, torch.Tensor)]


def _norm_weights(layer: Any) -> list[tuple[torch.Tensor, int]]:
    """``(weight, size)`` of every RMSNorm ``decoder.c`` applies in ``layer``: the two of every
    layer, the q/k norms (Qwen3, Gemma-3) and the sandwich norms (Gemma-2/3) where present."""
    h, d = layer.input_layernorm.weight.shape[0], layer.head_dim
    out = [(layer.input_layernorm.weight, h), (layer.post_attention_layernorm.weight, h)]
    if layer.q_norm is not None:
        out += [(layer.q_norm.weight, d), (layer.k_norm.weight, d)]
    if layer.pre_feedforward_layernorm is not None:
        out += [(layer.pre_feedforward_layernorm.weight, h), (layer.post_feedforward_layernorm.weight, h)]
    return out


def _shapes_fit(layer: Any) -> bool:
    """The packed weights and norm weights have the shapes the C loop sizes its buffers by."""
    h, i = layer.input_layernorm.weight.shape[0], layer.intermediate_size
    q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    want = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    if layer.mlp is not None:
        spec, ie = layer.mlp.spec, layer.mlp.spec.intermediate_size
        want = want[:2] + [(2 * ie, h), (h, ie)] * spec.num_experts
        router = layer.mlp.router.weight
        if router.dtype != torch.float32 or not router.is_contiguous() or router.shape != (spec.num_experts, h):
            return False
    if [(m._qmm.n, m._qmm.k) for m in _linears(layer) + _experts(layer)] != want:
        return False
    return all(w.dtype == torch.float32 and w.is_contiguous() and w.shape == (n,) for w, n in _norm_weights(layer))
