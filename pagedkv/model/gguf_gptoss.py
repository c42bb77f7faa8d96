"""gpt-oss GGUF files (llama.cpp architecture ``gpt-oss``): their metadata as the
``ModelConfig`` an HF directory of the same model gives (``pagedkv.model.gptoss.hf_fields``),
for the streaming loader of ``pagedkv.model.gguf_native`` (``weights="gguf"``).

Source: llama.cpp's ``conversion/gpt_oss.py`` (``GptOssModel``) and ``conversion/base.py``
(``TextModel.set_gguf_parameters``: the common keys, yarn), ``src/models/openai-moe.cpp`` (the
reader and its graph), ``src/llama-graph.cpp`` (``LLM_FFN_SWIGLU_OAI_MOE``,
``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT``), ``src/llama-context.cpp`` and ggml's
``ggml_rope_yarn_corr_dims`` (yarn), in the llama-cpp-python 0.3.36 sdist.

Metadata (``gpt-oss.`` keys; all required but the RoPE ones): ``block_count``,
``context_length``, ``embedding_length``, ``feed_forward_length`` (the converter writes
``intermediate_size``, the experts' width), ``attention.head_count`` / ``head_count_kv`` /
``key_length`` (= ``value_length``, ``head_dim``), ``attention.layer_norm_rms_epsilon``,
``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (one value, or one per
layer that must agree), ``attention.sliding_window`` (tokens; llama.cpp requires it) with the
layers it applies to by ``pagedkv.attn_layout.gguf_layout`` (every 2nd layer full, layer 0
sliding, as transformers' default ``layer_types``; an explicit
``attention.sliding_window_pattern`` as llama.cpp's ``load_swa_pattern`` reads it);
``rope.freq_base`` (default 10000); ``rope.scaling.type`` (none or ``yarn``) with
``rope.scaling.factor``, ``original_context_length`` and the optional ``yarn_beta_fast`` /
``yarn_beta_slow`` / ``yarn_attn_factor``; ``expert_weights_scale`` and ``rope.freq_base_swa``,
which llama.cpp's gpt-oss graph does not apply (the scale) or applies to the sliding layers
only (the base): absent, or values that change nothing (a scale of 0 or 1, the same base).
Stop tokens: the file's ``eos`` / ``eot`` / ``eom`` keys, plus ``<|return|>``,
``<|endoftext|>`` and ``<|call|>`` where the vocabulary has them (gpt-oss's
``generation_config.json`` stops on all three; the converter writes only ``<|return|>``). Fixed by the architecture, as llama.cpp's constants and transformers'
``GptOssConfig`` defaults agree: the clamped SwiGLU's limit 7.0 and alpha 1.702; the router
(biased logits, top-k, a softmax over the chosen: ``"topk_softmax"``); sinks and biases on
attention, router and experts (``attention_bias`` / ``o_proj_bias`` follow the file's
``blk.0.attn_q.bias`` / ``blk.0.attn_output.bias`` when tensor names are given).

YaRN: llama.cpp floors and ceils the correction range (ggml's ``ggml_rope_yarn_corr_dims``:
transformers' ``truncate: true``); gpt-oss's own config sets ``truncate: false`` and the
converter writes no key for it, so the config here carries ``truncate: False``: the HF model's
frequencies, not llama.cpp's. At gpt-oss's sizes (head 64, base 150000, 4096 original
positions, betas 32 / 1, factor 32) the range is 8.09 .. 17.40 here and 8 .. 18 in llama.cpp:
frequency pairs 9..17 of 32 differ, by 0.3% (pair 9) to 43% (pair 17). The attention factor is
``0.1 ln(factor) + 1`` in both (llama.cpp's ``yarn_attn_factor`` times the kernel's ``mscale``).

Tensors (``blk.{i}.``): ``attn_norm``, ``attn_q/k/v`` weight + bias (not permuted: llama.cpp
runs gpt-oss with NEOX, rotate-half, RoPE as transformers), ``attn_output`` weight + bias ->
``o_proj``, ``attn_sinks.weight`` ``[n_head]`` -> ``sinks``, ``post_attention_norm`` (the norm
before the experts) -> ``post_attention_layernorm``, ``ffn_gate_inp`` weight ``[E, H]`` + bias
``[E]`` -> ``mlp.router``, ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` and
``ffn_down_exps`` ``[E, H, I]`` with ``.bias`` ``[E, I]`` / ``[E, H]`` -> each expert's
``gate_up_proj`` (gate rows then up rows, bias likewise) and ``down_proj`` on the stored blocks
(``pagedkv.model.gguf_moe``); ``token_embd``, ``output_norm``, ``output``. Real files store the
experts as MXFP4 (GGML type 39), which the kernels multiply as stored (``pagedkv.ops.qmm``).

Errors: ``ConfigError`` naming the GGUF key (missing, malformed, or values that do not fit,
such as ``expert_used_count`` above ``expert_count``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from pagedkv.attn_layout import as_int, gguf_get, gguf_heads, gguf_layout
from pagedkv.errors import ConfigError

#: the GGUF architecture this module reads
ARCH = "gpt-oss"
#: gpt-oss's stop tokens besides the file's ``eos`` key (``<|return|>``): its
#: ``generation_config.json`` lists ``<|endoftext|>`` and ``<|call|>`` too (ids 199999, 200012)
STOP_TEXTS = ("<|return|>", "<|endoftext|>", "<|call|>")
#: llama.cpp's ``LLM_FFN_SWIGLU_OAI_MOE`` constants (transformers' ``GptOssConfig`` defaults)
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702


def _num(v: Any, key: str, *, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and not 0 < v < float("inf")):
        raise ConfigError(f"{key}: expected a positive number, got {v!r}")
    return float(v)


def config_fields(metadata: Mapping[str, Any], tensor_names: Sequence[str]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of a ``gpt-oss`` GGUF from its metadata and tensor names
    (module doc), all but ``model_id`` and ``revision``; the token ids as
    ``ModelConfig.from_gguf_metadata`` reads them for every family. Raises ``ConfigError``
    naming the key."""
    def get(key: str, *default: Any) -> Any:
        return gguf_get(ARCH, metadata, key, *default)

    def num(key: str, *default: Any) -> int:
        return as_int(get(key, *default), f"{ARCH}.{key}")

    names = set(tensor_names)
    layers, hidden = num("block_count"), num("embedding_length")
    heads, kv_heads, head_dim = gguf_heads(ARCH, metadata, hidden)
    if get("attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"{ARCH}.attention.value_length: {get('attention.value_length')} != key_length {head_dim}")
    experts, used = num("expert_count"), num("expert_used_count")
    if used > experts:
        raise ConfigError(f"{ARCH}.expert_used_count: {used} > {ARCH}.expert_count {experts}")
    width = get("expert_feed_forward_length")
    if isinstance(width, (list, tuple)) or hasattr(width, "tolist"):
        widths = set(width.tolist() if hasattr(width, "tolist") else width)
        if len(widths) != 1:
            raise ConfigError(f"{ARCH}.expert_feed_forward_length: per-layer widths {sorted(widths)} must agree")
        width = widths.pop()
    width = as_int(width, f"{ARCH}.expert_feed_forward_length")
    window, types = gguf_layout(ARCH, metadata, layers)  # the window is required, as llama.cpp requires it
    vocab, tokens = get("vocab_size", None), metadata.get("tokenizer.ggml.tokens")
    if vocab is None and tokens is None:
        raise ConfigError(f"{ARCH}.vocab_size: missing (and no tokenizer.ggml.tokens to count)")
    vocab = len(tokens) if vocab is None else as_int(vocab, f"{ARCH}.vocab_size")
    if tokens is not None and vocab != len(tokens):  # llama.cpp's n_vocab is the token list's length
        raise ConfigError(f"{ARCH}.vocab_size: {vocab} != the {len(tokens)} entries of tokenizer.ggml.tokens")
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in metadata and as_int(metadata[key], key) not in eos:
            eos.append(as_int(metadata[key], key))
    if not eos:
        raise ConfigError("tokenizer.ggml.eos_token_id: missing from GGUF metadata")
    found = getattr(metadata.get("tokenizer.ggml.tokens"), "found", None) or {}
    if isinstance(metadata.get("tokenizer.ggml.tokens"), list):  # a small vocabulary, decoded
        found = {t: i for i, t in reversed(list(enumerate(metadata["tokenizer.ggml.tokens"]))) if t in STOP_TEXTS}
    eos += [found[t] for t in STOP_TEXTS if t in found and found[t] not in eos]
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    scale = _num(get("expert_weights_scale", 0.0), f"{ARCH}.expert_weights_scale", positive=False)
    if scale not in (0.0, 1.0):
        raise ConfigError(f"{ARCH}.expert_weights_scale: {scale} (llama.cpp's gpt-oss does not scale the experts; "
                          "supported: 0 or 1)")
    theta = _num(get("rope.freq_base", 10000.0), f"{ARCH}.rope.freq_base")
    if _num(get("rope.freq_base_swa", theta), f"{ARCH}.rope.freq_base_swa") != theta:
        raise ConfigError(f"{ARCH}.rope.freq_base_swa: {get('rope.freq_base_swa')} differs from rope.freq_base "
                          f"{theta} (another RoPE base on the sliding layers is not supported)")
    return {
        "architecture": "gpt_oss", "vocab_size": as_int(vocab, f"{ARCH}.vocab_size"), "hidden_size": hidden,
        "intermediate_size": num("feed_forward_length", width), "num_layers": layers, "num_heads": heads,
        "num_kv_heads": kv_heads, "head_dim": head_dim,
        "rope_theta": theta,
        "rope_scaling": _yarn(get),
        "rms_norm_eps": _num(get("attention.layer_norm_rms_epsilon"), f"{ARCH}.attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": num("context_length"), "tie_word_embeddings": bool(names) and "output.weight" not in names,
        "bos_token_id": None if bos is None else as_int(bos, "tokenizer.ggml.bos_token_id"), "eos_token_ids": eos,
        "attention_bias": "blk.0.attn_q.bias" in names if names else True,
        "o_proj_bias": "blk.0.attn_output.bias" in names if names else True,
        "sliding_window": window, "layer_types": types,
        "num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": width,
        "moe_routing": "topk_softmax", "moe_bias": True, "attention_sinks": True,
        "routed_scaling_factor": 1.0, "swiglu_limit": SWIGLU_LIMIT, "swiglu_alpha": SWIGLU_ALPHA,
    }


def _yarn(get: Callable[..., Any]) -> dict[str, Any] | None:
    """``rope_scaling`` of the file's ``rope.scaling.*`` keys (module doc: ``truncate`` False,
    as gpt-oss's config); ``None`` without scaling. Raises ``ConfigError`` naming the key for a
    scaling type other than yarn or a missing / malformed yarn key."""
    kind = get("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ConfigError(f"{ARCH}.rope.scaling.type: unsupported {kind!r} (supported: yarn)")
    rs: dict[str, Any] = {
        "rope_type": "yarn", "factor": _num(get("rope.scaling.factor"), f"{ARCH}.rope.scaling.factor"),
        "original_max_position_embeddings": as_int(get("rope.scaling.original_context_length"),
                                                    f"{ARCH}.rope.scaling.original_context_length"),
        "truncate": False,
    }
    if rs["original_max_position_embeddings"] <= 0:
        raise ConfigError(f"{ARCH}.rope.scaling.original_context_length: must be positive, got "
                          f"{rs['original_max_position_embeddings']}")
    for ours, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                      ("attention_factor", "yarn_attn_factor")):
        v = get(f"rope.scaling.{key}", None)
        if v is not None:
            rs[ours] = _num(v, f"{ARCH}.rope.scaling.{key}")
    ext = get("rope.scaling.yarn_ext_factor", None)
    if ext is not None and ext != 1.0:
        raise ConfigError(f"{ARCH}.rope.scaling.yarn_ext_factor: {ext!r} is not supported (transformers' yarn: 1)")
    return rs
