"""What differs between the decoder families pagedkv runs, read from a config.json.

Every family runs on the one decoder of ``pagedkv.model.llama``; the differences are a few
``ModelConfig`` switches, filled here from an HF ``config.json`` (``hf_family_fields``):

=========  =====================================================================================
family     switches
=========  =====================================================================================
llama      none (Llama 1-3, SmolLM2)
mistral    ``sliding_window`` on every layer (when set)
qwen2      q/k/v bias; ``sliding_window`` on the layers ``layer_types`` marks (``use_sliding_window``)
qwen3      ``qk_norm`` (RMSNorm of each q and k head before RoPE); windows as qwen2
phi3       fused ``qkv_proj`` / ``gate_up_proj`` checkpoints; ``sliding_window`` on every layer
gemma2     ``layer_types`` alternating sliding / full (every 2nd layer full); attention and final
           logit soft-capping; ``norm_offset`` 1 (RMSNorm times ``1 + w``); ``sandwich_norms``
           (post-attention, pre- and post-feed-forward norms); GeGLU (``gelu_pytorch_tanh``);
           ``embed_scale`` sqrt(hidden); ``attn_scale`` = ``query_pre_attn_scalar ** -0.5``
gemma3     gemma2's switches plus ``qk_norm``; every 6th layer full (``sliding_window_pattern``
           or ``layer_types``); ``rope_local_theta`` for the sliding layers' RoPE base
minicpm3   multi-head latent attention (``kv_lora_rank`` ..., ``pagedkv.model.mla``); embeddings
           times ``scale_emb``; both residual branches times ``scale_depth / sqrt(L)``; final
           hidden states divided by ``hidden_size / dim_model_base`` before the (tied) LM head
deepseek_  multi-head latent attention with DeepSeek's interleaved rotary (V2 always, V3 with
v2 / v3    ``rope_interleave``) and yarn ``mscale``; mixture-of-experts MLPs (``n_routed_experts``
           of width ``moe_intermediate_size``, ``n_shared_experts`` shared, ``num_experts_per_tok``)
           on the layers from ``first_k_dense_replace`` on, dense MLPs of ``intermediate_size``
           before; routing (``hf_moe_fields``) V2: softmax, ``topk_method`` ``greedy`` or
           ``group_limited_greedy`` (``n_group`` / ``topk_group``), never renormalised; V3:
           ``noaux_tc`` (sigmoid + ``e_score_correction_bias``, groups), ``norm_topk_prob``; both
           times ``routed_scaling_factor``
qwen3_moe  qwen3's ``qk_norm``; mixture-of-experts MLPs (``num_experts``, ``num_experts_per_tok``,
           ``moe_intermediate_size``, ``norm_topk_prob``) on the layers ``i`` not in
           ``mlp_only_layers`` with ``(i + 1) % decoder_sparse_step == 0``, dense MLPs of
           ``intermediate_size`` elsewhere; window on every layer with ``use_sliding_window``
mixtral    mixture-of-experts MLPs on every layer (``num_local_experts``, width
           ``intermediate_size``, top-k weights renormalised); ``sliding_window`` on every layer
gpt_oss    attention sinks, q/k/v/o biases, ``layer_types`` sliding / full (every 2nd layer full by
           default), YaRN RoPE; mixture-of-experts MLPs on every layer with a biased router (top-k,
           then softmax over the chosen) and biased clamped-SwiGLU experts (``pagedkv.model.gptoss``)
=========  =====================================================================================

Layers, heads, head sizes and which layers slide, and by how much, are read by
``pagedkv.attn_layout`` (the one reader the KV cache sizing uses too); the window's semantics are transformers': the query at position ``p``
sees ``p - W < k <= p``.
Raises ``ConfigError`` naming the field for what the decoder does not implement (LongRoPE,
partial RoPE, bidirectional Gemma-3, unknown activations).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from pagedkv.errors import ConfigError
from pagedkv.attn_layout import MLA_ARCHITECTURES, MLA_DEFAULTS, gguf_layout, hf_int, hf_layout, hf_mla_ranks

#: HF ``model_type`` values -> our architecture names.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                  "gemma2": "gemma2", "gemma3_text": "gemma3", "minicpm3": "minicpm3",
                  "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3", "qwen3_moe": "qwen3_moe",
                  "mixtral": "mixtral", "gpt_oss": "gpt_oss"}
#: HF ``architectures`` entries -> our architecture names (when ``model_type`` is missing).
HF_ARCH_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                   "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
                   "Gemma3ForCausalLM": "gemma3", "MiniCPM3ForCausalLM": "minicpm3",
                   "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                   "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
                   "GptOssForCausalLM": "gpt_oss"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_GEMMA = ("gemma2", "gemma3")
#: families that are refused, and what the decoder lacks for them
_NEEDS: dict[str, str] = {}


def hf_model_type(config: Mapping[str, Any]) -> str:
    """Our architecture name for a config.json. Raises ``ConfigError`` for an unsupported one
    (a multimodal Gemma-3 checkpoint is named as such: load its text model), or for a
    config.json that is not a JSON object."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"config.json: not a config (a JSON object), got {type(config).__name__} {config!r:.40}")
    model_type = config.get("model_type")
    if model_type is None:
        archs = config.get("architectures") or []
        found = next((HF_ARCH_CLASSES[a] for a in archs if a in HF_ARCH_CLASSES), None)
        if found is None:
            raise ConfigError(f"model_type: missing from config.json (architectures={archs!r})")
        return found
    if model_type == "gemma3" and "text_config" in config:
        raise ConfigError("model_type: 'gemma3' is the multimodal Gemma-3; only its text model "
                          "(model_type 'gemma3_text', Gemma3ForCausalLM) is supported")
    if model_type in _NEEDS:
        raise ConfigError(f"model_type: {model_type!r} is not supported yet: it needs {_NEEDS[model_type]}")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(f"model_type: unsupported {model_type!r} (supported: {', '.join(HF_MODEL_TYPES)})")
    return HF_MODEL_TYPES[model_type]


def hf_family_fields(arch: str, config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The family switches of ``ModelConfig`` (see the module doc) from a config.json."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    act = "silu" if act == "swish" else act
    if act not in ACTIVATIONS:
        raise ConfigError(f"hidden_act: unsupported activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
    if config.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention: bidirectional attention is not supported (causal decoders only)")
    out: dict[str, Any] = {"hidden_act": act, "qk_norm": arch in ("qwen3", "gemma3", "qwen3_moe")}
    out.update(hf_moe_fields(arch, config, num_layers))
    window, types = hf_layout(arch, config, num_layers)
    out.update(sliding_window=window, layer_types=types)
    if arch in _GEMMA:
        hidden = int(config["hidden_size"])
        out.update(
            norm_offset=1.0, sandwich_norms=True, embed_scale=math.sqrt(hidden),
            attn_scale=float(config.get("query_pre_attn_scalar") or 256) ** -0.5,
            attn_logit_softcap=_cap(config, "attn_logit_softcapping"),
            final_logit_softcap=_cap(config, "final_logit_softcapping"),
        )
    return out


def hf_number(config: Mapping[str, Any], key: str, default: float) -> float:
    """``config[key]`` as a positive finite number (``default`` when missing or null). Raises
    ``ConfigError`` naming ``key`` otherwise."""
    v = config.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise ConfigError(f"{key}: must be a positive number, got {v!r}")
    return float(v)


def hf_mla_fields(arch: str, config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The multi-head latent attention fields of ``ModelConfig`` (``{}`` for other families),
    with the config class's defaults (``MLA_DEFAULTS``) for missing keys. Raises ``ConfigError``
    naming ``attention_bias`` for biased MLA projections, and the key for a null
    ``kv_lora_rank`` (or DeepSeek ``v_head_dim``), a non-positive size, a non-bool
    ``rope_interleave`` or a non-positive MiniCPM3 ``scale_emb`` / ``dim_model_base``."""
    if arch not in MLA_ARCHITECTURES:
        return {}
    if config.get("attention_bias"):
        raise ConfigError("attention_bias: biased MLA projections are not supported")
    d = MLA_DEFAULTS[arch]
    hidden = hf_int(config, "hidden_size")
    for key in ("kv_lora_rank",) + (("v_head_dim",) if arch != "minicpm3" else ()):
        if key in config and config[key] is None:
            raise ConfigError(f"{key}: missing (null) in a {arch} config; multi-head latent attention needs it")
    q_rank = config["q_lora_rank"] if "q_lora_rank" in config else d["q_lora_rank"]
    interleave = config.get("rope_interleave", True)
    if interleave is not None and not isinstance(interleave, bool):
        raise ConfigError(f"rope_interleave: must be true or false, got {interleave!r}")
    rank, rope = hf_mla_ranks(arch, config)
    out: dict[str, Any] = {
        "kv_lora_rank": rank,
        "q_lora_rank": None if q_rank is None else hf_int({"q_lora_rank": q_rank}, "q_lora_rank"),
        "qk_nope_head_dim": hf_int(config, "qk_nope_head_dim", d["qk_nope_head_dim"]),
        "qk_rope_head_dim": rope,
        "v_head_dim": hf_int(config, "v_head_dim", d["v_head_dim"] or hidden // hf_int(config, "num_attention_heads")),
        "rope_interleave": arch == "deepseek_v2" or (arch == "deepseek_v3" and bool(interleave)),
    }
    if arch == "minicpm3":
        depth = config.get("scale_depth")
        depth = math.sqrt(num_layers) if depth is None else hf_number(config, "scale_depth", 1.0)
        if "dim_model_base" in config and config["dim_model_base"] is None:
            base = float(hidden)  # transformers: null means hidden_size
        else:
            base = hf_number(config, "dim_model_base", 256.0)
        scale_emb = 1.0 if "scale_emb" in config and config["scale_emb"] is None else hf_number(config, "scale_emb", 12.0)
        out.update(embed_scale=scale_emb, residual_scale=depth / math.sqrt(num_layers), logits_scaling=hidden / base)
    return out


def check_mla(c: Any) -> None:
    """Validate a ``ModelConfig``'s MLA fields (see its doc). Raises ``ConfigError`` naming the field."""
    if c.rope_scaling is not None and c.rope_scaling["rope_type"] == "yarn" and not (c.is_mla or c.architecture == "gpt_oss"):
        raise ConfigError("rope_scaling: yarn is supported for gpt_oss and the MLA families (minicpm3, deepseek_v2/v3)")
    if not c.is_mla:
        return
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") + (
            ("q_lora_rank",) if c.q_lora_rank is not None else ()):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{name}: must be a positive integer, got {v!r}")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim: must be even for RoPE, got {c.qk_rope_head_dim}")
    if c.head_dim != c.qk_nope_head_dim + c.qk_rope_head_dim:
        raise ConfigError(f"head_dim: {c.head_dim} != qk_nope_head_dim + qk_rope_head_dim for MLA")
    if c.sliding_window is not None or c.qk_norm or c.sandwich_norms or c.attn_logit_softcap is not None:
        raise ConfigError("kv_lora_rank: MLA layers take no sliding window, q/k norms, sandwich norms or soft-cap")
    for name in ("residual_scale", "logits_scaling"):
        v = getattr(c, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ConfigError(f"{name}: must be a positive number, got {v!r}")


#: the config.json spellings of the routed-expert count, by family (errors name the first when none is set)
EXPERT_KEYS = {"qwen3_moe": ("num_experts", "num_local_experts"), "mixtral": ("num_local_experts", "num_experts"),
               "deepseek_v2": ("n_routed_experts", "num_local_experts"),
               "deepseek_v3": ("n_routed_experts", "num_local_experts")}


def hf_moe_fields(arch: str, config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """``_hf_moe_fields``, with ``num_experts_per_tok`` above the expert count (or a non-bool
    ``norm_topk_prob``) a ``ConfigError`` naming the config.json keys."""
    out = _hf_moe_fields(arch, config, num_layers)
    if out.get("num_experts") and out["num_experts_per_tok"] > out["num_experts"]:
        key = next((k for k in EXPERT_KEYS[arch] if config.get(k) is not None), EXPERT_KEYS[arch][0])
        raise ConfigError(f"num_experts_per_tok: {out['num_experts_per_tok']} > {key} {out['num_experts']}")
    if out and not isinstance(config.get("norm_topk_prob", False), (bool, type(None))):
        raise ConfigError(f"norm_topk_prob: must be true or false, got {config['norm_topk_prob']!r}")
    return out


def _hf_moe_fields(arch: str, config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelConfig`` (``{}`` for a dense family), with the
    config classes' defaults for missing keys (transformers 5.24 ``Qwen3MoeConfig``,
    ``MixtralConfig``; both spell the expert count ``num_experts`` or ``num_local_experts``).
    Raises ``ConfigError`` naming the config.json key (as the family spells it) for a count or
    size that is not a positive integer (an expert count of 0 means a dense model)."""
    def get(key: str, default: Any) -> Any:
        v = config.get(key)
        return default if v is None else v

    if arch == "gpt_oss":
        from pagedkv.model.gptoss import hf_fields

        return hf_fields(config)
    if arch in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe_fields(arch, config, num_layers, get)
    if arch == "mixtral":
        return {"num_experts": _hf_count(config, EXPERT_KEYS[arch], 8, low=1),  # transformers: no dense Mixtral
                "num_experts_per_tok": hf_int(config, "num_experts_per_tok", 2),
                "moe_intermediate_size": config.get("intermediate_size"), "norm_topk_prob": True}
    if arch != "qwen3_moe":
        return {}
    from pagedkv.model.moe import moe_layer_indices

    experts = _hf_count(config, EXPERT_KEYS[arch], 128)
    layers = moe_layer_indices(num_layers, decoder_sparse_step=hf_int(config, "decoder_sparse_step", 1),
                               mlp_only_layers=get("mlp_only_layers", []))
    if not experts or not layers:
        return {}
    return {"num_experts": experts, "num_experts_per_tok": hf_int(config, "num_experts_per_tok", 8),
            "moe_intermediate_size": hf_int(config, "moe_intermediate_size", 768),
            "norm_topk_prob": bool(get("norm_topk_prob", False)),
            "moe_layers": None if len(layers) == num_layers else layers}


def _deepseek_moe_fields(arch: str, config: Mapping[str, Any], num_layers: int, get: Any) -> dict[str, Any]:
    """DeepSeek-V2/V3's mixture-of-experts fields (``hf_moe_fields``), as transformers 5.24's
    ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter`` route (config-class defaults for missing
    keys: V2 ``first_k_dense_replace`` 0, 2 shared experts, scaling 1.0; V3 3, 1, 2.5, 8 groups
    with 4 chosen, ``norm_topk_prob`` true). V2 routes by softmax and never renormalises its
    top-k weights (transformers ignores ``norm_topk_prob`` for V2, as DeepSeek-V2's configs set
    it false); V3 always routes ``noaux_tc``. Raises ``ConfigError`` naming ``topk_method`` or
    ``scoring_func`` for a routing transformers does not run for the family (V2 ``noaux_tc``,
    V3 ``greedy``, a V2 sigmoid or V3 softmax score), ``n_group`` when group-limited routing
    lacks its groups, ``num_experts_per_tok`` when missing."""
    from pagedkv.model.moe import moe_layer_indices

    v3 = arch == "deepseek_v3"
    experts = _hf_count(config, EXPERT_KEYS[arch], 256 if v3 else 64)
    first_dense = hf_int(config, "first_k_dense_replace", 3 if v3 else 0, low=0)
    layers = moe_layer_indices(num_layers, first_k_dense_replace=first_dense)
    if not layers:
        return {}
    if not experts:  # transformers builds an expert block on these layers: 0 experts is no model
        key = next((k for k in EXPERT_KEYS[arch] if config.get(k) is not None), EXPERT_KEYS[arch][0])
        raise ConfigError(f"{key}: 0 experts, but layers {layers[0]}.. are mixture-of-experts (first_k_dense_replace "
                          f"{first_dense})")
    method = get("topk_method", "noaux_tc" if v3 else "greedy")
    scoring = get("scoring_func", "sigmoid" if v3 else "softmax")
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in methods:
        raise ConfigError(f"topk_method: {method!r} is not {arch}'s routing (transformers runs {', '.join(methods)})")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ConfigError(f"scoring_func: {scoring!r} is not {arch}'s ({'sigmoid' if v3 else 'softmax'}) router score")
    grouped = method != "greedy"
    n_group, topk_group = (hf_int(config, "n_group", 8 if v3 else None), hf_int(config, "topk_group", 4 if v3 else None))
    if grouped and (n_group is None or topk_group is None):
        raise ConfigError(f"n_group: topk_method {method!r} needs n_group and topk_group, got {n_group!r} / {topk_group!r}")
    top_k = config.get("num_experts_per_tok")
    if top_k is None and not v3:
        raise ConfigError("num_experts_per_tok: missing from a DeepSeek-V2 config with mixture-of-experts layers")
    return {"num_experts": experts, "num_experts_per_tok": hf_int(config, "num_experts_per_tok", 8),
            "moe_intermediate_size": hf_int(config, "moe_intermediate_size", 2048 if v3 else 1407),
            "num_shared_experts": hf_int(config, "n_shared_experts", 1 if v3 else 2, low=0),
            "moe_routing": "sigmoid" if v3 else "softmax",
            "norm_topk_prob": bool(get("norm_topk_prob", True)) if v3 else False,
            "moe_n_group": n_group if grouped else 1, "moe_topk_group": topk_group if grouped else 1,
            "routed_scaling_factor": float(get("routed_scaling_factor", 2.5 if v3 else 1.0)),
            "moe_layers": None if len(layers) == num_layers else layers}


def _hf_count(config: Mapping[str, Any], keys: tuple[str, ...], default: int, low: int = 0) -> int:
    """An expert count (0: dense where ``low`` is 0) spelled by the first of ``keys`` present
    (``hf_int``)."""
    key = next((k for k in keys if config.get(k) is not None), None)
    return default if key is None else hf_int(config, key, low=low)


def _cap(config: Mapping[str, Any], key: str) -> float | None:
    v = config.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(f"{key}: must be a positive number or null, got {v!r}")
    return float(v)


def hf_rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """``(rope_theta, rope_scaling, rope_local_theta)`` from a config.json in the transformers 4
    (``rope_theta`` + ``rope_scaling``) or 5 (``rope_parameters``, per layer type for Gemma-3)
    spelling. ``rope_scaling`` applies to the full-attention layers; the sliding layers of a
    Gemma-3 use plain RoPE with base ``rope_local_theta``. Raises ``ConfigError`` for partial
    RoPE or scaling on the sliding layers."""
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key) is not None and not isinstance(config[key], Mapping):
            raise ConfigError(f"{key}: must be a JSON object or null, got {config[key]!r}")
    params = dict(config.get("rope_parameters") or {})
    local_theta = None
    if "full_attention" in params or "sliding_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        params = dict(params.get("full_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.sliding_attention: unsupported rope_type {local['rope_type']!r}")
        local_theta = local.get("rope_theta") or config.get("rope_local_base_freq") or 10000.0
    elif config.get("rope_local_base_freq") is not None:
        local_theta = config["rope_local_base_freq"]
    partial = params.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
    if float(partial) != 1.0:
        raise ConfigError("partial_rotary_factor: partial RoPE is not supported")
    theta = config.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = config.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **scaling}
    return theta, scaling, None if local_theta is None else float(local_theta)


#: GGUF ``general.architecture`` values we load (Mistral GGUFs are written as ``llama``).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3moe", "deepseek2", "gpt-oss")
#: GGUF architecture names that differ from ours (``deepseek2`` is ``deepseek_v2`` or ``_v3`` by
#: its gating function: ``pagedkv.model.gguf_mla``; ``gpt-oss``: ``pagedkv.model.gguf_gptoss``)
GGUF_ARCH_NAMES = {"qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v2", "gpt-oss": "gpt_oss"}

#: How llama.cpp's converters change a family's tensors on the way into a GGUF, in one place
#: (``pagedkv.model.weights.gguf_state_dict`` undoes each; ``tests/model/test_gguf_conventions.py``
#: has a test per row). Every family: no ``output.weight`` = tied embeddings; ``attn_q.bias``
#: present = q/k/v biases; the tokenizer's ``add_bos_token`` / ``add_eos_token``, special tokens
#: and chat template are the file's ``tokenizer.*`` metadata (``pagedkv.model.tokenizer``).
#:
#: * ``rope_rows_permuted``: Q and K rows (and biases) reordered within each head for
#:   llama.cpp's adjacent-pair RoPE; we restore the rotate-half order (``llama``, which Mistral
#:   files use too).
#: * ``norms_plus_one``: every RMSNorm weight stored as ``1 + w`` (Gemma's ``x * (1 + w)``
#:   folded in); we subtract the 1 again, as transformers' GGUF reader does.
#: * ``ffn_norm_is_pre_feedforward``: ``ffn_norm`` is the pre-feed-forward norm of the
#:   sandwich, and ``post_attention_norm`` the attention output's norm (Gemma).
#: * ``fused_gate_up``: ``ffn_up`` holds gate and up rows fused, ``attn_qkv`` q/k/v (Phi-3).
#: Keyed by our architecture names (a ``qwen3moe`` file is ``qwen3_moe``, ``GGUF_ARCH_NAMES``).
GGUF_CONVENTIONS: dict[str, dict[str, bool]] = {
    arch: {
        "rope_rows_permuted": arch in ("llama", "mistral"),
        "norms_plus_one": arch in _GEMMA,
        "ffn_norm_is_pre_feedforward": arch in _GEMMA,
        "fused_gate_up": arch == "phi3",
    }
    for arch in (*(GGUF_ARCH_NAMES.get(a, a) for a in GGUF_ARCHITECTURES), "mistral", "deepseek_v3")
}


def gguf_family_fields(arch: str, metadata: Mapping[str, Any], tensor_names: set[str], num_layers: int,
                       hidden: int, head_dim: int) -> dict[str, Any]:
    """The family switches from GGUF metadata, as llama.cpp writes and reads them: windows from
    ``{arch}.attention.sliding_window`` (Gemma-2: every 2nd layer full, Gemma-3: every 6th, with
    the local RoPE base 10000 llama.cpp assumes), soft caps from ``{arch}.attn_logit_softcapping``
    / ``final_logit_softcapping``. GGUF has no ``query_pre_attn_scalar``: Gemma's attention scale
    is ``head_dim ** -0.5`` (what llama.cpp uses for every size but the 27B ones). Raises
    ``ConfigError`` for Phi-3 LongRoPE (``rope_factors_long.weight``). Experts:
    ``{arch}.expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length``."""
    def key(name: str) -> Any:
        return metadata.get(f"{arch}.{name}")

    if arch == "phi3" and "rope_factors_long.weight" in tensor_names:
        raise ConfigError("rope_factors_long.weight: Phi-3 LongRoPE is not supported")
    out: dict[str, Any] = {"qk_norm": arch in ("qwen3", "gemma3", "qwen3moe")}
    experts = key("expert_count")
    if experts:  # llama.cpp: softmax top-k, weights renormalised (qwen3moe, llama/Mixtral); the
        # MoE layers are those with a router (``blk.{i}.ffn_gate_inp.weight``)
        layers = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names]
        out.update(num_experts=int(experts), num_experts_per_tok=int(key("expert_used_count") or 0),
                   moe_intermediate_size=int(key("expert_feed_forward_length") or key("feed_forward_length") or 0),
                   norm_topk_prob=True, moe_layers=None if not tensor_names or len(layers) == num_layers else layers)
    window, types = gguf_layout(arch, metadata, num_layers)
    if window is not None:
        out.update(sliding_window=window, layer_types=types)
    if arch in _GEMMA:
        out.update(hidden_act="gelu_pytorch_tanh", norm_offset=1.0, sandwich_norms=True,
                   embed_scale=math.sqrt(hidden), attn_scale=head_dim ** -0.5,
                   attn_logit_softcap=_cap({"x": key("attn_logit_softcapping")}, "x"),
                   final_logit_softcap=_cap({"x": key("final_logit_softcapping")}, "x"))
        if arch == "gemma3":
            out["rope_local_theta"] = 10000.0
    return out
