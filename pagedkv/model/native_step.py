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
local RoPE table of Gemma-2/3's sliding layers; gpt-oss's attention sinks, which the attention
kernel joins to each softmax, and its biases: q/k/v, o and the experts' inside their packed
weights, which qmm adds, the router's read by decoder.c; an MoE layer with softmax,
DeepSeek-V3's biased sigmoid or gpt-oss's topk_softmax routing without expert groups,
``MoE.native_ok``, whose FFN decoder.c runs: router, top-k, each routed expert's matmuls and
activation (SiLU/GELU x up, or gpt-oss's clamped SwiGLU), in ``pagedkv.model.moe``'s order,
then DeepSeek's shared experts, equal to the torch ops' to float rounding; every expert read, so
lazy experts not yet read keep it off), or whose layers are all multi-head latent attention
(``pagedkv.model.mla``: MiniCPM3, DeepSeek-V2; decoder.c's ``mla_attention`` runs the absorbed
form, so a step is taken only while every sequence has at most ``MLA_ROWS`` rows and the absorbed
form is its cheaper one, over float32 or int8 latent caches (int8: decoder.c writes the codes and
bf16 scales ``pagedkv.attention.quant.quantize`` would, and dequantises as it reads; fp8 declines),
``CPUBackend.latent_step_args``; its
results equal the Python path's to float rounding, not bit for bit, and to the int8
activations' rounding where a GGUF's ``attn_k_b`` / ``attn_v_b`` are multiplied as stored) with every linear on the
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
from pagedkv.attention.reference import lists_of
from pagedkv.model.mla import INNER_NORM_EPS
from pagedkv.ops import decoder


#: an MLA step runs here while each sequence has at most this many rows (decode rows, short
#: chunks, speculative verification): decoder.c streams a sequence's latents once per row, where
#: the Python path's einsums batch a long chunk's rows into matmuls
MLA_ROWS = 8


class NativeDecoder:
    """The step loop of ``model``'s layers in C. Build with :meth:`create` (``None`` when the
    model cannot use it); :meth:`run` does one step or declines."""

    def __init__(self, model: Any, fn: Any, qmm_ops: Any, fused_ops: Any, attend: Any) -> None:
        from pagedkv.model.mla import absorb
        from pagedkv.model import quant

        layers = model.layers
        first = layers[0]
        self.model, self._fn = model, fn
        self.fused_ops = fused_ops  # pagedkv.ops.fused_ops: also the model's final norm after a native step
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
        mla = first.mla  # multi-head latent attention (every layer's; create checks): its dims, the latent args
        self._mla = None if mla is None else (mla.num_heads, mla.rank, mla.nope, mla.rope_dim, mla.v_dim)
        self._absorb = absorb

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
        mla = layers[0].mla is not None
        for layer in layers:
            if (layer.fused is None and not mla) or (layer.mla is not None) != mla or layer.all_reduce is not None:
                return None, "off (a layer outside the fused path)"
            if set(layer.attn_options) - {"sliding_window", "logits_soft_cap", "sinks"} or (
                    mla and "sinks" in layer.attn_options):
                return None, "off (attention options beyond window/soft-cap/sinks)"
            if mla and not 0 < layer.mla.rope_dim <= 512:
                return None, "off (an MLA rope width decoder.c does not take: above 512)"
            if layer.mlp is not None and not layer.mlp.native_ok:
                return None, "off (an MoE layer outside the native path: expert groups)"
            if any(m is None for m in _experts(layer)):
                return None, "off (lazy experts not all read yet)"
            lin = _linears(layer) + _experts(layer)
            if not all(isinstance(m, QuantLinear) and getattr(m, "_qmm", None) is not None and m.qmm_rows > 0
                       for m in lin):
                return None, "off (a linear layer without integer-kernel weights)"
            if not _shapes_fit(layer):
                return None, "off (weights of other shapes than the layer's config)"
        from pagedkv.ops import fused_ops

        fn, ops, kernel, fused = decoder.get(), qmm.get(), cpu_kernel.get(), fused_ops.get()
        if fn is None or ops is None or kernel is None or fused is None:
            why = (decoder.build_error() or qmm.build_error() or cpu_kernel.build_error() or fused_ops.build_error()
                   or "no kernel")
            return None, f"off ({why})"
        return cls(model, fn, ops, fused, decoder.addr(kernel._write_attend_sinks)), "on"

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
        args = []
        if self._mla is not None:  # the latent caches: absorbed rows only (the Python path's choice)
            n, r, nope, rp, v = self._mla
            for m, caches in zip(group_md, group_caches):
                seq_lens, q_lens, _ = lists_of(m)
                a = backend.latent_step_args(caches, m, t)  # None: a cache of another geometry
                if a is not None and a.d != r + rp:  # another latent width than the layers'
                    return False
                if a is None or any(ql and (ql > MLA_ROWS or not self._absorb(ql, sl, n, r, nope, rp, v))
                                    for sl, ql in zip(seq_lens, q_lens)):
                    return False
                args.append(a)
        else:
            q = torch.empty(t, self.hq, self.d)
            kv = torch.empty(t, self.hkv, self.d)
            for m, caches in zip(group_md, group_caches):
                a = args_of(q, kv, kv, caches, m)
                if a is None:
                    return False
                args.append(a[2])
        # an int8 latent cache: its scales where decoder.c's layer reads the (unused) value buffer
        ptrs = [p for c in kv_caches
                for p in (c.key.data_ptr(), (c.key_scale if getattr(c, "quant", None) else c.value).data_ptr())]
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
    moe = mla = qkv = None
    gate_up = down = None
    if layer.mlp is not None:
        mlp, spec, ex = layer.mlp, layer.mlp.spec, _experts(layer)
        shared = None if mlp.shared is None else (mlp.shared.gate_up_proj._qmm, mlp.shared.down_proj._qmm)
        moe = decoder.MoESpec(mlp.router.weight.data_ptr(), [m._qmm for m in ex[0::2]], [m._qmm for m in ex[1::2]],
                              spec.intermediate_size, spec.top_k, bool(spec.norm_topk_prob),
                              spec.hidden_act == "gelu_pytorch_tanh", spec.routed_scaling_factor, shared,
                              0 if mlp.shared is None else mlp.shared.intermediate_size, spec.routing,
                              None if mlp.e_score_correction_bias is None else mlp.e_score_correction_bias.data_ptr(),
                              _ptr(mlp.router.bias), spec.swiglu_limit or 0.0, spec.swiglu_alpha)
    else:
        gate_up, down = layer.gate_up_proj._qmm, layer.down_proj._qmm
    a = layer.mla
    if a is None:
        qkv = layer.qkv_proj._qmm
    else:  # its own softmax scale (yarn's mscale included)
        q_lora, scale = a.q_proj is None, a.scale
        mla = decoder.MLASpec(
            None if q_lora else a.q_proj._qmm, a.q_a_proj._qmm if q_lora else None, a.q_b_proj._qmm if q_lora else None,
            a.kv_a_proj_with_mqa._qmm, a.q_a_layernorm.weight.data_ptr() if q_lora else None,
            a.kv_a_layernorm.weight.data_ptr(), a.kv_b_proj.weight.data_ptr(), a.num_heads, a.nope, a.rope_dim,
            a.v_dim, a.rank, a.q_a_proj._qmm.n if q_lora else 0, bool(a.interleave), INNER_NORM_EPS, *_stored_heads(a))
    qn, kn = (layer.q_norm.weight.data_ptr(), layer.k_norm.weight.data_ptr()) if layer.q_norm is not None else (None, None)
    post, attn_out, mlp_out = layer.post_attention_layernorm.weight.data_ptr(), None, None
    if layer.pre_feedforward_layernorm is not None:  # sandwich norms (Gemma-2/3)
        post, attn_out = layer.pre_feedforward_layernorm.weight.data_ptr(), post
        mlp_out = layer.post_feedforward_layernorm.weight.data_ptr()
    return decoder.LayerSpec(qkv, layer.o_proj._qmm, gate_up, down, layer.input_layernorm.weight.data_ptr(), post,
                             scale, cap, window, qn, kn, moe, attn_out, mlp_out, bool(layer.local_rope), 0, mla,
                             float(layer.residual_scale), _ptr(layer.sinks))


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address, ``None`` for none (``create`` checked its dtype, shape, layout)."""
    return None if t is None else t.data_ptr()


def _stored_heads(a: Any) -> tuple[list[Any] | None, list[Any] | None]:
    """An MLA layer's ``attn_k_b`` / ``attn_v_b`` as stored, cut into per-head packed matrices
    (``W_UK^T`` ``[r, nope]``, ``W_UV`` ``[v, r]``; ``qmm.row_blocks``), or ``(None, None)``:
    decoder.c then multiplies by the float ``kv_b_proj.weight``."""
    from pagedkv.ops import qmm

    kb, vb = (getattr(m, "_qmm", None) for m in (a.k_b_stored, a.v_b_stored))
    if kb is None or vb is None or (kb.n, kb.k, vb.n, vb.k) != (a.num_heads * a.rank, a.nope, a.num_heads * a.v_dim,
                                                                a.rank):
        return None, None
    try:
        return qmm.row_blocks(kb, a.rank), qmm.row_blocks(vb, a.v_dim)
    except ValueError:
        return None, None


def _linears(layer: Any) -> list[Any]:
    """The layer's attention matmuls (MLA: ``q_proj`` or ``q_a_proj`` + ``q_b_proj``, then
    ``kv_a_proj_with_mqa``), ``o_proj``, the dense MLP's and an MoE layer's shared experts' (its
    routed experts' are in ``_experts``)."""
    a = layer.mla
    attn = [layer.qkv_proj] if a is None else (
        [a.q_proj] if a.q_proj is not None else [a.q_a_proj, a.q_b_proj]) + [a.kv_a_proj_with_mqa]
    dense = [layer.gate_up_proj, layer.down_proj] if layer.mlp is None else []
    shared = [layer.mlp.shared.gate_up_proj, layer.mlp.shared.down_proj] if getattr(layer.mlp, "shared", None) else []
    return [*attn, layer.o_proj, *dense, *shared]


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
    expert list (``container[key] is object`` while nothing was replaced), a layer's sinks and a
    router's bias (``None`` where absent); and per MoE layer
    ``(its experts' _modules, [the experts])`` (a list compare: identities, in C). A matrix
    swapped inside a kept expert is not compared (its memory stays valid: ``_alive``)."""
    slots: list[tuple[dict, Any, Any]] = [(model._modules, "layers", model.layers)]
    lists: list[tuple[dict, list[Any]]] = [(model.layers._modules, list(model.layers._modules.values()))]
    for layer in model.layers:
        names = ["qkv_proj", "o_proj", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
                 "pre_feedforward_layernorm", "post_feedforward_layernorm"]
        names += ["gate_up_proj", "down_proj"] if layer.mlp is None else ["mlp"]
        owners = [(layer, names)]
        slots.append((layer._parameters, "sinks", layer._parameters.get("sinks")))
        if layer.mla is not None:  # the latent attention's modules (its kv_b weight is read as a tensor)
            owners += [(layer, ["mla"]), (layer.mla, ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                      "q_a_layernorm", "kv_a_layernorm", "kv_b_proj", "k_b_stored",
                                                      "v_b_stored"])]
        if layer.mlp is not None and layer.mlp.shared is not None:
            owners += [(layer.mlp, ["shared"]), (layer.mlp.shared, ["gate_up_proj", "down_proj"])]
        for owner, owned in owners:
            for name in owned:
                m = owner._modules.get(name)
                slots.append((owner._modules, name, m))
                if m is not None and "weight" in m._parameters:
                    slots.append((m._parameters, "weight", m._parameters["weight"]))
        if layer.mlp is not None:
            mlp = layer.mlp
            slots += [(mlp._modules, "router", mlp.router), (mlp.router._parameters, "weight", mlp.router.weight),
                      (mlp.router._parameters, "bias", mlp.router._parameters.get("bias")),
                      (mlp._modules, "experts", mlp.experts),
                      (mlp._parameters, "e_score_correction_bias", mlp._parameters.get("e_score_correction_bias"))]
            lists.append((mlp.experts._modules, list(mlp.experts._modules.values())))
    return slots, lists


def _alive(layers: Sequence[Any]) -> list[Any]:
    """The objects the decoder's structs point into, to keep alive: each layer's linear modules
    and expert matrices with their packed weights, the norm weights (with the q/k norms), the
    attention sinks, an MoE layer's router weight and bias and expert list, and every such
    tensor's storage (a tensor whose ``.data`` is swapped keeps the old memory valid)."""
    out: list[Any] = []
    for layer in layers:
        for m in _linears(layer) + _experts(layer):
            out += [m, getattr(m, "_qmm", None)]
        if layer.mlp is not None:
            mlp = layer.mlp
            out += [mlp.router.weight, mlp.router.bias, mlp.experts, mlp.e_score_correction_bias]
        if layer.mla is not None:
            out += [layer.mla.kv_b_proj.weight, layer.mla.k_b_stored, layer.mla.v_b_stored]
        out += [w for w, _ in _norm_weights(layer)] + [layer.sinks]
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
    a = layer.mla
    if a is not None:
        out.append((a.kv_a_layernorm.weight, a.rank))
        if a.q_a_layernorm is not None:
            out.append((a.q_a_layernorm.weight, a.q_a_layernorm.weight.shape[0]))  # its matrices' sizes: _shapes_fit
    return out


def _vector_fits(t: torch.Tensor | None, n: int) -> bool:
    """``t`` is ``None`` or a float32 contiguous ``[n]`` (a bias or the sinks decoder.c reads)."""
    return t is None or (t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == (n,))


def _shapes_fit(layer: Any) -> bool:
    """The packed weights, norm weights, biases and sinks have the shapes the C loop reads."""
    h, i = layer.input_layernorm.weight.shape[0], layer.intermediate_size
    q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    want = [(q + 2 * kv, h), (h, q)]
    a = layer.mla
    if a is not None:  # _linears' order: q (or q_a, q_b), kv_a, o
        qk, ql = a.num_heads * (a.nope + a.rope_dim), a.q_a_layernorm.weight.shape[0] if a.q_a_proj is not None else 0
        want = ([(qk, h)] if a.q_proj is not None else [(ql, h), (qk, ql)]) + [
            (a.rank + a.rope_dim, h), (h, a.num_heads * a.v_dim)]
        w = a.kv_b_proj.weight
        if w.dtype != torch.float32 or not w.is_contiguous() or w.shape != (a.num_heads * (a.nope + a.v_dim), a.rank):
            return False
    if layer.mlp is None:
        want += [(2 * i, h), (h, i)]
    else:
        spec, ie = layer.mlp.spec, layer.mlp.spec.intermediate_size
        if layer.mlp.shared is not None:
            si = layer.mlp.shared.intermediate_size
            want += [(2 * si, h), (h, si)]
        want += [(2 * ie, h), (h, ie)] * spec.num_experts
        router = layer.mlp.router.weight
        if router.dtype != torch.float32 or not router.is_contiguous() or router.shape != (spec.num_experts, h):
            return False
        if not all(_vector_fits(b, spec.num_experts) for b in (layer.mlp.e_score_correction_bias,
                                                               layer.mlp.router.bias)):
            return False
    if not _vector_fits(layer.sinks, layer.num_heads):
        return False
    if [(m._qmm.n, m._qmm.k) for m in _linears(layer) + _experts(layer)] != want:
        return False
    return all(w.dtype == torch.float32 and w.is_contiguous() and w.shape == (n,) for w, n in _norm_weights(layer))
