"""``ModelConfig``: the architecture facts the engine needs, from GGUF metadata or an HF
``config.json``.

Both builders are pure (they take already-parsed metadata); files are read by
``pagedkv.model.weights`` (``gguf_config``, ``hf_config``; GGUF headers by
``pagedkv.gguf_header``) behind ``pagedkv.model.loader.load_config(path)``. Every problem raises
:class:`pagedkv.errors.ConfigError` whose message names the offending field or key.

Supported families: Llama (incl. SmolLM2, Llama 3.x with ``llama3`` RoPE scaling), Mistral
(sliding window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Phi-3 (fused checkpoints; not
LongRoPE), Gemma-2 and Gemma-3 (text), with multi-head latent attention MiniCPM3 and
DeepSeek-V2/V3 (DeepSeek with its mixture-of-experts layers too), and the mixture-of-experts
Qwen3-MoE, Mixtral and gpt-oss, from HF directories and GGUF files alike (MiniCPM3: HF only;
DeepSeek GGUFs: ``pagedkv.model.gguf_mla``, gpt-oss GGUFs: ``pagedkv.model.gguf_gptoss``):
what differs is a few switches, read by ``pagedkv.model.families``.
"""

from __future__ import annotations

import math
from dataclasses import MISSING as _DC_MISSING, asdict, dataclass, fields
from typing import Any, Mapping, Sequence

from pagedkv.errors import ConfigError
from pagedkv.model import families
from pagedkv.attn_layout import LAYER_TYPES, as_int as _as_int, gguf_heads, gguf_num_layers, hf_heads, hf_int
from pagedkv.attn_layout import gguf_get, hf_num_layers, layer_windows

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
                           "minicpm3", "deepseek_v2", "deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss")


# RoPE variants implemented by ``pagedkv.model.llama.rope_inv_freq``.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn")


@dataclass
class ModelConfig:
    """Architecture of one decoder (the Llama family and the switches of the others).

    Sizes are element counts; ``rope_theta`` is the RoPE base; ``max_position_embeddings`` is
    the longest context (in tokens) the model supports here. ``eos_token_ids`` lists every id
    that ends generation (never empty). ``revision`` identifies the exact weights: the first
    16 hex digits of a GGUF's sha256, or an HF snapshot commit / content hash.

    ``rope_scaling`` is ``None`` (plain RoPE) or a dict with ``rope_type`` in
    ``SUPPORTED_ROPE_TYPES``:

    * ``{"rope_type": "linear", "factor": f}``
    * ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
      "original_max_position_embeddings"}`` (Llama 3.1+)
    * ``{"rope_type": "freq_factors", "factors": [d/2 floats]}``: per-frequency divisors as
      stored by llama.cpp in a GGUF's ``rope_freqs.weight`` tensor (how llama3 scaling travels
      in GGUF files).

    Family switches (defaults = Llama; see ``pagedkv.model.families``): ``hidden_act``
    (``silu`` SwiGLU or ``gelu_pytorch_tanh`` GeGLU); ``qk_norm`` (RMSNorm over each q and k
    head, weights ``[head_dim]``, before RoPE); ``norm_offset`` (every RMSNorm multiplies by
    ``norm_offset + w``: 1.0 for Gemma); ``sandwich_norms`` (norms on the attention output and
    around the MLP, Gemma); ``embed_scale`` (embeddings times it, rounded to the model dtype);
    ``attn_scale`` (``None``: ``head_dim ** -0.5``); ``attn_logit_softcap`` /
    ``final_logit_softcap`` (``cap * tanh(x / cap)`` on attention scores / logits);
    ``sliding_window`` (tokens) on the layers ``layer_types`` marks ``"sliding_attention"``
    (``None``: on every layer when ``sliding_window`` is set); ``rope_local_theta``: RoPE base
    of the sliding layers (Gemma-3; ``None``: ``rope_theta``, and ``rope_scaling`` applies to
    every layer).

    Multi-head latent attention (MiniCPM3, DeepSeek-V2/V3; ``pagedkv.model.mla``) when
    ``kv_lora_rank`` is set: ``q_lora_rank`` (``None``: one ``q_proj``), ``qk_nope_head_dim`` /
    ``qk_rope_head_dim`` (each query/key head is ``nope + rope``; ``head_dim`` is their sum),
    ``v_head_dim``, ``rope_interleave`` (DeepSeek's adjacent-pair rotary); ``residual_scale``
    (each block's two branches times it: MiniCPM3's ``scale_depth / sqrt(L)``) and
    ``logits_scaling`` (final hidden states divided by it before the LM head: MiniCPM3's
    ``hidden_size / dim_model_base``).
    Mixture of experts (``pagedkv.model.moe``; ``num_experts`` 0 = dense): the layers listed in
    ``moe_layers`` (``None``: every layer) replace the dense MLP by ``num_experts`` experts of
    width ``moe_intermediate_size``, ``num_experts_per_tok`` routed per token by
    ``moe_routing`` (``softmax`` or DeepSeek-V3's ``sigmoid``), with ``norm_topk_prob``,
    group-limited choice ``moe_n_group`` / ``moe_topk_group``, ``routed_scaling_factor`` and
    ``num_shared_experts`` shared experts; the other layers keep a dense MLP of width
    ``intermediate_size``. gpt-oss: ``attention_sinks`` (a learned logit per query head in each
    softmax's denominator, ``layers.{i}.sinks``), ``o_proj_bias``, ``moe_bias`` (router and
    experts biased) and ``swiglu_limit`` / ``swiglu_alpha`` (the experts' clamped SwiGLU).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    model_id: str = ""
    revision: str = ""
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attn_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    residual_scale: float = 1.0
    logits_scaling: float = 1.0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    norm_topk_prob: bool = False
    moe_routing: str = "softmax"
    moe_n_group: int = 1
    moe_topk_group: int = 1
    routed_scaling_factor: float = 1.0
    moe_layers: list[int] | None = None
    attention_sinks: bool = False
    o_proj_bias: bool = False
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture: unsupported {self.architecture!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}"
            )
        if self.head_dim % 2 and not self.is_mla:  # MLA: qk_rope_head_dim is checked (check_mla)
            raise ConfigError(f"head_dim: must be even for RoPE, got {self.head_dim}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"rope_theta: must be a positive number, got {self.rope_theta!r}")
        if not (self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps: must be positive, got {self.rms_norm_eps!r}")
        self.eos_token_ids = [int(t) for t in self.eos_token_ids]
        if not self.eos_token_ids:
            raise ConfigError("eos_token_ids: at least one end-of-sequence token id is needed")
        for t in self.eos_token_ids + ([self.bos_token_id] if self.bos_token_id is not None else []):
            if not 0 <= t < self.vocab_size:
                raise ConfigError(f"eos_token_ids/bos_token_id: id {t} outside vocab [0, {self.vocab_size})")
        self.rope_scaling = _check_rope_scaling(self.rope_scaling, self.rope_dim)
        self._check_family()
        families.check_mla(self)

    def _check_family(self) -> None:
        ACTIVATIONS = families.ACTIVATIONS
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act: unsupported {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ConfigError(f"sliding_window: must be a positive integer or None, got {self.sliding_window!r}")
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ConfigError(f"layer_types: expected {self.num_layers} entries of {LAYER_TYPES}")
            if self.sliding_window is None and "sliding_attention" in self.layer_types:
                raise ConfigError("layer_types: sliding layers need a sliding_window")
        for name in ("attn_logit_softcap", "final_logit_softcap", "attn_scale", "rope_local_theta"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{name}: must be a positive number or None, got {v!r}")
        if not (self.embed_scale > 0 and math.isfinite(self.embed_scale)):
            raise ConfigError(f"embed_scale: must be a positive number, got {self.embed_scale!r}")
        if self.num_experts:
            from pagedkv.model.moe import MoESpec

            MoESpec.from_config(self)  # raises ConfigError naming the field
            if self.moe_layers is not None:
                self.moe_layers = sorted({int(i) for i in self.moe_layers})
                if any(not 0 <= i < self.num_layers for i in self.moe_layers):
                    raise ConfigError(f"moe_layers: layer indices must lie in [0, {self.num_layers})")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (``pagedkv.model.moe``)."""
        return bool(self.num_experts) and (self.moe_layers is None or layer in self.moe_layers)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window (tokens) of layer ``layer``, ``None`` for a full-attention layer:
        the query at position ``p`` sees keys ``p - window < k <= p``."""
        return self.layer_windows()[layer]

    def layer_windows(self) -> list[int | None]:
        """``layer_window(i)`` of every layer (what a hybrid KV manager groups layers by), by
        ``pagedkv.attn_layout.layer_windows``, the rule the KV cache sizing uses too."""
        return layer_windows(self.sliding_window, self.layer_types, self.num_layers)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """Elements of a head that RoPE rotates: ``qk_rope_head_dim`` for MLA, else ``head_dim``."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def cache_kv_heads(self) -> int:
        """KV heads of the paged cache: 1 for MLA (the latent), else ``num_kv_heads``."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def cache_head_dim(self) -> int:
        """Elements of one cached vector: ``kv_lora_rank + qk_rope_head_dim`` for MLA, else ``head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def q_size(self) -> int:
        """Width of the query projection output: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection output: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict; ``ModelConfig.from_dict(c.to_dict()) == c``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        """Inverse of ``to_dict``. Raises ``ConfigError`` naming a missing or unknown field."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown ModelConfig field")
        required = [f.name for f in fields(cls) if f.default is _DC_MISSING and f.default_factory is _DC_MISSING]
        for name in required:
            if name not in data:
                raise ConfigError(f"{name}: missing from the saved model config")
        return cls(**dict(data))

    # ---- builders --------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: Mapping[str, Any],
        tensor_names: Sequence[str] = (),
        *,
        model_id: str = "",
        revision: str = "",
        rope_freq_factors: Sequence[float] | None = None,
    ) -> "ModelConfig":
        """Build from GGUF key/value metadata (``{"llama.block_count": 30, ...}``).

        ``tensor_names`` (the GGUF's tensor names) decide ``tie_word_embeddings`` (no
        ``output.weight``) and ``attention_bias`` (``blk.0.attn_q.bias`` present).
        ``rope_freq_factors`` are the values of a ``rope_freqs.weight`` tensor, if the file has
        one. Large arrays (``tokenizer.ggml.tokens``) may be given as any sized object.
        ``deepseek2`` and ``gpt-oss`` files are read by ``pagedkv.model.gguf_mla`` /
        ``pagedkv.model.gguf_gptoss`` (a gpt-oss file gives the fields an HF directory of the
        model gives: sinks, biases, ``topk_softmax`` routing, clamped SwiGLU, windows, yarn).

        Raises ``ConfigError`` naming the GGUF key for an unknown architecture or a missing
        or malformed key.
        """
        arch = metadata.get("general.architecture")
        if arch is None:
            raise ConfigError("general.architecture: missing from GGUF metadata")
        arch = str(arch)
        if arch not in families.GGUF_ARCHITECTURES:
            raise ConfigError(f"general.architecture: unsupported GGUF architecture {arch!r} "
                              f"(supported: {', '.join(families.GGUF_ARCHITECTURES)})")
        if arch in ("deepseek2", "gpt-oss"):  # pagedkv.model.gguf_mla / gguf_gptoss read these
            from pagedkv.model import gguf_gptoss, gguf_mla
            fields_of = gguf_mla.config_fields if arch == "deepseek2" else gguf_gptoss.config_fields
            return cls(**fields_of(metadata, tensor_names), model_id=model_id, revision=revision)

        def get(key: str, *default: Any) -> Any:
            return gguf_get(arch, metadata, key, *default)

        num_heads, num_kv_heads, head_dim = gguf_heads(arch, metadata)  # pagedkv.attn_layout
        hidden = _as_int(get("embedding_length"), f"{arch}.embedding_length")
        value_dim = get("attention.value_length", head_dim)
        if value_dim != head_dim:
            raise ConfigError(
                f"{arch}.attention.value_length: {value_dim} != key_length {head_dim} is not supported"
            )
        vocab = get("vocab_size", None)
        if vocab is None:
            tokens = metadata.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ConfigError(f"{arch}.vocab_size: missing (and no tokenizer.ggml.tokens to count)")
            vocab = len(tokens)

        rope_scaling: dict[str, Any] | None = None
        scaling_type = get("rope.scaling.type", None)
        if scaling_type not in (None, "none"):
            if scaling_type != "linear":
                raise ConfigError(f"{arch}.rope.scaling.type: unsupported {scaling_type!r} (supported: linear)")
            rope_scaling = {
                "rope_type": "linear",
                "factor": _as_float(get("rope.scaling.factor"), f"{arch}.rope.scaling.factor"),
            }
        if rope_freq_factors is not None:
            if rope_scaling is not None:
                raise ConfigError("rope_freqs.weight: cannot be combined with rope.scaling.type")
            rope_scaling = {"rope_type": "freq_factors", "factors": [float(x) for x in rope_freq_factors]}

        names = set(tensor_names)
        eos_ids: list[int] = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if key in metadata and int(metadata[key]) not in eos_ids:
                eos_ids.append(int(metadata[key]))
        if not eos_ids:
            raise ConfigError("tokenizer.ggml.eos_token_id: missing from GGUF metadata")
        bos = metadata.get("tokenizer.ggml.bos_token_id")

        num_layers = gguf_num_layers(arch, metadata)
        return cls(
            architecture=families.GGUF_ARCH_NAMES.get(arch, arch),
            vocab_size=_as_int(vocab, f"{arch}.vocab_size"),
            hidden_size=hidden,
            intermediate_size=_as_int(get("feed_forward_length"), f"{arch}.feed_forward_length"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=_as_float(get("rope.freq_base", 10000.0), f"{arch}.rope.freq_base"),
            rope_scaling=rope_scaling,
            rms_norm_eps=_as_float(
                get("attention.layer_norm_rms_epsilon"), f"{arch}.attention.layer_norm_rms_epsilon"
            ),
            tie_word_embeddings=bool(names) and "output.weight" not in names,
            max_position_embeddings=_as_int(get("context_length"), f"{arch}.context_length"),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            model_id=model_id,
            revision=revision,
            attention_bias="blk.0.attn_q.bias" in names,
            **families.gguf_family_fields(arch, metadata, names, num_layers, hidden, head_dim),
        )

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any],
        generation_config: Mapping[str, Any] | None = None,
        *,
        model_id: str = "",
        revision: str = "",
    ) -> "ModelConfig":
        """Build from a parsed HF ``config.json`` (``families.HF_MODEL_TYPES``), plus the optional
        ``generation_config.json`` whose ``eos_token_id`` entries are added to
        ``eos_token_ids``.

        Accepts both the transformers 4 (``rope_theta`` + ``rope_scaling``) and 5
        (``rope_parameters``) spellings. Sliding windows, soft-caps and the other family
        switches come from ``pagedkv.model.families.hf_family_fields``. Raises ``ConfigError``
        naming the field for an unsupported model_type, activation or option, or a missing
        field.
        """
        model_type = families.hf_model_type(config)

        def req(key: str) -> Any:
            if config.get(key) is None:
                raise ConfigError(f"{key}: missing from config.json")
            return config[key]

        if config.get("mlp_bias"):
            raise ConfigError("mlp_bias: MLP biases are not supported")

        hidden = hf_int(config, "hidden_size")
        num_heads, num_kv_heads, head_dim = hf_heads(model_type, config, hidden)  # pagedkv.attn_layout
        theta, scaling, local_theta = families.hf_rope(config)
        num_layers, max_pos = hf_num_layers(config), hf_int(config, "max_position_embeddings")

        eos: list[int] = []
        for src in (config, generation_config or {}):
            value = src.get("eos_token_id")
            for t in value if isinstance(value, (list, tuple)) else ([] if value is None else [value]):
                if int(t) not in eos:
                    eos.append(int(t))
        if not eos:
            raise ConfigError("eos_token_id: missing from config.json and generation_config.json")
        bos = config.get("bos_token_id")
        if bos is None and generation_config:
            bos = generation_config.get("bos_token_id")

        return cls(
            architecture=model_type,
            vocab_size=hf_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=hf_int(config, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=_as_float(theta, "rope_theta"),
            rope_scaling=scaling,
            rms_norm_eps=_as_float(req("rms_norm_eps"), "rms_norm_eps"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            model_id=model_id,
            revision=revision,
            attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", model_type == "gpt_oss")),
            rope_local_theta=local_theta,
            **families.hf_family_fields(model_type, config, num_layers),
            **families.hf_mla_fields(model_type, config, num_layers),
        )


def _as_float(value: Any, name: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None


def _check_rope_scaling(scaling: Mapping[str, Any] | None, head_dim: int) -> dict[str, Any] | None:
    if scaling is None:
        return None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope_scaling: unsupported rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return None
    need = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "freq_factors": ("factors",),
        "yarn": ("factor", "original_max_position_embeddings"),
    }[rope_type]
    for key in need:
        if scaling.get(key) is None:
            raise ConfigError(f"rope_scaling.{key}: missing for rope_type {rope_type!r}")
    if rope_type == "freq_factors" and len(scaling["factors"]) != head_dim // 2:
        raise ConfigError(
            f"rope_scaling.factors: {len(scaling['factors'])} values, expected head_dim/2 = {head_dim // 2}"
        )
    if rope_type == "llama3" and scaling["high_freq_factor"] == scaling["low_freq_factor"]:
        raise ConfigError("rope_scaling.high_freq_factor: must differ from low_freq_factor")
    return scaling
