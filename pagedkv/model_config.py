"""The one reader of a model config's attention layout: which layers slide, and by how much.

Both the KV cache sizing (``pagedkv.kv.spec``, what ``pagedkv plan`` prints) and the model
(``pagedkv.model.families`` -> ``ModelConfig``, what the engine allocates) read the window rules
here, so the cache a plan sizes is the cache the engine builds. It sits below both (it imports
only ``pagedkv.errors``) and takes already-parsed dicts: an HF ``config.json`` or GGUF metadata.

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
gemma2           ``layer_types`` when given, else the even layers (every 2nd layer full)
gemma3(_text)    ``layer_types`` when given, else all but every ``sliding_window_pattern``-th
                 layer (default 6)
others           none (llama, gemma, deepseek_v2/v3, ...)
===============  =============================================================================

A config without a ``sliding_window`` key (or with ``null``) has no sliding layer.

GGUF rules (what llama.cpp does with ``{arch}.attention.sliding_window``): phi3 every layer,
gemma2 every 2nd layer full, gemma3 every 6th layer full; other architectures (llama, qwen2,
qwen3) run full attention whatever the key says.

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
_HF_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}
_GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}

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
    window = check_window(config.get("sliding_window"))
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
        pattern = config.get("sliding_window_pattern") if model_type != "gemma2" else None
        types = _pattern_types(pattern or _HF_PATTERN[model_type], num_layers)
    elif model_type not in _QWEN and model_type not in _HF_PATTERN:
        return None, None  # a family without sliding layers
    return _layout(window, types, num_layers)


def gguf_layout(arch: str, metadata: Mapping[str, Any], num_layers: int) -> Layout:
    """``(sliding_window, layer_types)`` of GGUF metadata, as llama.cpp reads
    ``{arch}.attention.sliding_window`` (module doc). Raises ``ConfigError`` naming the key on
    a non-positive window."""
    key = f"{arch}.attention.sliding_window"
    window = check_window(metadata.get(key), key)
    if window is None or (arch != "phi3" and arch not in _GGUF_PATTERN):
        return None, None
    if arch == "phi3":
        return _layout(window, [SLIDING] * num_layers, num_layers)
    return _layout(window, _pattern_types(_GGUF_PATTERN[arch], num_layers), num_layers)


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
