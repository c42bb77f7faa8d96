"""The decoder (Llama, SmolLM2, Mistral, Qwen2/3, Phi-3, Gemma-2/3, MiniCPM3, DeepSeek-V2/V3 dense,
Qwen3-MoE, Mixtral, gpt-oss) on a flat token batch.

The engine packs every scheduled token of every sequence into one flat batch of ``T`` rows
(prefill chunks and decode tokens mixed); there is no batch dimension and no padding. Each
layer projects q/k/v with one fused matmul, applies rotate-half RoPE at each token's own
position, writes k/v into the paged cache through the attention backend
(``backend.write_kv``), and lets the backend attend over each sequence's paged context
(``backend.forward``, with the layer's sliding window and score soft-cap, if any). See
``pagedkv.attention.base`` for the metadata contract. The families differ only by the
``ModelConfig`` switches of ``pagedkv.model.families`` (q/k norms, Gemma's ``1 + w`` and
sandwich norms, GeGLU, scaled embeddings, per-layer windows and RoPE bases, logit soft-caps).

Weights (state-dict names, ``H`` = hidden_size, ``I`` = intermediate_size, ``d`` = head_dim):

* ``embed_tokens.weight`` ``[vocab, H]``; ``norm.weight`` ``[H]``;
  ``lm_head.weight`` ``[vocab, H]`` only when embeddings are not tied
* ``layers.{i}.input_layernorm.weight`` / ``post_attention_layernorm.weight`` ``[H]``
* ``layers.{i}.qkv_proj.weight`` ``[(num_heads + 2 * num_kv_heads) * d, H]`` = rows of q, k, v
  (HF ``q_proj``/``k_proj``/``v_proj`` concatenated; RoPE rotate-half layout), ``.bias`` with
  ``attention_bias``
* ``layers.{i}.o_proj.weight`` ``[H, num_heads * d]`` (``.bias`` ``[H]`` with ``o_proj_bias``)
* ``attention_sinks`` (gpt-oss): ``layers.{i}.sinks`` ``[num_heads]``, the backends' ``sinks``
* ``layers.{i}.gate_up_proj.weight`` ``[2 * I, H]`` = gate rows then up rows;
  ``layers.{i}.down_proj.weight`` ``[H, I]``
* ``qk_norm``: ``layers.{i}.q_norm.weight`` / ``k_norm.weight`` ``[d]``
* a mixture-of-experts layer (``ModelConfig.is_moe_layer``) has ``layers.{i}.mlp.*`` (the
  router and experts of ``pagedkv.model.moe``) instead of ``gate_up_proj`` / ``down_proj``: its
  torch ops on the fused path, decoder.c's ``moe_ffn`` in the native step (``MoE.native_ok``)
* ``sandwich_norms``: ``layers.{i}.pre_feedforward_layernorm.weight`` /
  ``post_feedforward_layernorm.weight`` ``[H]`` (``post_attention_layernorm`` then normalises
  the attention output instead of the MLP input)
* multi-head latent attention (``config.kv_lora_rank`` set; MiniCPM3, DeepSeek): no ``qkv_proj``;
  ``layers.{i}.mla.*`` (``pagedkv.model.mla.MLAttention``) and ``o_proj.weight``
  ``[H, num_heads * v_head_dim]``; the paged cache holds one latent per token and layer. These
  layers run the eager torch path (never the fused ops, the native step or compiled steps).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.base import AttentionBackend, AttentionMetadata, backend_capabilities
from pagedkv.errors import ConfigError
from pagedkv.model import invariant
from pagedkv.model.config import ModelConfig
from pagedkv.model.moe import MoE, MoESpec
from pagedkv.model.step_strategy import EAGER_STEP
from pagedkv.utils import linear_layer, profile_scope, torch_dtype


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` fp32 of the model's RoPE (after any
    ``rope_scaling``): rotation angle of pair ``j`` at position ``p`` is ``p * inv_freq[j]``."""
    d = config.rope_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv
    kind = rs["rope_type"]
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "yarn":
        from pagedkv.model.mla import yarn_inv_freq

        return yarn_inv_freq(rs, d, config.rope_theta)[0]
    if kind == "freq_factors":
        return inv / torch.tensor(rs["factors"], dtype=torch.float32)
    if kind == "llama3":
        factor = float(rs["factor"])
        lo, hi = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept,
        # and the band in between interpolates smoothly between the two.
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(in_band, blended, scaled)
    raise ConfigError(f"rope_scaling: unsupported rope_type {kind!r}")


def rope_cos_sin(config: ModelConfig, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` tables ``[num_positions, head_dim / 2]`` fp32 for positions
    ``0 .. num_positions - 1`` (angles computed in fp32 as transformers does)."""
    inv = rope_inv_freq(config)
    angles = torch.arange(num_positions, dtype=torch.int64).float()[:, None] * inv[None, :]
    rs = config.rope_scaling
    if rs is not None and rs["rope_type"] == "yarn":  # cos/sin times yarn's attention factor
        from pagedkv.model.mla import yarn_inv_freq

        f = yarn_inv_freq(rs, config.rope_dim, config.rope_theta)[1]
        return angles.cos() * f, angles.sin() * f
    return angles.cos(), angles.sin()


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: attention (through the backend) + gated MLP (SwiGLU or
    GeGLU), with the family's extra norms. ``layer`` is its index (which picks its window)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, layer: int = 0) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        kw = {"dtype": dtype, "device": device}
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.intermediate_size = config.intermediate_size
        self.eps, self.norm_offset = config.rms_norm_eps, config.norm_offset
        self.scale = config.attn_scale or d**-0.5
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        window = config.layer_window(layer)
        # the backend's per-layer options, passed only when set
        self._attn_options = {k: v for k, v in (("sliding_window", window),
                                                ("logits_soft_cap", config.attn_logit_softcap)) if v is not None}
        # gpt-oss's attention sinks [num_heads] (pagedkv.model.gptoss), passed as the backends' `sinks`
        self.sinks = nn.Parameter(torch.zeros(config.num_heads, **kw)) if config.attention_sinks else None
        self.local_rope = window is not None and config.rope_local_theta is not None
        self.input_layernorm = _RMSNormWeight(h, **kw)
        # multi-head latent attention (pagedkv.model.mla) in place of qkv_proj, or None
        self.mla: Any = None
        self.residual_scale = config.residual_scale  # MiniCPM3: both branches times it
        if config.is_mla:
            from pagedkv.model.mla import MLAttention

            self.mla, self.q_size = MLAttention(config, **kw), config.num_heads * config.v_head_dim
            self.qkv_proj = None
        else:
            self.qkv_proj = linear_layer(h, self.q_size + 2 * self.kv_size, config.attention_bias, **kw)
        self.o_proj = linear_layer(self.q_size, h, config.o_proj_bias, **kw)
        self.post_attention_layernorm = _RMSNormWeight(h, **kw)
        # a mixture-of-experts layer's MLP (pagedkv.model.moe) replaces the dense one
        self.mlp = MoE(MoESpec.from_config(config), h, **kw) if config.is_moe_layer(layer) else None
        dense = self.mlp is None
        self.gate_up_proj = linear_layer(h, 2 * config.intermediate_size, False, **kw) if dense else None
        self.down_proj = linear_layer(config.intermediate_size, h, False, **kw) if dense else None
        self.q_norm = _RMSNormWeight(d, **kw) if config.qk_norm else None
        self.k_norm = _RMSNormWeight(d, **kw) if config.qk_norm else None
        self.pre_feedforward_layernorm = _RMSNormWeight(h, **kw) if config.sandwich_norms else None
        self.post_feedforward_layernorm = _RMSNormWeight(h, **kw) if config.sandwich_norms else None
        # Tensor parallel (pagedkv.distributed): o_proj and down_proj are row-parallel shards and
        # this sums their partial outputs [T, H] over the ranks, in place. None = one device.
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        # the pagedkv.ops.fused_ops library, set by LlamaForCausalLM for a float32 model on the CPU when
        # this layer's shape allows them (no MLA, no residual scale; an MoE MLP only without expert
        # groups, MoE.native_ok, which decoder.c runs); None = torch ops.
        self.fusable = not config.is_mla and config.residual_scale == 1.0 and (dense or self.mlp.native_ok)
        self.fused: Any = None

    @property
    def attn_options(self) -> dict[str, Any]:
        """The backend's per-layer keyword options: ``sliding_window``, ``logits_soft_cap`` and
        ``sinks`` (the layer's current parameter), those set only."""
        return self._attn_options if self.sinks is None else {**self._attn_options, "sinks": self.sinks}

    def forward(
        self,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: Any,
        md: AttentionMetadata,
        backend: AttentionBackend,
    ) -> None:
        """Add this block's attention and MLP outputs to the residual stream ``[T, H]``
        **in place**; ``cos``/``sin`` ``[T, 1, d/2]`` are the tokens' RoPE rows."""
        if self.fused is not None and self.all_reduce is None:
            return self._forward_fused(residual, cos, sin, kv_cache, md, backend)
        if self.mla is not None:  # the latent cache is read by pagedkv.model.mla, not the backend
            x = self._norm(residual, self.input_layernorm)
            with profile_scope("pagedkv.attention"):
                o = self.mla(x, cos, sin, kv_cache, md)
            return self._residual_mlp(residual, self.o_proj(o))

        self.forward_with(residual, cos, sin, lambda q, k, v: self.attention(q, k, v, kv_cache, md, backend))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, md: AttentionMetadata,
                  backend: AttentionBackend) -> torch.Tensor:
        """Write ``k``/``v`` ``[T, Hkv, d]`` at ``md.slot_mapping`` and attend ``q`` ``[T, Hq, d]``
        over each sequence's paged context with this layer's window / soft-cap -> ``[T, Hq, d]``."""
        caps = backend_capabilities(backend)
        if self.sinks is not None and not caps.attention_sinks:
            raise ConfigError(f"attention backend {backend.name!r} does not implement attention sinks (gpt-oss): "
                              "use the cpu or reference backend")
        with profile_scope("pagedkv.attention"):
            if caps.write_and_forward:  # declared: one call for both
                return backend.write_and_forward(q, k, v, kv_cache, md, self.scale, **self.attn_options)
            backend.write_kv(kv_cache, k, v, md.slot_mapping)
            return backend.forward(q, kv_cache, md, self.scale, **self.attn_options)

    def forward_with(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """The torch-op body of ``forward``: ``attend(q [T, Hq, d], k, v [T, Hkv, d]) -> [T, Hq, d]``
        writes k/v to the cache and attends (``pagedkv.model.compiled`` passes a custom op, so
        that ``torch.compile`` traces this body without entering the backend)."""
        t = residual.shape[0]
        x = self._norm(residual, self.input_layernorm)
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per-head RMSNorm before RoPE (Qwen3, Gemma-3)
            q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].reshape(t, self.num_kv_heads, self.head_dim).contiguous()
        o = attend(q, k, v)
        self._residual_mlp(residual, self.o_proj(o.reshape(t, self.q_size)))

    def _residual_mlp(self, residual: torch.Tensor, attn_out: torch.Tensor) -> None:
        """Add the attention output ``[T, H]`` to ``residual``, then the MLP branch (in place)."""
        if self.all_reduce is not None:
            self.all_reduce(attn_out)
        if self.residual_scale != 1.0:
            attn_out = attn_out * self.residual_scale
        if self.pre_feedforward_layernorm is not None:  # sandwich norms (Gemma)
            residual.add_(self._norm(attn_out, self.post_attention_layernorm))
            x = self._norm(residual, self.pre_feedforward_layernorm)
        else:
            residual.add_(attn_out)
            x = self._norm(residual, self.post_attention_layernorm)
        if self.mlp is not None:
            mlp_out = self.mlp(x)
        else:
            gate_up = self.gate_up_proj(x)
            gate = gate_up[:, : self.intermediate_size]
            # out of place: inductor turns an in-place activation on a slice of gate_up into a
            # kernel that recomputes it per use (2.3x slower at 32 rows with the int8 quantiser)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            mlp_out = self.down_proj(act * gate_up[:, self.intermediate_size :])
        if self.all_reduce is not None:
            self.all_reduce(mlp_out)
        if self.post_feedforward_layernorm is not None:
            mlp_out = self._norm(mlp_out, self.post_feedforward_layernorm)
        residual.add_(mlp_out if self.residual_scale == 1.0 else mlp_out * self.residual_scale)

    def _forward_fused(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: Any,
                       md: AttentionMetadata, backend: AttentionBackend) -> None:
        """``forward`` with the element-wise groups fused (``pagedkv.ops.fused_ops``): norm (and
        the residual add before it), q/k norms, RoPE + q/k/v split, activation x up (an MoE
        layer's MLP is ``pagedkv.model.moe.MoE``'s torch ops). Sandwich norms (Gemma-2/3): the
        attention output is normed (``post_attention_layernorm``) before it joins the residual,
        whose norm (``pre_feedforward_layernorm``) feeds the MLP, and the MLP output is normed
        (``post_feedforward_layernorm``) before it joins. Activations enter a
        quantised matmul already in the bf16 its kernel rounds them to, and leave it in bf16."""
        t, ops = residual.shape[0], self.fused
        x = ops.add_rms_norm(residual, None, self.input_layernorm.weight, self.eps, self.norm_offset,
                             _act_dtype(self.qkv_proj, t))
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:  # per-head RMSNorm of q and k before RoPE (Qwen3), in place
            ops.head_rms_norm(qkv, 0, self.num_heads, self.head_dim, self.q_norm.weight, self.eps, self.norm_offset)
            ops.head_rms_norm(qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.k_norm.weight, self.eps,
                              self.norm_offset)
        q, k, v = ops.rope_split(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        o = self.attention(q, k, v, kv_cache, md, backend)
        attn_out = self.o_proj(o.reshape(t, self.q_size))
        pre_ffn = self.post_attention_layernorm
        if self.pre_feedforward_layernorm is not None:  # sandwich norms: the output normed first
            attn_out = ops.add_rms_norm(attn_out.float(), None, pre_ffn.weight, self.eps, self.norm_offset)
            pre_ffn = self.pre_feedforward_layernorm
        x = ops.add_rms_norm(residual, attn_out, pre_ffn.weight, self.eps, self.norm_offset,
                             _act_dtype(self.gate_up_proj, t))
        if self.mlp is not None:  # (x is float32: _act_dtype of no linear)
            out = self.mlp(x)
        else:
            h = ops.act_mul(self.gate_up_proj(x), self.intermediate_size, self.gelu, _act_dtype(self.down_proj, t))
            out = self.down_proj(h)
        if self.post_feedforward_layernorm is not None:
            out = ops.add_rms_norm(out.float(), None, self.post_feedforward_layernorm.weight, self.eps, self.norm_offset)
        residual.add_(out)

    def _norm(self, x: torch.Tensor, norm: "_RMSNormWeight") -> torch.Tensor:
        return _rms_norm(x, norm.weight, self.eps, self.norm_offset)


class _RMSNormWeight(nn.Module):
    """Holds an RMSNorm weight so state-dict names read ``...layernorm.weight``."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    # Statistics in fp32; for 16-bit models the normalised value is rounded to the model dtype
    # *before* the weight multiply, as transformers' Llama/Qwen2 RMSNorm does. With an offset
    # (Gemma: times 1 + w) the multiply happens in fp32 and the product is rounded, as Gemma's.
    if offset:
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float() + offset, eps).to(x.dtype)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype).mul_(weight)


def _act_dtype(linear: nn.Module, rows: int) -> torch.dtype:
    """The dtype to hand ``linear`` a ``rows``-row input in: bf16 where its kernel rounds
    to bf16 anyway (``QuantLinear.takes_bf16``), else float32."""
    takes_bf16 = getattr(linear, "takes_bf16", None)
    return torch.bfloat16 if takes_bf16 is not None and takes_bf16(rows) else torch.float32


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``x`` ``[T, heads, d]`` (any strides), ``cos``/``sin``
    ``[T, 1, d/2]``; returns a new contiguous ``[T, heads, d]``:
    ``out[:half] = x1*cos - x2*sin``, ``out[half:] = x2*cos + x1*sin``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (no out=: torch.compile traces it)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flat token batch with a paged KV cache.

    Construct with ``LlamaForCausalLM(config, dtype, device)`` (parameters are allocated but
    uninitialised; load them with ``load_state_dict(..., assign=True)`` or use
    ``pagedkv.model.loader.load_model``); ``materialize=False`` leaves them on the meta device
    (no memory) for a loader that replaces the modules. ``embed_tokens`` is any module mapping
    int64 ids ``[T]`` to a fresh float ``[T, H]`` (``nn.Embedding``, or the GGUF rows of
    ``pagedkv.model.gguf_native``). Run under ``torch.inference_mode()``.
    """

    #: the tied LM head through ``pagedkv.model.invariant.linear`` (``invariant.set_deterministic``)
    deterministic = False

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        *,
        materialize: bool = True,
    ) -> None:
        super().__init__()
        dtype = torch_dtype(dtype)  # float32, bfloat16 or float16; ConfigError otherwise
        self.config = config
        # Parameters are created on the meta device (no memory, no random init) and then given
        # uninitialised storage on `device`; the loader assigns the real tensors.
        kw = {"dtype": dtype, "device": "meta"}
        # _weight skips nn.Embedding's normal_ init, which on the meta device costs seconds the
        # first time in a process (tensor-parallel workers build a model each).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size, **kw)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, **kw, layer=i) for i in range(config.num_layers))
        self.norm = _RMSNormWeight(config.hidden_size, **kw)
        self.lm_head = (
            None if config.tie_word_embeddings
            else linear_layer(config.hidden_size, config.vocab_size, False, **kw)
        )
        if materialize:  # else a loader gives every parameter its tensor (pagedkv.model.gguf_native)
            self.to_empty(device=device)
        cos, sin = rope_cos_sin(config, config.max_position_embeddings)
        # Tables in the model dtype (transformers casts cos/sin to the activation dtype too).
        self.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device=device, dtype=dtype), persistent=False)
        local = None
        if config.rope_local_theta is not None:  # the sliding layers' plain RoPE (Gemma-3)
            lc = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
            local = [x.to(device=device, dtype=dtype) for x in rope_cos_sin(lc, config.max_position_embeddings)]
        self.register_buffer("rope_cos_local", local[0] if local else None, persistent=False)
        self.register_buffer("rope_sin_local", local[1] if local else None, persistent=False)
        # sqrt(hidden) for Gemma, rounded to the model dtype as transformers does
        self.embed_scale = float(torch.tensor(config.embed_scale, dtype=dtype))
        self.fused_state: str | None = None  # "on" / "off (why)" once the first forward ran
        self._native: Any = None  # a pagedkv.model.native_step.NativeDecoder, set with the fused ops
        self.native_state: str | None = None  # "on" / "off (why)" once the first forward ran
        #: the path ``forward`` runs: ``"native"`` (decoder.c, the steps it declines per layer),
        #: ``"fused"`` or ``"eager"`` (per layer, each layer fused where it has the ops); set
        #: by ``pagedkv.model.step_strategy.choose_step_strategy`` at engine start, else by
        #: ``prepare_step`` (the fastest the model allows, the backend not known yet)
        self.step_route: str | None = None

    def prepare_step(self, eager: bool = False, again: bool = False) -> None:
        """Give the fusable layers the fused CPU ops (float32 model on the CPU and the ops built;
        ``PAGEDKV_FUSED=0`` keeps torch ops) and the model its native step: once (at start, by
        ``pagedkv.model.step_strategy``, else at the first forward) or ``again``; ``eager``: neither."""
        if not (eager or again or self.fused_state in (None, EAGER_STEP)):
            return
        from pagedkv.model.native_step import NativeDecoder
        from pagedkv.ops import fused_ops

        plain = not eager  # MLA layers: no fused form (eager per layer), but the native step's latent attention
        ops = fused_ops.get() if plain and self.device.type == "cpu" and self.dtype == torch.float32 else None
        for layer in self.layers:
            layer.fused = ops if layer.fusable else None
        if plain:
            self.fused_state = "on" if ops is not None else f"off ({fused_ops.build_error() or 'not a float32 CPU model'})"
            self._native, self.native_state = NativeDecoder.create(self) if ops is not None else (None, "off (no fused ops)")
        else:
            self._native, self.fused_state, self.native_state = None, EAGER_STEP, EAGER_STEP
        fused = any(layer.fused is not None for layer in self.layers)
        self.step_route = "native" if self._native is not None else "fused" if fused else "eager"

    def _native_decoder(self) -> Any:
        """The native step loop (``pagedkv.model.native_step``), rebuilt when a quantised layer
        was prepared again since; ``None`` when the model cannot use it."""
        if self._native is not None and self._native.stale():
            self._native, self.native_state = type(self._native).create(self)
        return self._native

    # ---- info for the engine -------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    # ---- compute ---------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[Any],
        attn_metadata: AttentionMetadata | Sequence[AttentionMetadata],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Run the decoder over a flat batch.

        ``input_ids`` int64 ``[T]`` token ids; ``positions`` int64 ``[T]`` each token's
        position in its sequence (0-based, ``< max_position_embeddings``); ``kv_caches`` one
        cache per layer from ``backend.allocate_kv_cache``; ``attn_metadata`` built for the same
        ``T`` tokens: one for every layer, or a sequence of one per layer (a hybrid KV cache
        gives sliding and full layers their own block tables and slots). Writes this step's K/V
        into the caches at the metadata's ``slot_mapping``.

        Returns the final-normed hidden states ``[T, hidden_size]`` in the model dtype (feed
        the rows you want to sample from to ``compute_logits``). Raises ``ValueError`` on
        mismatched lengths or a wrong number of caches.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be equal [T]")
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        per_layer = not isinstance(attn_metadata, AttentionMetadata)
        if per_layer and len(attn_metadata) != len(self.layers):
            raise ValueError(f"got {len(attn_metadata)} attention metadata for {len(self.layers)} layers")
        if self.fused_state is None:
            self.prepare_step()
        rope, residual = self._rope_rows(positions), self._embed(input_ids)
        if self.step_route == "native":  # the steps decoder.c declines run per layer
            native = self._native_decoder()
            if native is not None and native.run(residual, rope, kv_caches, attn_metadata, backend):
                return self._final_norm(residual, native.fused_ops)  # the C norm (MLA layers have no fused ops)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):  # fused where a layer has the ops
            cos, sin = rope[1 if layer.local_rope else 0]
            layer(residual, cos, sin, cache, attn_metadata[i] if per_layer else attn_metadata, backend)
        return self._final_norm(residual, self.layers[-1].fused)

    def forward_with(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     attend_for: Callable[[int], Callable[..., torch.Tensor]]) -> torch.Tensor:
        """``forward``'s torch-op body with layer ``i``'s attention ``attend_for(i)`` (see
        ``DecoderLayer.forward_with``): what ``pagedkv.model.compiled`` traces."""
        rope, residual = self._rope_rows(positions), self._embed(input_ids)
        for i, layer in enumerate(self.layers):
            cos, sin = rope[1 if layer.local_rope else 0]
            layer.forward_with(residual, cos, sin, attend_for(i))
        return self._final_norm(residual)

    def _rope_rows(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(cos, sin)`` ``[T, 1, d/2]`` of the tokens, global RoPE then (Gemma-3) local."""
        return [(t.index_select(0, positions).unsqueeze(1), u.index_select(0, positions).unsqueeze(1))
                for t, u in ((self.rope_cos, self.rope_sin), (self.rope_cos_local, self.rope_sin_local)) if t is not None]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)  # fresh tensor: owned, mutated in place
        if self.embed_scale != 1.0:
            residual.mul_(self.embed_scale)
        return residual

    def _final_norm(self, residual: torch.Tensor, ops: Any = None) -> torch.Tensor:
        """The final RMSNorm of ``residual`` ``[T, H]``: by the fused ops' kernel when the last
        layer has them (its norms' arithmetic, one C call), else torch's (the eager and compiled
        steps)."""
        if ops is not None and residual.dtype == torch.float32 and self.norm.weight.dtype == torch.float32:
            return ops.add_rms_norm(residual, None, self.norm.weight, self.config.rms_norm_eps, self.config.norm_offset)
        return _rms_norm(residual, self.norm.weight, self.config.rms_norm_eps, self.config.norm_offset)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` float32 for hidden states ``[n, hidden_size]`` (the tied
        embedding matrix or ``lm_head``, which a weight format may have quantised), soft-capped
        as ``cap * tanh(logits / cap)`` when the config has a ``final_logit_softcap``; the hidden
        states are divided by ``config.logits_scaling`` first when it is not 1 (MiniCPM3)."""
        if self.config.logits_scaling != 1.0:
            hidden = hidden / self.config.logits_scaling
        if self.lm_head is None:
            w = self.embed_tokens.weight
            logits = (invariant.linear(hidden, w) if self.deterministic else F.linear(hidden, w)).float()
        else:
            logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

