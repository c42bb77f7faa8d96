"""Load and call the native decoder step (``pagedkv/csrc/decoder.c``) through ctypes.

``decoder.c`` runs all decoder layers of an eager CPU step in one call, reaching the integer
matmuls (``pagedkv.ops.qmm``), the fused element-wise passes (``pagedkv.ops.fused_ops``) and the
paged attention kernel (``pagedkv.ops.cpu_kernel``) by address. This module holds the C side
only: the library, its argument structs (``decoder_t``, ``layer_t``, ``moe_t`` of the C file)
and :class:`DecoderStep`, which owns one model's structs. Which models and steps may use it,
and what its error codes mean, is ``pagedkv.model.native_step``'s.

``get()`` returns ``None`` when there is no compiler, the build fails, or
``PAGEDKV_NATIVE_STEP=0``; ``build_error()`` says why.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

from pagedkv.cpu_isa import march_flags
from pagedkv.ops.build import BuiltOnce, compile_c, source

_FLAGS = ["-O3", *march_flags(), "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


class _MoE(ctypes.Structure):
    _fields_ = [("router", ctypes.c_void_p), ("gate_up", ctypes.POINTER(ctypes.c_void_p)),
                ("down", ctypes.POINTER(ctypes.c_void_p)), ("inter", ctypes.c_int64), ("num_experts", ctypes.c_int32),
                ("top_k", ctypes.c_int32), ("norm_topk", ctypes.c_int32), ("gelu", ctypes.c_int32),
                ("scaling", ctypes.c_float), ("shared_gate_up", ctypes.c_void_p), ("shared_down", ctypes.c_void_p),
                ("shared_inter", ctypes.c_int64), ("routing", ctypes.c_int32), ("bias", ctypes.c_void_p),
                ("router_bias", ctypes.c_void_p), ("limit", ctypes.c_float), ("alpha", ctypes.c_float)]


class _MLA(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("q_a", ctypes.c_void_p), ("q_b", ctypes.c_void_p), ("kv_a", ctypes.c_void_p),
                ("q_a_norm", ctypes.c_void_p), ("kv_a_norm", ctypes.c_void_p), ("kv_b", ctypes.c_void_p)] + [
                (n, ctypes.c_int32) for n in ("n", "nope", "rope", "v", "r", "ql", "interleave")] + [
                ("eps", ctypes.c_float), ("k_b", ctypes.POINTER(ctypes.c_void_p)),
                ("v_b", ctypes.POINTER(ctypes.c_void_p))]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("w_in", ctypes.c_void_p), ("w_post", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float), ("window", ctypes.c_int32),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("moe", ctypes.POINTER(_MoE)),
                ("w_attn_out", ctypes.c_void_p), ("w_mlp_out", ctypes.c_void_p), ("local_rope", ctypes.c_int32),
                ("group", ctypes.c_int32), ("mla", ctypes.POINTER(_MLA)), ("residual_scale", ctypes.c_float),
                ("sinks", ctypes.c_void_p)]


class _Decoder(ctypes.Structure):
    _fields_ = [("qmm", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("rope", ctypes.c_void_p),
                ("act", ctypes.c_void_p), ("attend", ctypes.c_void_p), ("hidden", ctypes.c_int64),
                ("inter", ctypes.c_int64), ("hq", ctypes.c_int32), ("hkv", ctypes.c_int32), ("d", ctypes.c_int32),
                ("gelu", ctypes.c_int32), ("num_layers", ctypes.c_int32), ("nthreads", ctypes.c_int32), ("eps", ctypes.c_float),
                ("offset", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)), ("head_norm", ctypes.c_void_p)]


def _build() -> Any:
    lib = compile_c(source("decoder.c"), "pagedkv_decoder", _FLAGS)
    fn = lib.pagedkv_decoder_forward
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)]
    fn.restype = ctypes.c_int
    q = fn.quantize_latent = lib.pagedkv_quantize_latent  # (for the tests: decoder.c's int8 latent writer)
    q.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
    q.restype = ctypes.c_int
    return fn


_LIB = BuiltOnce("PAGEDKV_NATIVE_STEP", _build)


def get():
    """The compiled entry point, or ``None`` (no compiler, a failed build, ``PAGEDKV_NATIVE_STEP=0``)."""
    return _LIB.get()


def build_error() -> str | None:
    """Why ``get()`` returned ``None`` (``None`` if it did not, or was not called yet)."""
    return _LIB.error()


def addr(fn: Any) -> int:
    """The address of a ctypes function (a kernel entry point ``decoder.c`` calls)."""
    return ctypes.cast(fn, ctypes.c_void_p).value


def qmm_struct_addr(packed: Any) -> int:
    """The address of a packed weight's ``qmm`` struct (``pagedkv.ops.qmm``'s ``._qmm``)."""
    return ctypes.addressof(packed.struct)


#: ``MoESpec.routing`` -> ``moe_t.routing`` of ``decoder.c`` (``pagedkv.model.moe.ROUTINGS``)
ROUTING = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2}


@dataclass
class MoESpec:
    """One MoE FFN for ``decoder.c``: the router weight's address (float32 ``[E, hidden]``), each
    expert's packed ``gate_up`` and ``down`` weights (``pagedkv.ops.qmm`` objects, their biases
    inside), the experts' intermediate size, top-k, whether the top-k weights are renormalised
    (softmax and sigmoid routing), GELU (else SiLU) and the routed scaling factor; DeepSeek's
    shared experts as one packed ``(gate_up, down)`` pair of width ``shared_inter``, or ``None``;
    ``routing`` a key of :data:`ROUTING` (``"sigmoid"``: DeepSeek-V3's, its choice biased by
    ``bias``, the address of ``e_score_correction_bias``, float32 ``[E]``; ``"topk_softmax"``:
    gpt-oss's); ``router_bias``: the address of the router's float32 ``[E]`` bias or ``None``;
    ``limit`` > 0: the experts' activation is gpt-oss's clamped SwiGLU with gain ``alpha``
    (``pagedkv.model.moe``), 0: ``gelu``/SiLU times up."""

    router: int
    gate_up: Sequence[Any]
    down: Sequence[Any]
    inter: int
    top_k: int
    norm_topk: bool
    gelu: bool
    scaling: float
    shared: tuple[Any, Any] | None = None
    shared_inter: int = 0
    routing: str = "softmax"
    bias: int | None = None
    router_bias: int | None = None
    limit: float = 0.0
    alpha: float = 1.702


@dataclass
class MLASpec:
    """One multi-head latent attention for ``decoder.c`` (``pagedkv.model.mla``): packed ``q``
    (or ``q_a`` + ``q_b`` with ``q_a_norm``'s address) and ``kv_a``; the addresses of the
    float32 ``kv_a_norm`` ``[r]`` and ``kv_b`` ``[n (nope + v), r]``; the sizes, the rotary
    pairing and the inner norms' eps; ``k_b`` / ``v_b``: per head the packed ``W_UK^T`` ``[r,
    nope]`` and ``W_UV`` ``[v, r]`` (a GGUF's ``attn_k_b`` / ``attn_v_b`` as stored), multiplied in
    place of ``kv_b``, or ``None``."""

    q: Any
    q_a: Any
    q_b: Any
    kv_a: Any
    q_a_norm: int | None
    kv_a_norm: int
    kv_b: int
    n: int
    nope: int
    rope: int
    v: int
    r: int
    ql: int
    interleave: bool
    eps: float
    k_b: Sequence[Any] | None = None
    v_b: Sequence[Any] | None = None


@dataclass
class LayerSpec:
    """One decoder layer for ``decoder.c``: packed weights (``pagedkv.ops.qmm`` objects; the
    MLP pair ``None`` for an MoE layer), norm weights' addresses (float32), the attention
    scale, soft-cap (0 off) and window (tokens, 0 off), and the MoE FFN or ``None``. Sandwich
    norms (Gemma-2/3): ``w_attn_out`` / ``w_mlp_out`` norm the attention / MLP output before it
    joins the residual (``w_post`` is then the pre-MLP norm); ``local_rope``: RoPE from the
    local table; ``group``: the KV layer group whose attention arguments the layer takes;
    ``sinks``: the address of the attention sinks (float32 ``[hq]``, gpt-oss) or ``None``."""

    qkv: Any
    o: Any
    gate_up: Any
    down: Any
    w_in: int
    w_post: int
    scale: float
    softcap: float
    window: int
    q_norm: int | None = None
    k_norm: int | None = None
    moe: MoESpec | None = None
    w_attn_out: int | None = None
    w_mlp_out: int | None = None
    local_rope: bool = False
    group: int = 0
    mla: MLASpec | None = None
    residual_scale: float = 1.0
    sinks: int | None = None


class DecoderStep:
    """One model's ``decoder.c`` structs, kept alive with the pointer arrays they hold.
    ``fn``: :func:`get`'s entry point; ``qmm_ops``/``fused_ops``: the loaded
    ``pagedkv.ops.qmm``/``pagedkv.ops.fused_ops`` libraries; ``attend``: the address of the
    attention kernel's ``pagedkv_write_attend_sinks``; ``dims``: ``hidden, inter, hq, hkv, d`` (ints),
    ``gelu`` (bool), ``eps``, ``offset`` (floats)."""

    def __init__(self, fn: Any, qmm_ops: Any, fused_ops: Any, attend: int, layers: Sequence[LayerSpec],
                 hidden: int, inter: int, hq: int, hkv: int, d: int, gelu: bool, eps: float, offset: float,
                 nthreads: int) -> None:
        self._fn = fn
        self._layers = (_Layer * len(layers))()
        #: index of an MoE layer -> its (gate_up, down) expert pointer arrays
        self.experts: dict[int, Any] = {}
        self._keep: list[Any] = []
        for idx, (s, spec) in enumerate(zip(self._layers, layers)):
            mats = [spec.qkv, spec.o] + ([spec.gate_up, spec.down] if spec.moe is None else [])
            lin = [None if m is None else qmm_struct_addr(m) for m in mats]
            s.qkv, s.o, s.gate_up, s.down = lin if len(lin) == 4 else (*lin, None, None)
            s.w_in, s.w_post = spec.w_in, spec.w_post
            s.scale, s.softcap, s.window = spec.scale, spec.softcap, spec.window
            if spec.q_norm is not None:
                s.q_norm, s.k_norm = spec.q_norm, spec.k_norm
            s.w_attn_out, s.w_mlp_out = spec.w_attn_out, spec.w_mlp_out
            s.local_rope, s.group = int(spec.local_rope), spec.group
            if spec.moe is not None:
                s.moe = ctypes.pointer(self._moe(spec.moe, idx))
            if spec.mla is not None:
                s.mla = ctypes.pointer(self._mla(spec.mla))
            s.residual_scale, s.sinks = spec.residual_scale, spec.sinks
        self._struct = _Decoder(
            addr(qmm_ops._qmm), addr(fused_ops._norm), addr(fused_ops._rope), addr(fused_ops._act), attend,
            hidden, inter, hq, hkv, d, int(gelu), len(layers), nthreads, eps, offset, self._layers,
            addr(fused_ops._head_norm))
        self._ref = ctypes.byref(self._struct)
        self._failed = ctypes.c_int32(0)

    def _moe(self, m: MoESpec, idx: int) -> _MoE:
        n = len(m.gate_up)
        gate_up = (ctypes.c_void_p * n)(*(qmm_struct_addr(w) for w in m.gate_up))
        down = (ctypes.c_void_p * n)(*(qmm_struct_addr(w) for w in m.down))
        self.experts[idx] = (gate_up, down)
        sg, sd = (None, None) if m.shared is None else (qmm_struct_addr(w) for w in m.shared)
        self._keep.append(_MoE(m.router, gate_up, down, m.inter, n, m.top_k, int(m.norm_topk), int(m.gelu), m.scaling,
                               sg, sd, m.shared_inter, ROUTING[m.routing], m.bias, m.router_bias, m.limit, m.alpha))
        return self._keep[-1]

    def _mla(self, a: MLASpec) -> _MLA:
        ptr = [None if w is None else qmm_struct_addr(w) for w in (a.q, a.q_a, a.q_b, a.kv_a)]
        heads = [None if ws is None else (ctypes.c_void_p * len(ws))(*(qmm_struct_addr(w) for w in ws))
                 for ws in (a.k_b, a.v_b)]
        self._keep += [a, heads]  # the per-head matrices and their pointer arrays
        self._keep.append(_MLA(*ptr, a.q_a_norm, a.kv_a_norm, a.kv_b, a.n, a.nope, a.rope, a.v, a.r, a.ql,
                               int(a.interleave), a.eps, *heads))
        return self._keep[-1]

    def set_caches(self, ptrs: Sequence[int]) -> None:
        """Point the layers at their caches: ``ptrs`` = ``[k0, v0, k1, v1, ...]`` addresses."""
        for s, i in zip(self._layers, range(0, len(ptrs), 2)):
            s.k_cache, s.v_cache = ptrs[i], ptrs[i + 1]

    def set_groups(self, groups: Sequence[int]) -> None:
        """Give layer ``i`` the KV layer group ``groups[i]`` (which attention arguments it takes)."""
        for s, g in zip(self._layers, groups):
            s.group = g

    def __call__(self, layer_args: Sequence[Any], t: int, residual: int, cos: int, sin: int, nthreads: int,
                 cos_local: int | None = None, sin_local: int | None = None) -> tuple[int, int]:
        """One step of ``t`` tokens: ``layer_args`` the attention kernel's ``LayerArgs``
        (``pagedkv.ops.cpu_kernel``) per KV layer group, ``residual``/``cos``/``sin`` (and the local
        RoPE table's rows ``cos_local``/``sin_local``, for local-RoPE layers) addresses of float32
        buffers. Returns ``(code, failed layer)`` as ``pagedkv_decoder_forward`` gives them (0: ok)."""
        self._struct.nthreads = nthreads
        args = (ctypes.c_void_p * len(layer_args))(*(ctypes.addressof(a) for a in layer_args))
        rc = self._fn(self._ref, args, len(layer_args), t, residual, cos, sin, cos_local, sin_local,
                      ctypes.byref(self._failed))
        return rc, self._failed.value
