"""KV cache sizing (seed §01): bytes per token, page size, blocks from a byte budget.

Formulas (all results in bytes):

* MHA / GQA / MQA: per layer per token ``2 (K and V) x Hkv x d x b``; the whole model
  multiplies by the number of layers ``L``: ``2 . L . Hkv . d . b``.
* MLA (DeepSeek-V2/V3, MiniCPM3; the engine runs it, ``pagedkv.model.mla``): one compressed latent of ``kv_lora_rank + qk_rope_head_dim``
  elements per token per layer (no x2, no heads): ``L . (r + rope) . b``.
* Quantised caches (what the engine allocates for ``kv_cache_dtype``, see
  ``pagedkv.attention.quant``):
  - ``int8`` and ``fp8`` (e4m3 or e5m2): 1 byte/element plus one ``scale_bytes`` (bf16 by
    default) scale per group of ``quant_group_size`` elements; the default group is one head
    vector (``d`` elements of one head of one token, for K and V separately; for MLA, the
    whole latent of a token). fp8 keeps per-group scales too: a paged cache is written a
    token at a time with no calibration pass, and a per-vector scale keeps e4m3 inside its
    +-448 range (vLLM's uncalibrated fp8 uses one per-tensor scale of 1.0 instead: 2 bytes
    per head vector less).
  - ``int4``: two elements packed per byte (``ceil(n/2)`` bytes per vector) plus the same
    per-group scales as int8.
* Tensor parallel over ``tp`` ranks: the KV heads are split (``Hkv / tp`` per rank); when
  ``Hkv < tp`` each head is replicated so every rank holds one head. MLA's latent has no
  heads and is replicated on every rank. ``bytes_per_token`` is per rank;
  ``bytes_per_token_total`` sums over ranks (replication counted).

Every layer has the same shape here; a page (one block of one layer on one rank) is
``block_size x bytes_per_token_per_layer``.

Layer groups (``layer_windows``, see ``pagedkv.kv.groups``): full-attention layers and each
sliding window ``W`` form a group with its own block tables; one block id spans one page in
each of ``max_layers`` per-layer tensors (the largest group's layer count), so
``block_bytes = page x max_layers`` (``= page x L`` without windows). A request of ``T``
tokens holds ``ceil(T / bs)`` blocks of a full group and about ``W / bs + 1`` of a window
group (``blocks_per_request``): Gemma-2 (21 window + 21 full layers, W 4096) at 32k holds
``(2048 + 257) / (2 x 2048) = 0.563`` of the bytes of the same model with every layer full;
the floor for half the layers windowed is ``0.5 + 0.5 W / T``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.gguf_header import read_gguf_metadata
from pagedkv.kv.block_table import request_blocks_needed
from pagedkv.kv.groups import LayerGroups
from pagedkv.attn_layout import (MLA_ARCHITECTURES, gguf_heads, gguf_layer_windows, gguf_mla_ranks, gguf_num_layers,
                                 hf_heads, hf_layer_windows, hf_mla_ranks, hf_num_layers)
from pagedkv.utils import canonical_dtype, cdiv, dtype_bytes

#: dtypes that carry per-group scales counted per token.
SCALED_DTYPES = ("int8", "fp8", "int4")

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"

# HF ``model_type`` values from_hf_config understands.
_MHA_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "phi3", "gemma", "gemma2", "gemma3",
               "gemma3_text", "gpt_oss")
_MLA_TYPES = MLA_ARCHITECTURES


def check_group_size(group_size: int | None, head_dim: int) -> int:
    """The group size to use (``None`` = ``head_dim``). Raises ``ConfigError`` naming the valid
    values (the divisors of ``head_dim``) when it is not a positive divisor."""
    if group_size is None:
        return head_dim
    valid = [g for g in range(1, head_dim + 1) if head_dim % g == 0]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in valid:
        raise ConfigError(f"kv_quant_group_size: {group_size!r} does not divide head_dim {head_dim} "
                          f"(valid: {', '.join(map(str, valid))})")
    return group_size


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of a model's KV cache, enough to size it (seed §01).

    Fields: ``num_layers`` (L), ``num_kv_heads`` (Hkv, before TP split), ``head_dim`` (d,
    elements), ``dtype`` (a name or alias of ``pagedkv.utils.DTYPES``; stored canonical),
    ``tp_size`` (ranks). Set both ``kv_lora_rank`` and ``qk_rope_head_dim`` for MLA (then Hkv
    and d are ignored for sizing). ``quant_group_size`` (elements per scale, default: one head vector) and
    ``scale_bytes`` (bytes per scale, default 2 = bf16) apply to int8/fp8/int4 only.
    ``layer_windows``: per layer ``None`` (full attention) or its sliding window in tokens
    (``None``: every layer full); see the module doc for how groups change the sizes.

    Raises ``ConfigError`` naming the field on a bad value.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    tp_size: int = 1
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    quant_group_size: int | None = None
    scale_bytes: int = 2
    layer_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        _positive_int("num_layers", self.num_layers)
        _positive_int("num_kv_heads", self.num_kv_heads)
        _positive_int("head_dim", self.head_dim)
        _positive_int("tp_size", self.tp_size)
        _positive_int("scale_bytes", self.scale_bytes)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ConfigError("MLA needs both kv_lora_rank and qk_rope_head_dim (or neither)")
        if self.is_mla:
            _positive_int("kv_lora_rank", self.kv_lora_rank)
            _positive_int("qk_rope_head_dim", self.qk_rope_head_dim)
        if self.quant_group_size is not None:
            _positive_int("quant_group_size", self.quant_group_size)
        if self.layer_windows is not None:
            object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
            if len(self.layer_windows) != self.num_layers:
                raise ConfigError(f"layer_windows: {len(self.layer_windows)} entries for {self.num_layers} layers")
            LayerGroups.from_layer_windows(self.layer_windows)  # validates the windows
        if not self.is_mla:
            h, tp = self.num_kv_heads, self.tp_size
            if h >= tp and h % tp:
                raise ConfigError(f"tp_size: {h} KV heads cannot be split evenly over {tp} ranks")
            if h < tp and tp % h:
                raise ConfigError(f"tp_size: {tp} ranks cannot replicate {h} KV heads evenly")

    # ------------------------------------------------------------------ derived sizes
    @property
    def is_mla(self) -> bool:
        """True for a multi-head latent attention cache (DeepSeek-V2/V3)."""
        return self.kv_lora_rank is not None

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads each TP rank stores (``Hkv/tp``, or 1 when replicated; 1 for MLA)."""
        if self.is_mla:
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def replication(self) -> int:
        """How many ranks hold a copy of each KV head (1 = no replication)."""
        if self.is_mla:
            return self.tp_size
        return max(1, self.tp_size // self.num_kv_heads)

    def _vector_bytes(self, n: int) -> int:
        """Bytes of one cached vector of ``n`` elements, scales included."""
        if self.dtype == "int4":
            data = cdiv(n, 2)
        else:
            data = n * int(dtype_bytes(self.dtype))
        if self.dtype in SCALED_DTYPES:
            group = self.quant_group_size or n
            data += cdiv(n, group) * self.scale_bytes
        return data

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes one token occupies in one layer on one rank."""
        if self.is_mla:
            return self._vector_bytes(self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.kv_heads_per_rank * self._vector_bytes(self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies on one rank, all layers."""
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_token_total(self) -> int:
        """Bytes one token occupies summed over all TP ranks (replicated heads counted)."""
        return self.bytes_per_token * self.tp_size

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block (``block_size`` tokens) of one layer on one rank."""
        return _positive_int("block_size", block_size) * self.bytes_per_token_per_layer

    @property
    def groups(self) -> LayerGroups:
        """The layer groups (one full group without ``layer_windows``)."""
        return LayerGroups.from_layer_windows(self.layer_windows, self.num_layers)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block id on one rank: a page in each of the largest layer group's
        layers (all layers without sliding windows)."""
        return self.page_size_bytes(block_size) * self.groups.max_layers

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int | None = None) -> int:
        """Block ids a request of ``num_tokens`` tokens holds, all groups together: after its
        last (decode) step, or with ``chunk`` (tokens per step, e.g. the prefill chunk) the
        most it can hold at any step (a window group: ``ceil((W - 1 + chunk) / bs) + 1``)."""
        return request_blocks_needed(num_tokens, block_size, self.groups.windows, chunk)

    def bytes_per_request(self, num_tokens: int, block_size: int) -> int:
        """KV bytes (one rank) a request of ``num_tokens`` tokens holds after its last step."""
        return self.blocks_per_request(num_tokens, block_size) * self.block_bytes(block_size)

    def num_blocks(self, budget_bytes: int | str, block_size: int, extra_block_bytes: int = 0) -> int:
        """Blocks that fit in a per-rank budget (``int`` bytes or a size like ``"20GiB"``);
        ``extra_block_bytes``: more bytes each block id takes elsewhere (a draft model's K/V
        in the same block ids, ``pagedkv.worker.draft_proposer``).

        Raises ``ConfigError`` (naming ``kv_budget``) if not even one block fits.
        """
        budget = parse_size(budget_bytes)
        per_block = self.block_bytes(block_size) + extra_block_bytes
        n = budget // per_block
        if n < 1:
            raise ConfigError(
                f"kv_budget: {budget} bytes is smaller than one block "
                f"({per_block} bytes at block_size {block_size})"
            )
        return n

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (fields and the derived per-token sizes)."""
        return {
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "dtype": self.dtype, "tp_size": self.tp_size,
            "kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
            "mla": self.is_mla, "kv_heads_per_rank": self.kv_heads_per_rank,
            "replication": self.replication,
            "quant_group_size": (self.quant_group_size or self.head_dim) if self.dtype in SCALED_DTYPES else None,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_token_total": self.bytes_per_token_total,
            "layer_groups": self.groups.describe() if self.layer_windows is not None else None,
        }

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_config(
        cls, cfg: dict | str | Path, dtype: str | None = None, tp_size: int = 1, **kw: Any
    ) -> "KVCacheSpec":
        """Spec from a Hugging Face ``config.json``.

        ``cfg`` is a dict, a path to a ``config.json`` (or its folder), or the name of a
        shipped config (see ``known_configs()``, e.g. ``"llama-3-8b"``). ``dtype=None``
        uses the config's ``torch_dtype``/``dtype`` (bf16 if absent). Architectures:
        llama, qwen2/qwen3/qwen3_moe, mistral/mixtral, phi3, gemma/gemma2/gemma3, deepseek_v2/v3 and minicpm3 (MLA).
        Sliding-window layers (``pagedkv.attn_layout.hf_layer_windows``, the rules the model
        reads too) get their own layer group, sized by their window.

        Raises ``ConfigError`` on an unknown ``model_type`` or a missing field (named; an MLA
        config's missing ``kv_lora_rank`` / ``qk_rope_head_dim`` take transformers' defaults).
        """
        cfg = load_hf_config(cfg)
        # Multimodal wrappers keep the language model under text_config.
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            cfg = cfg["text_config"]
        model_type = cfg.get("model_type")
        if dtype is None:
            dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bf16"

        # layers, heads and head sizes: pagedkv.attn_layout, the reader the model uses too
        if model_type in _MLA_TYPES:
            layers = hf_num_layers(cfg)
            r, rope = hf_mla_ranks(model_type, cfg)
            return cls(num_layers=layers, num_kv_heads=1, head_dim=r + rope, dtype=dtype, tp_size=tp_size,
                       kv_lora_rank=r, qk_rope_head_dim=rope, **kw)
        if model_type in _MHA_TYPES:
            _, kv_heads, head_dim = hf_heads(model_type, cfg)
            layers = hf_num_layers(cfg)
            return cls(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                       tp_size=tp_size, layer_windows=_windowed(hf_layer_windows(cfg, layers)), **kw)
        raise ConfigError(
            f"model_type: unknown architecture {model_type!r} "
            f"(supported: {', '.join(_MHA_TYPES + _MLA_TYPES)})"
        )

    @classmethod
    def from_gguf(
        cls, path: str | Path, dtype: str = "fp32", tp_size: int = 1, **kw: Any
    ) -> "KVCacheSpec":
        """Spec from a GGUF file's metadata (only the header is read, no tensors).

        Keys used (``A`` = ``general.architecture``): ``A.block_count``,
        ``A.attention.head_count``, ``A.attention.head_count_kv`` (default: head_count),
        ``A.attention.key_length`` or ``A.embedding_length / head_count``; for
        ``deepseek2``: ``A.attention.kv_lora_rank`` and ``A.rope.dimension_count``.
        ``dtype`` is the cache dtype (default fp32: the CPU engine caches in fp32). Sliding
        layers: ``pagedkv.attn_layout.gguf_layer_windows`` (``A.attention.sliding_window``).

        Raises ``ConfigError`` naming the missing key, or if the file is not GGUF.
        """
        meta = read_gguf_metadata(path)
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            raise ConfigError(f"{path}: GGUF lacks 'general.architecture'")

        try:  # layers, heads and head sizes: pagedkv.attn_layout, the reader the model uses too
            layers = gguf_num_layers(arch, meta)
            if arch == "deepseek2":
                r, rope = gguf_mla_ranks(arch, meta)
                return cls(num_layers=layers, num_kv_heads=1, head_dim=r + rope, dtype=dtype,
                           tp_size=tp_size, kv_lora_rank=r, qk_rope_head_dim=rope, **kw)
            _, kv_heads, head_dim = gguf_heads(arch, meta)
            windows = _windowed(gguf_layer_windows(arch, meta, layers))
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        return cls(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, tp_size=tp_size,
                   layer_windows=windows, **kw)

    @classmethod
    def from_model_config(cls, mc: Any, dtype: str, tp_size: int = 1, **kw: Any) -> "KVCacheSpec":
        """Spec of the cache the engine allocates for a loaded model: ``mc`` is a
        ``pagedkv.model.config.ModelConfig`` (read for ``num_layers``, ``num_kv_heads``,
        ``head_dim`` and ``layer_windows()``, whose rules are ``pagedkv.attn_layout``'s, as
        ``from_hf_config``'s and ``from_gguf``'s are; an MLA model, ``kv_lora_rank`` set, gives
        an MLA spec as ``from_hf_config`` does). ``dtype``: the cache dtype; ``kw``: the
        other fields (``quant_group_size``, ...). Raises ``ConfigError`` on a bad field."""
        r = getattr(mc, "kv_lora_rank", None)
        if r is not None:
            rope = mc.qk_rope_head_dim
            return cls(num_layers=mc.num_layers, num_kv_heads=1, head_dim=r + rope, dtype=dtype, tp_size=tp_size,
                       kv_lora_rank=r, qk_rope_head_dim=rope, **kw)
        return cls(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=dtype,
                   tp_size=tp_size, layer_windows=_windowed(mc.layer_windows()), **kw)


# ---------------------------------------------------------------------- helpers
def _windowed(windows: list[int | None]) -> tuple[int | None, ...] | None:
    """``layer_windows`` for the spec: ``None`` when every layer is full (one layer group)."""
    return tuple(windows) if any(w is not None for w in windows) else None


def known_configs() -> list[str]:
    """Names of the Hugging Face configs shipped in ``pagedkv/kv/configs/``."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def known_config(name: str) -> dict[str, Any]:
    """A shipped HF ``config.json`` as a dict (e.g. ``"deepseek-v3"``). Raises ``ConfigError``."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"model: unknown config name {name!r} (known: {', '.join(known_configs())})")
    return json.loads(path.read_text())


def json_object(loaded: Any, path: Path | str) -> dict[str, Any]:
    """``loaded`` (a parsed config.json read from ``path``) if it is a JSON object. Raises
    ``ConfigError`` naming the file and what it holds instead (an array, ``null``, ...)."""
    if not isinstance(loaded, dict):
        kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(loaded), "number")
        raise ConfigError(f"{path}: not a config.json (a JSON object), got a JSON {kind}")
    return loaded


def load_hf_config(cfg: dict | str | Path) -> dict[str, Any]:
    """A config dict from a dict, a config.json path/folder, or a shipped config name.
    Raises ``ConfigError`` for an unreadable file, one that is not a JSON object (a list,
    ``null``), or a name that is neither."""
    if isinstance(cfg, dict):
        return cfg
    path = Path(cfg)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            loaded = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: not a readable config.json ({exc})") from exc
        return json_object(loaded, path)
    if isinstance(cfg, str) and "/" not in cfg and not cfg.endswith(".json"):
        return known_config(cfg)
    raise ConfigError(f"model: {cfg} is neither a config.json nor a known config name")


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_UNITS[_p + "b"] = 1000**_i       # decimal: KB, MB, GB, ...
    _SIZE_UNITS[_p + "ib"] = 1024**_i      # binary: KiB, MiB, GiB, ...
    _SIZE_UNITS[_p] = 1024**_i             # bare K/M/G: binary, as most CLIs do
    _SIZE_UNITS[_p + "i"] = 1024**_i


def parse_size(s: str | int) -> int:
    """Bytes from ``123``, ``"512MiB"``, ``"20GiB"``, ``"2GB"`` (=2e9), ``"1.5G"`` (binary).

    Raises ``ConfigError`` (naming ``size``) on a negative or unparsable value.
    """
    if isinstance(s, bool):
        raise ConfigError(f"size: expected bytes or a size string, got {s!r}")
    if isinstance(s, int):
        if s < 0:
            raise ConfigError(f"size: must be >= 0, got {s}")
        return s
    if isinstance(s, float) and s >= 0 and s.is_integer():
        return int(s)
    m = _SIZE_RE.match(str(s))
    if not m:
        raise ConfigError(f"size: cannot parse {s!r} (e.g. 20GiB, 512MiB, 2GB, 123)")
    num, unit = m.groups()
    return int(float(num) * _SIZE_UNITS[unit.lower()])
