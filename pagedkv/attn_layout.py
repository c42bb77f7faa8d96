"""The one reader of a model config's attention layout: how many layers, query / KV heads and
elements per head (``hf_heads``, ``gguf_heads``, ``*_num_layers``, the MLA ranks), and which
layers slide, and by how much.

Both the KV cache sizing (``pagedkv.kv.spec``, what ``pagedkv plan`` prints) and the model
(``pagedkv.model.config`` / ``pagedkv.model.families`` -> ``ModelConfig``, what the engine
allocates) read these keys here, so the cache a plan sizes is the cache the engine builds. It
sits below both (it imports only ``pagedkv.errors``) and takes already-parsed dicts: an HF
``config.json`` or GGUF metadata.

A layout is ``(sliding_window, layer_types)``: the window in tokens (the query at position
``p`` sees keys ``p - W < k <= p``, transformers' convention) and per layer
``"full_attention"`` or ``"sliding_attention"``; ``(None, None)`` when no layer slides.
``layer_windows(window, types, n)`` turns it into one entry per layer (``None`` = full).

HF rules (what transformers' config classes do with the same dict):

===============  =============================================================================
model_type       sliding layers
===============  =============================================================================
mistral,         every layer when ``sliding_window`` is set (``layer_types`` is ignored, as
mixtral, phi3    transformers ignores it for these classes)
qwen3_moe        every layer, only with ``use_sliding_window`` (its config class drops the window
                 otherwise)
qwen2, qwen3     only with ``use_sliding_window``; ``layer_types`` when given, else the layers
                 ``i >= max_window_layers`` (default 28, the config class's default: a
                 4-layer config without the key has no sliding layer)
gemma2, gpt_oss  ``layer_types`` when given, else the even layers (every 2nd layer full);
                 gpt_oss's window defaults to 128 (its config class's) when the key is missing
gemma3(_text)    ``layer_types`` when given, else all but every ``sliding_window_pattern``-th
                 layer (default 6)
others           none (llama, gemma, deepseek_v2/v3, ...)
===============  =============================================================================

A config without a ``sliding_window`` key (or with ``null``) has no sliding layer.

GGUF rules (what llama.cpp does with ``{arch}.attention.sliding_window``): phi3 every layer,
gemma2 every 2nd layer full, gemma3 every 6th layer full; gpt-oss every 2nd layer full (layer 0
slides) unless ``{arch}.attention.sliding_window_pattern`` says otherwise (llama.cpp's
``load_swa_pattern``: a bool per layer, or a period ``n``: layer ``i`` slides when
``i % n < n - 1``, every layer when ``n`` is 0); other architectures (llama, qwen2, qwen3) run
full attention whatever the key says.

Sizes. HF: ``num_hidden_layers``; ``num_attention_heads``, ``num_key_value_heads`` (default:
as many; must divide the heads), ``head_dim`` (default ``hidden_size // num_attention_heads``)
or, for multi-head latent attention (``MLA_ARCHITECTURES``), ``qk_nope_head_dim +
qk_rope_head_dim``; MLA's cache holds ``kv_lora_rank + qk_rope_head_dim`` elements per token
and layer. Missing MLA keys take transformers' config-class defaults (``MLA_DEFAULTS``). GGUF
(``A`` = ``general.architecture``): ``A.block_count``, ``A.attention.head_count``,
``A.attention.head_count_kv`` (default: head_count; a per-layer list must be uniform),
``A.attention.key_length`` or ``A.embedding_length / head_count``; MLA (``deepseek2``):
``A.attention.kv_lora_rank`` and ``A.rope.dimension_count``.

Every function raises :class:`pagedkv.errors.ConfigError` naming the key on a malformed value.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from pagedkv.errors import ConfigError

FULL, SLIDING = "full_attention", "sliding_attention"
#: The per-layer attention kinds of ``layer_types``.
LAYER_TYPES = (FULL, SLIDING)

#: Default ``max_window_layers`` of transformers' Qwen2/Qwen3 config classes.
QWEN_MAX_WINDOW_LAYERS = 28

_EVERY_LAYER = ("mistral", "mixtral", "phi3", "qwen3_moe")
_QWEN = ("qwen2", "qwen3")
#: families whose window applies only with ``use_sliding_window``
_WINDOW_FLAG = (*_QWEN, "qwen3_moe")
#: Every n-th layer is full attention when a config gives no ``layer_types``.
_HF_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "gpt_oss": 2}
_GGUF_PATTERN = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}

Layout = tuple["int | None", "list[str] | None"]


def check_window(window: Any, key: str = "sliding_window") -> int | None:
    """``window`` as a positive int, or ``None``. Raises ``ConfigError`` naming ``key``."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{key}: must be a positive integer or null, got {window!r}")
    return window


def _pattern_types(pattern: int, num_layers: int) -> list[str]:
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ConfigError(f"sliding_window_pattern: must be a positive integer, got {pattern!r}")
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def _layout(window: int | None, types: Sequence[str] | None, num_layers: int) -> Layout:
    """Validate and normalise: ``(None, None)`` unless some layer slides."""
    if window is None or types is None:
        return None, None
    types = list(types)
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"layer_types: expected {num_layers} entries of {LAYER_TYPES}, got {types!r}")
    if SLIDING not in types:
        return None, None
    return window, types


def hf_layout(model_type: str | None, config: Mapping[str, Any], num_layers: int) -> Layout:
    """``(sliding_window, layer_types)`` of an HF ``config.json`` dict (the table in the
    module doc). ``model_type``: the config's ``model_type`` (``"gemma3_text"`` and the
    architecture name ``"gemma3"`` read the same). Raises ``ConfigError`` on a non-positive
    window, a ``layer_types`` of the wrong length or kinds, or a bad pattern."""
    window = check_window(config.get("sliding_window", 128 if model_type == "gpt_oss" else None))
    if model_type in _WINDOW_FLAG and not config.get("use_sliding_window"):
        window = None
    if window is None:
        return None, None
    if model_type in _EVERY_LAYER:
        return _layout(window, [SLIDING] * num_layers, num_layers)
    types = config.get("layer_types")
    if types is None and model_type in _QWEN:
        first = config.get("max_window_layers")
        first = QWEN_MAX_WINDOW_LAYERS if first is None else first
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigError(f"max_window_layers: must be a non-negative integer, got {first!r}")
        types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    elif types is None and model_type in _HF_PATTERN:
        pattern = config.get("sliding_window_pattern") if model_type not in ("gemma2", "gpt_oss") else None
        types = _pattern_types(pattern or _HF_PATTERN[model_type], num_layers)
    elif model_type not in _QWEN and model_type not in _HF_PATTERN:
        return None, None  # a family without sliding layers
    return _layout(window, types, num_layers)


def gguf_layout(arch: str, metadata: Mapping[str, Any], num_layers: int) -> Layout:
    """``(sliding_window, layer_types)`` of GGUF metadata, as llama.cpp reads
    ``{arch}.attention.sliding_window`` (module doc). Raises ``ConfigError`` naming the key on
    a non-positive window, a gpt-oss file without one, or a malformed gpt-oss pattern."""
    key = f"{arch}.attention.sliding_window"
    window = check_window(metadata.get(key), key)
    if window is None and arch == "gpt-oss":
        raise ConfigError(f"{key}: missing from GGUF metadata (llama.cpp requires it for gpt-oss)")
    if window is None or (arch != "phi3" and arch not in _GGUF_PATTERN):
        return None, None
    if arch == "phi3":
        return _layout(window, [SLIDING] * num_layers, num_layers)
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern") if arch == "gpt-oss" else None
    if pattern is None:
        return _layout(window, _pattern_types(_GGUF_PATTERN[arch], num_layers), num_layers)
    return _layout(window, _gguf_pattern_types(f"{arch}.attention.sliding_window_pattern", pattern, num_layers),
                   num_layers)


def _gguf_pattern_types(key: str, pattern: Any, num_layers: int) -> list[str]:
    """``layer_types`` of llama.cpp's ``sliding_window_pattern`` key (``load_swa_pattern``): a
    bool per layer (true: sliding), or a period ``n`` (layer ``i`` slides when ``i % n < n - 1``;
    0: every layer). Raises ``ConfigError`` naming ``key`` for another value or length."""
    if isinstance(pattern, bool) or isinstance(pattern, (str, bytes)):
        raise ConfigError(f"{key}: expected a period or a bool per layer, got {pattern!r}")
    if hasattr(pattern, "__len__"):
        flags = pattern.tolist() if hasattr(pattern, "tolist") else list(pattern)
        if len(flags) != num_layers or any(not isinstance(f, (bool, int)) or f not in (0, 1) for f in flags):
            raise ConfigError(f"{key}: expected {num_layers} bools (one per layer), got {flags!r:.80}")
        return [SLIDING if f else FULL for f in flags]
    n = as_int(pattern, key)
    if n < 0:
        raise ConfigError(f"{key}: must be >= 0, got {n}")
    return [SLIDING if n == 0 or i % n < n - 1 else FULL for i in range(num_layers)]


def layer_windows(window: int | None, layer_types: Sequence[str] | None, num_layers: int) -> list[int | None]:
    """Per layer its sliding window in tokens, ``None`` for full attention: ``window`` on the
    layers ``layer_types`` marks sliding (every layer when ``layer_types`` is ``None`` and
    ``window`` is set). Raises ``ConfigError`` when ``layer_types`` has not ``num_layers``
    entries."""
    if window is None:
        return [None] * num_layers
    if layer_types is None:
        return [window] * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types: {len(layer_types)} entries for {num_layers} layers")
    return [window if t == SLIDING else None for t in layer_types]


def hf_layer_windows(config: Mapping[str, Any], num_layers: int) -> list[int | None]:
    """``layer_windows`` of an HF ``config.json`` dict (its own ``model_type``)."""
    return layer_windows(*hf_layout(config.get("model_type"), config, num_layers), num_layers)


def gguf_layer_windows(arch: str, metadata: Mapping[str, Any], num_layers: int) -> list[int | None]:
    """``layer_windows`` of GGUF metadata of architecture ``arch``."""
    return layer_windows(*gguf_layout(arch, metadata, num_layers), num_layers)


# ---------------------------------------------------------------------- sizes
#: Families with multi-head latent attention (HF ``model_type`` = our architecture name).
MLA_ARCHITECTURES = ("minicpm3", "deepseek_v2", "deepseek_v3")
#: transformers 5.24's config-class defaults of the MLA keys (a key missing from config.json);
#: MiniCPM3's ``v_head_dim`` default is ``hidden_size // num_attention_heads`` (``None`` here).
MLA_DEFAULTS: dict[str, dict[str, Any]] = {
    "minicpm3": {"kv_lora_rank": 256, "q_lora_rank": 768, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
                 "v_head_dim": None},
    **{a: {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128} for a in ("deepseek_v2", "deepseek_v3")},
}
_NO: Any = object()


def hf_int(config: Mapping[str, Any], key: str, default: Any = _NO, *, low: int = 1) -> Any:
    """``config[key]`` as an integer ``>= low`` (integral floats accepted); ``default`` when the
    key is missing or null. Raises ``ConfigError`` naming ``key`` when it is missing without a
    default or is not such an integer."""
    v = config.get(key)
    if v is None:
        if default is _NO:
            raise ConfigError(f"{key}: missing from config.json")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ConfigError(f"{key}: must be {what}, got {v!r}")
    return int(v)


def hf_num_layers(config: Mapping[str, Any]) -> int:
    """Decoder layers of a config.json (``num_hidden_layers``)."""
    return hf_int(config, "num_hidden_layers")


def hf_heads(arch: str, config: Mapping[str, Any], hidden: int | None = None) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)`` from a config.json: ``num_attention_heads``,
    ``num_key_value_heads`` (default: as many), and the elements of a query/key head,
    ``head_dim`` (default ``hidden // num_heads``; ``hidden=None`` reads ``hidden_size`` then)
    or for MLA (``arch`` in ``MLA_ARCHITECTURES``) ``qk_nope_head_dim + qk_rope_head_dim``
    (the config class's defaults for missing keys). Raises ``ConfigError`` naming the key for a
    non-positive size, KV heads that do not divide the heads, or an odd ``qk_rope_head_dim``
    (RoPE rotates pairs)."""
    num_heads = hf_int(config, "num_attention_heads")
    num_kv = hf_int(config, "num_key_value_heads", num_heads)
    if num_heads % num_kv:
        raise ConfigError(f"num_key_value_heads: {num_kv} does not divide num_attention_heads {num_heads}")
    if arch not in MLA_ARCHITECTURES:
        if config.get("head_dim") is None and hidden is None:
            hidden = hf_int(config, "hidden_size")
        return num_heads, num_kv, hf_int(config, "head_dim", None if hidden is None else hidden // num_heads)
    d = MLA_DEFAULTS[arch]
    nope, rope = hf_int(config, "qk_nope_head_dim", d["qk_nope_head_dim"]), hf_int(config, "qk_rope_head_dim",
                                                                                    d["qk_rope_head_dim"])
    if rope % 2:
        raise ConfigError(f"qk_rope_head_dim: must be even for RoPE, got {rope}")
    return num_heads, num_kv, nope + rope


def hf_mla_ranks(arch: str, config: Mapping[str, Any]) -> tuple[int, int]:
    """``(kv_lora_rank, qk_rope_head_dim)`` of an MLA config.json (``MLA_DEFAULTS`` for
    missing keys): the cache holds their sum per token and layer. Raises ``ConfigError``
    naming the key for a null ``kv_lora_rank`` or a non-positive size."""
    d = MLA_DEFAULTS[arch]
    if "kv_lora_rank" in config and config["kv_lora_rank"] is None:
        raise ConfigError(f"kv_lora_rank: missing (null) in a {arch} config; multi-head latent attention needs it")
    return hf_int(config, "kv_lora_rank", d["kv_lora_rank"]), hf_int(config, "qk_rope_head_dim", d["qk_rope_head_dim"])


def as_int(value: Any, name: str) -> int:
    """``value`` as an int (integral floats accepted). Raises ``ConfigError`` naming ``name``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    if out != value:
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    return out


def gguf_get(arch: str, metadata: Mapping[str, Any], key: str, default: Any = _NO) -> Any:
    """``metadata[f"{arch}.{key}"]``, or ``default``. Raises ``ConfigError`` naming the full
    key when it is missing without a default."""
    full = f"{arch}.{key}"
    if full in metadata:
        return metadata[full]
    if default is _NO:
        raise ConfigError(f"{full}: missing from GGUF metadata")
    return default


def gguf_num_layers(arch: str, metadata: Mapping[str, Any]) -> int:
    """Decoder layers of GGUF metadata (``A.block_count``). Raises ``ConfigError`` naming the key
    for a count that is not an integer in 1 .. 2^16 (a per-layer structure is built from it)."""
    n = as_int(gguf_get(arch, metadata, "block_count"), f"{arch}.block_count")
    if not 0 < n <= 1 << 16:
        raise ConfigError(f"{arch}.block_count: {n} is not a layer count in 1 .. 65536")
    return n


def gguf_heads(arch: str, metadata: Mapping[str, Any], hidden: int | None = None) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)`` of GGUF metadata: ``A.attention.head_count``,
    ``A.attention.head_count_kv`` (default: head_count; a per-layer list must hold one value),
    ``A.attention.key_length`` (default ``hidden / head_count``; ``hidden=None`` reads
    ``A.embedding_length`` then). Raises ``ConfigError`` naming the key when one is missing or
    malformed, for per-layer KV head counts that differ, or a hidden size the heads do not divide."""
    num_heads = as_int(gguf_get(arch, metadata, "attention.head_count"), f"{arch}.attention.head_count")
    num_kv = gguf_get(arch, metadata, "attention.head_count_kv", num_heads)
    if isinstance(num_kv, (list, tuple)):
        if len(set(num_kv)) != 1:
            raise ConfigError(f"{arch}.attention.head_count_kv: per-layer KV head counts {sorted(set(num_kv))} "
                              "are not supported")
        num_kv = num_kv[0]
    num_kv = as_int(num_kv, f"{arch}.attention.head_count_kv")
    head_dim = gguf_get(arch, metadata, "attention.key_length", None)
    if head_dim is None:
        if hidden is None:
            hidden = as_int(gguf_get(arch, metadata, "embedding_length"), f"{arch}.embedding_length")
        if not num_heads or hidden % num_heads:
            raise ConfigError(f"{arch}.attention.key_length: missing and embedding_length {hidden} is not "
                              f"a multiple of head_count {num_heads}")
        head_dim = hidden // num_heads
    return num_heads, num_kv, as_int(head_dim, f"{arch}.attention.key_length")


def gguf_mla_ranks(arch: str, metadata: Mapping[str, Any]) -> tuple[int, int]:
    """``(kv_lora_rank, qk_rope_head_dim)`` of an MLA GGUF (``A.attention.kv_lora_rank``,
    ``A.rope.dimension_count``). Raises ``ConfigError`` naming a missing or malformed key."""
    return tuple(as_int(gguf_get(arch, metadata, k), f"{arch}.{k}")  # type: ignore[return-value]
                 for k in ("attention.kv_lora_rank", "rope.dimension_count"))
