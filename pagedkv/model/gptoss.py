"""gpt-oss (transformers' ``GptOssForCausalLM``): its config fields and checkpoint tensors.

The decoder is ``pagedkv.model.llama``'s with these switches (``ModelConfig``):

* attention sinks (``attention_sinks``): each query head ``h`` has a learned logit ``s_h``
  (``layers.{i}.sinks`` fp32 ``[num_heads]``) that joins every softmax's denominator and
  carries no value: ``p_k = exp(x_k) / (exp(s_h) + sum_j exp(x_j))`` (the attention
  backends' ``sinks`` option, ``pagedkv.attention.base``);
* q/k/v and output projections with biases (``attention_bias``, ``o_proj_bias``);
* ``layer_types`` alternating sliding (window ``sliding_window``) and full layers, run through
  the hybrid KV groups like Gemma-2's;
* YaRN RoPE (``rope_parameters`` ``rope_type: yarn``, ``truncate: false``);
* every layer a mixture of experts (``pagedkv.model.moe``): a biased router, top-k of the
  logits then a softmax over the chosen ones (``"topk_softmax"``), biased experts of width
  ``intermediate_size`` with the clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``).

Checkpoint names (transformers 5.24 ``save_pretrained``) -> ours: ``self_attn.sinks`` ->
``sinks``; ``self_attn.o_proj.bias`` -> ``o_proj.bias``; ``mlp.router.weight`` / ``.bias`` ->
``mlp.router.*``; ``mlp.experts.gate_up_proj`` ``[E, H, 2 I]`` (``x @ W``; gate in the even
columns, up in the odd ones) -> per expert ``gate_up_proj.weight`` ``[2 I, H]`` = gate rows then
up rows, ``gate_up_proj_bias`` ``[E, 2 I]`` likewise; ``mlp.experts.down_proj`` ``[E, I, H]`` ->
``down_proj.weight`` ``[H, I]``, ``down_proj_bias`` ``[E, H]`` -> ``down_proj.bias``.

Source: transformers 5.24 ``models/gpt_oss/modeling_gpt_oss.py`` (``eager_attention_forward``,
``GptOssTopKRouter``, ``GptOssExperts``) and ``configuration_gpt_oss.py`` (defaults). A gpt-oss
GGUF (llama.cpp's ``gpt-oss``: ``attn_sinks``, ``ffn_gate_inp`` + bias, de-interleaved
``ffn_{gate,up,down}_exps`` + biases on their stored blocks) gives the same ``ModelConfig`` and
these names: ``pagedkv.model.gguf_gptoss``; its MXFP4 experts stay as stored, on the integer
kernels (``pagedkv.ops.qmm``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from pagedkv.attn_layout import hf_int
from pagedkv.errors import ConfigError


def hf_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss's ``ModelConfig`` fields beyond the common ones, with ``GptOssConfig``'s defaults
    for missing keys (128 experts, 4 per token, ``swiglu_limit`` 7.0, ``swiglu_alpha`` 1.702).
    Raises ``ConfigError`` naming the key for a non-positive count or a bad SwiGLU number."""
    key = "num_local_experts" if config.get("num_local_experts") is not None else "num_experts"
    out: dict[str, Any] = {
        "num_experts": hf_int(config, key, 128), "num_experts_per_tok": hf_int(config, "num_experts_per_tok", 4),
        "moe_intermediate_size": hf_int(config, "intermediate_size"), "moe_routing": "topk_softmax",
        "moe_bias": True, "attention_sinks": True, "o_proj_bias": bool(config.get("attention_bias", True)),
    }
    for name, default in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
        v = config.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ConfigError(f"{name}: must be a positive number, got {v!r}")
        out[name] = float(v)
    if out["num_experts_per_tok"] > out["num_experts"]:
        raise ConfigError(f"num_experts_per_tok: {out['num_experts_per_tok']} > {key} {out['num_experts']}")
    return out


def hf_tensor(state: dict[str, torch.Tensor], i: int, rest: str, w: torch.Tensor) -> bool:
    """File layer ``i``'s gpt-oss-specific tensor ``rest`` (its name after ``layers.{i}.``)
    under our names (module doc); ``False`` for a tensor the common loader reads (q/k/v, norms)."""
    pre = f"layers.{i}."
    if rest == "self_attn.sinks":
        state[pre + "sinks"] = w
    elif rest == "self_attn.o_proj.bias":
        state[pre + "o_proj.bias"] = w
    elif rest in ("mlp.router.weight", "mlp.router.bias"):
        state[pre + rest] = w
    elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
        bias = rest.endswith("_bias")
        if w.dim() != (2 if bias else 3) or w.shape[-1] % 2:
            raise ConfigError(f"weights: layers.{i}.{rest}: expected [E, {'' if bias else 'H, '}2 I], got {tuple(w.shape)}")
        for e in range(w.shape[0]):
            m = w[e] if bias else w[e].t()  # [2 I] / [2 I, H], gate and up interleaved
            state[f"{pre}mlp.experts.{e}.gate_up_proj.{'bias' if bias else 'weight'}"] = torch.cat([m[0::2], m[1::2]])
    elif rest in ("mlp.experts.down_proj", "mlp.experts.down_proj_bias"):
        bias = rest.endswith("_bias")
        for e in range(w.shape[0]):
            state[f"{pre}mlp.experts.{e}.down_proj.{'bias' if bias else 'weight'}"] = w[e] if bias else w[e].t().contiguous()
    else:
        return False
    return True
