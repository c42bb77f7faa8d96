"""DeepSeek-V2 shapes for ``pagedkv bench models`` (:mod:`pagedkv.bench.models.make`): the
tensors and metadata of llama.cpp's ``deepseek2`` architecture, as its current converter
writes them (``conversion/deepseek.py``, ``DeepseekV2Model``, in the llama-cpp-python 0.3.36
sdist; the same names, keys and shapes as ``tests/model/builders.py::write_deepseek_gguf``
and our reader ``pagedkv.model.gguf_mla``).

Multi-head latent attention in the absorbed (MQA) form: ``attention.head_count_kv`` 1,
``key_length`` ``r + rope``, ``value_length`` ``r``, the per-head sizes in
``key_length_mla`` (``nope + rope``) / ``value_length_mla`` (``v``), ``kv_b_proj`` split
into ``attn_k_b`` ``[n, r, nope]`` and ``attn_v_b`` ``[n, v, r]`` (numpy order, as every shape
here), ``rope.dimension_count`` the rope width. Mixture of experts: ``leading_dense_block_count``
dense layers first (``ffn_gate`` / ``ffn_up`` / ``ffn_down`` of ``feed_forward_length``), then
``ffn_gate_inp`` (F32), ``ffn_{gate,up,down}_exps`` (``expert_count`` of
``expert_feed_forward_length``) and ``ffn_{gate,up,down}_shexp`` (``expert_shared_count``
experts as one MLP of ``shared x expert_ffn``); ``expert_gating_func`` 1 (softmax, V2's
``scoring_func``), ``expert_weights_scale`` (``routed_scaling_factor``), ``expert_group_count``
/ ``expert_group_used_count`` 1 (V2-Lite's ``n_group`` / ``topk_group``), no
``expert_weights_norm`` (V2's ``norm_topk_prob`` is false: the converter writes it only when true).

One departure from the converter: a shape without ``q_lora_rank`` (one ``attn_q``, as
DeepSeek-V2-Lite) gets ``attention.q_lora_rank`` = 0. The converter writes no key there, and
llama.cpp's loader (``src/models/deepseek2.cpp``) requires the key unless the model has 26 or
27 layers (its "lite" test is the layer count), so a V2-Lite cut to fewer layers would not
load without it; with 0 it reads ``n_lora_q`` 0 and uses ``attn_q``, as for a lite model.
Our reader reads 0 as no query compression, as llama.cpp does (``q_lora_rank > 0``).
"""

from __future__ import annotations

from typing import Any

ARCH = "deepseek2"


def tensors(s: Any) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, numpy shape)`` of every tensor of the ``deepseek2`` shape ``s``, in llama.cpp's names."""
    h, n, r = s.hidden, s.heads, s.kv_lora_rank
    qk, rope, v = s.qk_nope_dim + s.qk_rope_dim, s.qk_rope_dim, s.v_head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.vocab, h))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (h,)))
        if s.q_lora_rank:
            out += [(b + "attn_q_a.weight", (s.q_lora_rank, h)), (b + "attn_q_a_norm.weight", (s.q_lora_rank,)),
                    (b + "attn_q_b.weight", (n * qk, s.q_lora_rank))]
        else:
            out.append((b + "attn_q.weight", (n * qk, h)))
        out += [(b + "attn_kv_a_mqa.weight", (r + rope, h)), (b + "attn_kv_a_norm.weight", (r,)),
                (b + "attn_k_b.weight", (n, r, s.qk_nope_dim)), (b + "attn_v_b.weight", (n, v, r)),
                (b + "attn_output.weight", (h, n * v)), (b + "ffn_norm.weight", (h,))]
        if i < s.dense_layers:
            out += [(b + "ffn_gate.weight", (s.ffn, h)), (b + "ffn_up.weight", (s.ffn, h)),
                    (b + "ffn_down.weight", (h, s.ffn))]
        else:
            e, f, sh = s.experts, s.expert_ffn, s.shared_experts * s.expert_ffn
            out += [(b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_exps.weight", (e, f, h)),
                    (b + "ffn_up_exps.weight", (e, f, h)), (b + "ffn_down_exps.weight", (e, h, f))]
            if sh:
                out += [(b + "ffn_gate_shexp.weight", (sh, h)), (b + "ffn_up_shexp.weight", (sh, h)),
                        (b + "ffn_down_shexp.weight", (h, sh))]
    out.append(("output_norm.weight", (h,)))
    if not s.tied:
        out.append(("output.weight", (s.vocab, h)))
    return out


def add_metadata(w: Any, s: Any) -> None:
    """The ``deepseek2.*`` keys of ``s`` beyond the ones every shape writes (module doc);
    ``w`` a ``GGUFWriter``."""
    from gguf import ExpertGatingFuncType

    r, rope = s.kv_lora_rank, s.qk_rope_dim
    w.add_leading_dense_block_count(s.dense_layers)
    w.add_q_lora_rank(s.q_lora_rank or 0)  # 0: one attn_q (module doc: the converter writes no key)
    w.add_kv_lora_rank(r)
    w.add_key_length(r + rope)
    w.add_value_length(r)
    w.add_key_length_mla(s.qk_nope_dim + rope)
    w.add_value_length_mla(s.v_head_dim)
    w.add_expert_feed_forward_length(s.expert_ffn)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.experts_used)
    w.add_expert_group_count(1)
    w.add_expert_group_used_count(1)
    w.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX)  # 1: V2's scoring_func
    w.add_expert_shared_count(s.shared_experts)
    w.add_expert_weights_scale(s.routed_scale)
