"""DeepSeek-V2/V3 GGUF files (llama.cpp architecture ``deepseek2``): their metadata as our
``ModelConfig`` and their multi-head latent attention tensors as ``pagedkv.model.mla``'s
weights, for the streaming loader of ``pagedkv.model.gguf_native`` (``weights="gguf"``).

Source: llama.cpp's ``conversion/deepseek.py`` (``DeepseekV2Model``) and
``src/models/deepseek2.cpp`` (the reader), in the llama-cpp-python 0.3.36 sdist; checked
against that converter's output for tiny transformers DeepSeek-V2/V3 models
(``tests/model/test_gguf_deepseek.py``).

Metadata, two generations:

* current converter: ``attention.head_count_kv`` 1, ``key_length`` ``r + rope`` and
  ``value_length`` ``r`` (the absorbed MQA view), the per-head sizes in ``key_length_mla``
  (``nope + rope``) / ``value_length_mla`` (``v``), and ``kv_b_proj`` split into
  ``attn_k_b`` ``[n, r, nope]`` (``W_UK`` transposed) and ``attn_v_b`` ``[n, v, r]`` (numpy
  order);
* older files: ``head_count_kv`` = heads, ``key_length`` ``nope + rope``, ``value_length``
  ``v``, one ``attn_kv_b`` ``[n (nope + v), r]``.

Both: ``attention.kv_lora_rank``, ``attention.q_lora_rank`` (absent or 0: one ``attn_q``;
llama.cpp reads 0 so, and needs the key for a V2-Lite form of other than 26/27 layers), the
rope width ``rope.dimension_count``; llama.cpp always rotates adjacent pairs
(``rope_interleave``). Experts: ``expert_count``, ``expert_used_count``,
``expert_feed_forward_length``, ``expert_shared_count``, ``leading_dense_block_count`` (dense
layers first), ``expert_weights_scale`` (routed scaling, default 1), ``expert_weights_norm``
(renormalise the top-k weights; we follow the file, as llama.cpp does), ``expert_gating_func``
(1 softmax: DeepSeek-V2, 2 sigmoid: DeepSeek-V3, absent: softmax as llama.cpp reads old
files), ``expert_group_count`` / ``expert_group_used_count`` (group-limited choice when more
than one group; V2's groups are ranked by their best expert as transformers does, where
llama.cpp ranks them by their top-2 sum as for V3). Yarn: ``rope.scaling.type`` ``yarn``,
``rope.scaling.factor``, ``rope.scaling.original_context_length``,
``rope.scaling.yarn_log_multiplier`` (``0.1 * mscale_all_dim``; the file has no separate
``mscale``, taken equal as in DeepSeek-V2/V3's configs), ``yarn_beta_fast`` / ``_slow``.

Tensors (``blk.{i}.``): ``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b`` or ``attn_q``,
``attn_kv_a_mqa``, ``attn_kv_a_norm`` -> ``mla.q_a_proj`` ... (``GGUFLinear`` on the stored
blocks for the matrices); ``attn_k_b`` + ``attn_v_b`` (re-joined) or ``attn_kv_b`` ->
``mla.kv_b_proj.weight`` dequantised to float32 ``[n (nope + v), r]``, which ``mla.py`` reads
as a tensor (split files also keep ``attn_k_b`` / ``attn_v_b`` as stored, ``mla.k_b_stored`` /
``mla.v_b_stored``: ``GGUFLinear`` of ``n r`` / ``n v`` rows, which the native step's absorbed form
multiplies head by head, so a decode step reads their stored bytes); ``ffn_{gate,up,down}_shexp`` -> ``mlp.shared`` (gate and up fused);
``exp_probs_b.bias`` -> ``mlp.e_score_correction_bias`` (V3). Stacked experts and the router
are ``gguf_moe``'s; ``attn_output`` and the dense layers' ``ffn_*`` are the generic loader's.

Errors: ``ConfigError`` naming the GGUF key or tensor (a missing key, a gating function we do
not route, sizes that do not fit, a missing half of ``attn_k_b`` / ``attn_v_b``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from pagedkv.attn_layout import gguf_get
from pagedkv.errors import ConfigError
from pagedkv.gguf_header import GGUFTensorInfo
from pagedkv.model.gguf_read import qtype_name
from pagedkv.ops.qmm import GGUF_BLOCKS

#: the GGUF architecture this module reads
ARCH = "deepseek2"
#: parts read as float tensors (``mla.py`` uses ``kv_b_proj.weight`` as a tensor)
DEQUANTISED = ("attn_kv_b", "attn_k_b", "attn_v_b")
#: single matrices of the attention -> attribute of ``layer.mla``
_MLA_LINEAR = {"attn_q_a": "q_a_proj", "attn_q_b": "q_b_proj", "attn_q": "q_proj",
               "attn_kv_a_mqa": "kv_a_proj_with_mqa"}
_MLA_NORMS = {"attn_q_a_norm": "mla.q_a_layernorm.weight", "attn_kv_a_norm": "mla.kv_a_layernorm.weight"}
_SHARED = {"ffn_gate_shexp": 0, "ffn_up_shexp": 1}
_GATING = {1: "softmax", 2: "sigmoid"}


def _int(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConfigError(f"{key}: expected an integer, got {v!r}")
    return int(v)


def config_fields(metadata: Mapping[str, Any], tensor_names: Sequence[str]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of a ``deepseek2`` GGUF from its metadata and tensor
    names (module doc), all but ``model_id`` and ``revision``; the token ids as
    ``ModelConfig.from_gguf_metadata`` reads them for every family. Raises ``ConfigError``
    naming the key."""
    def get(key: str, *default: Any) -> Any:
        return gguf_get(ARCH, metadata, key, *default)

    def num(key: str, *default: Any) -> int:
        return _int(get(key, *default), f"{ARCH}.{key}")

    names = set(tensor_names)
    layers, heads, hidden = num("block_count"), num("attention.head_count"), num("embedding_length")
    rank, rope = num("attention.kv_lora_rank"), num("rope.dimension_count")
    if f"{ARCH}.attention.key_length_mla" in metadata:  # the current converter's absorbed form
        qk, v = num("attention.key_length_mla"), num("attention.value_length_mla")
    else:
        qk, v = num("attention.key_length"), num("attention.value_length")
    if qk <= rope:
        raise ConfigError(f"{ARCH}.attention.key_length_mla: {qk} leaves no non-rotary dims beside rope {rope}")
    vocab = get("vocab_size", None)
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ConfigError(f"{ARCH}.vocab_size: missing (and no tokenizer.ggml.tokens to count)")
        vocab = len(tokens)
    q_lora = get("attention.q_lora_rank", None)
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in metadata and int(metadata[key]) not in eos:
            eos.append(int(metadata[key]))
    if not eos:
        raise ConfigError("tokenizer.ggml.eos_token_id: missing from GGUF metadata")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    out: dict[str, Any] = {
        "eos_token_ids": eos, "bos_token_id": None if bos is None else int(bos),
        "vocab_size": _int(vocab, f"{ARCH}.vocab_size"), "hidden_size": hidden,
        "intermediate_size": num("feed_forward_length"), "num_layers": layers, "num_heads": heads,
        "num_kv_heads": heads, "head_dim": qk, "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": num("context_length"), "tie_word_embeddings": "output.weight" not in names,
        "kv_lora_rank": rank, "q_lora_rank": None if q_lora in (None, 0) else _int(q_lora, f"{ARCH}.attention.q_lora_rank"),
        "qk_nope_head_dim": qk - rope, "qk_rope_head_dim": rope, "v_head_dim": v, "rope_interleave": True,
        "rope_scaling": _yarn(get),
    }
    gating = get("expert_gating_func", 1)
    if gating not in _GATING:
        raise ConfigError(f"{ARCH}.expert_gating_func: {gating!r} is not routed here (1 softmax, 2 sigmoid)")
    routing = _GATING[gating]
    out["architecture"] = "deepseek_v3" if routing == "sigmoid" else "deepseek_v2"
    experts, lead = num("expert_count", 0), num("leading_dense_block_count", 0)
    if experts and lead < layers:
        if routing == "softmax" and any(n.endswith("exp_probs_b.bias") for n in names):
            raise ConfigError(f"{ARCH}.expert_gating_func: softmax routing with exp_probs_b (a choice bias) "
                              "is not supported")
        groups = num("expert_group_count", 1)
        out.update(num_experts=experts, num_experts_per_tok=num("expert_used_count"),
                   moe_intermediate_size=num("expert_feed_forward_length"),
                   num_shared_experts=num("expert_shared_count", 0), moe_routing=routing,
                   norm_topk_prob=bool(get("expert_weights_norm", False)),
                   moe_n_group=groups if groups > 1 else 1,
                   moe_topk_group=num("expert_group_used_count", 1) if groups > 1 else 1,
                   routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
                   moe_layers=None if lead == 0 else list(range(lead, layers)))
    return out


def _yarn(get: Callable[..., Any]) -> dict[str, Any] | None:
    """``rope_scaling`` of the file's ``rope.scaling.*`` keys (module doc); ``None`` without
    scaling. Raises ``ConfigError`` for a scaling type other than yarn."""
    kind = get("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ConfigError(f"{ARCH}.rope.scaling.type: unsupported {kind!r} (supported: yarn)")
    rs: dict[str, Any] = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                          "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
    log_mul = get("rope.scaling.yarn_log_multiplier", None)
    if log_mul is not None:
        rs["mscale"] = rs["mscale_all_dim"] = float(log_mul) / 0.1
    for ours, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                      ("attention_factor", "yarn_attn_factor")):
        if get(f"rope.scaling.{key}", None) is not None:
            rs[ours] = float(get(f"rope.scaling.{key}"))
    return rs


class LayerParts:
    """Collects one layer's MLA and shared-expert tensors as the loader meets them:
    ``take(part, kind, info)`` returns ``False`` for a tensor that is not one of them; then
    ``finish()`` (after the layer's last tensor) checks that the pieces fit together.
    ``later(owner, attr, parts, what)`` is the loader's job queue (``GGUFLinear`` on stored
    blocks), ``values(info)`` the dequantiser (float32 of the tensor's shape) and ``floats``
    the float parameters by our state-dict name."""

    def __init__(self, layer: Any, i: int, config: Any, later: Callable[..., None],
                 values: Callable[[GGUFTensorInfo], torch.Tensor], floats: dict[str, torch.Tensor]) -> None:
        self.layer, self.i, self.config, self.later, self.values, self.floats = layer, i, config, later, values, floats
        self.split: dict[str, torch.Tensor] = {}
        self.shared: dict[int, GGUFTensorInfo] = {}

    def take(self, part: str, kind: str, info: GGUFTensorInfo) -> bool:
        i, mla = self.i, self.layer.mla
        if kind == "bias" and part == "exp_probs_b":
            self.floats[f"layers.{i}.mlp.e_score_correction_bias"] = self.values(info)
        elif kind != "weight":
            return False
        elif part in _MLA_LINEAR:
            self.later(mla, _MLA_LINEAR[part], [(info, None, None)], info.name)
        elif part in _MLA_NORMS:
            self.floats[f"layers.{i}.{_MLA_NORMS[part]}"] = self.values(info)
        elif part == "attn_kv_b":
            self.floats[f"layers.{i}.mla.kv_b_proj.weight"] = self.values(info)
        elif part in ("attn_k_b", "attn_v_b"):
            self.split[part] = self.values(info)
            if self._stored_fits(part, info):  # also as stored, per head: the native step's
                self.later(mla, part.replace("attn_", "") + "_stored", [(info, None, None)], info.name)
        elif part in _SHARED or part == "ffn_down_shexp":
            if getattr(self.layer, "mlp", None) is None or self.layer.mlp.shared is None:
                raise ConfigError(f"weights: {info.name}: the config gives layer {i} no shared experts")
            if part == "ffn_down_shexp":
                self.later(self.layer.mlp.shared, "down_proj", [(info, None, None)], info.name)
            else:
                self.shared[_SHARED[part]] = info
        else:
            return False
        return True

    def _stored_fits(self, part: str, info: GGUFTensorInfo) -> bool:
        """Whether ``part``'s blocks as stored can be packed (a type ``qmm.pack_gguf`` takes, rows
        of whole kernel blocks) and cut per head (whole groups of 8 rows: ``qmm.row_blocks``)."""
        c, qtype = self.config, qtype_name(info)
        rows = c.kv_lora_rank if part == "attn_k_b" else c.v_head_dim
        return qtype in GGUF_BLOCKS and info.shape[-1] % GGUF_BLOCKS[qtype][1] == 0 and rows % 8 == 0

    def finish(self) -> None:
        """Join ``attn_k_b`` ``[n, r, nope]`` and ``attn_v_b`` ``[n, v, r]`` into ``kv_b_proj``
        ``[n (nope + v), r]``; queue the shared experts' fused gate/up. Raises ``ConfigError``
        for a missing half or shapes other than the config's."""
        c, i = self.config, self.i
        if self.split:
            kb, vb = self.split.get("attn_k_b"), self.split.get("attn_v_b")
            if kb is None or vb is None:
                raise ConfigError(f"weights: layer {i} has only one of attn_k_b / attn_v_b")
            n, r = c.num_heads, c.kv_lora_rank
            if tuple(kb.shape) != (n, r, c.qk_nope_head_dim) or tuple(vb.shape) != (n, c.v_head_dim, r):
                raise ConfigError(f"weights: layer {i}: attn_k_b {tuple(kb.shape)} / attn_v_b {tuple(vb.shape)} do "
                                  f"not fit heads {n}, kv_lora_rank {r}, nope {c.qk_nope_head_dim}, v {c.v_head_dim}")
            self.floats[f"layers.{i}.mla.kv_b_proj.weight"] = torch.cat(
                [kb.transpose(1, 2), vb], dim=1).reshape(n * (c.qk_nope_head_dim + c.v_head_dim), r).contiguous()
        if self.shared:
            if sorted(self.shared) != [0, 1]:
                raise ConfigError(f"weights: layer {i} is missing ffn_gate_shexp or ffn_up_shexp")
            self.later(self.layer.mlp.shared, "gate_up_proj",
                       [(self.shared[0], None, None), (self.shared[1], None, None)], f"layer {i} shared gate_up")
